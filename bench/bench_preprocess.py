"""Data-pipeline throughput: preprocessing tokens/s at 1 and 2 workers, and index building for 1e8 tokens.

    python bench/bench_preprocess.py            # a few minutes on a 2-core CPU
    python bench/bench_preprocess.py --tiny     # seconds; the smoke test runs this

1. The demo corpus (Python stdlib sources) is tokenised with a freshly trained SentencePiece BPE model, at
   --workers 1 and 2; outputs are checked identical; wall time includes worker start-up.
2. An index of --index-tokens tokens (documents ~ 1000 tokens, a sparse .bin: index building reads only
   the sizes) gets its GPT sample index for one epoch built cold (nothing cached) and then loaded warm (from
   cache), for each of --seq-lengths, then random sample reads; then a two-way blending index of
   --blend-samples samples. The machine is shared, so the load average is printed with the figures.
"""
import argparse
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from gptpar.tools import make_demo_corpus, train_tokenizer  # noqa: E402
from gptpar.data.blending import build_blending_indices  # noqa: E402
from gptpar.data.gpt_dataset import GPTDataset  # noqa: E402
from gptpar.data.indexed import IndexedDataset, write_index  # noqa: E402
from gptpar.data.preprocess import preprocess  # noqa: E402


def bench_preprocess(work, max_docs, vocab_size):
    corpus = os.path.join(work, "demo.jsonl")
    make_demo_corpus.main(["--output", corpus] + (["--max-docs", str(max_docs)] if max_docs else []))
    train_tokenizer.train([corpus], vocab_size, "bpe", os.path.join(work, "tok"), byte_fallback=True)
    rows = []
    for workers in (1, 2):
        start, cpu_start = time.perf_counter(), os.times()
        s = preprocess(corpus, ["text"], os.path.join(work, "tok.model"), os.path.join(work, f"w{workers}"),
                       workers=workers, append_eod=True, progress=False)
        wall, cpu_end = time.perf_counter() - start, os.times()
        # CPU seconds of this process and its (joined) workers: shows whether cores, not the code, limit scaling.
        cpu = sum(cpu_end[i] - cpu_start[i] for i in range(4))
        rows.append((workers, s["docs"], s["tokens"]["text"], wall, s["tokens"]["text"] / wall, cpu))
    same = all(open(os.path.join(work, f"w1_text_document{x}"), "rb").read() ==
               open(os.path.join(work, f"w2_text_document{x}"), "rb").read() for x in (".bin", ".idx"))
    return rows, same, os.path.getsize(corpus)


def bench_index(work, num_tokens, seq_lengths, blend_samples, seed=1234):
    rng = np.random.default_rng(0)
    # Random document boundaries: num_tokens in total, ~1000 tokens per document on average.
    cuts = 1 + np.sort(rng.choice(num_tokens - 1, size=max(num_tokens // 1000 - 1, 0), replace=False))
    sizes = np.diff(np.concatenate([[0], cuts, [num_tokens]]))
    prefix = os.path.join(work, "synthetic")
    write_index(prefix + ".idx", np.uint16, sizes, np.arange(len(sizes) + 1))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(sizes.sum()) * 2)   # sparse: the index builder never reads token values
    indexed = IndexedDataset(prefix)
    result = dict(docs=len(sizes), seq={})
    for seq_length in seq_lengths:
        num_samples = num_tokens // seq_length   # one epoch
        cache = os.path.join(work, f"cache{seq_length}")
        start = time.perf_counter()
        ds = GPTDataset(indexed, np.arange(len(sizes)), seq_length, seed, num_samples, cache_dir=cache)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        GPTDataset(indexed, np.arange(len(sizes)), seq_length, seed, num_samples, cache_dir=cache)
        warm = time.perf_counter() - start
        reads = min(len(ds), 2000)
        order = rng.integers(0, len(ds), size=reads)
        start = time.perf_counter()
        for i in order:
            ds[int(i)]
        result["seq"][seq_length] = dict(samples=len(ds), cold=cold, warm=warm,
                                         reads_per_s=reads / (time.perf_counter() - start))
    start = time.perf_counter()
    build_blending_indices([0.3, 0.7], blend_samples)
    result["blend"] = time.perf_counter() - start
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    p.add_argument("--max-docs", type=int, default=None, help="demo corpus documents (default: all)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--index-tokens", type=float, default=1e8)
    p.add_argument("--seq-lengths", default="2048,128", help="comma-separated; one index each")
    p.add_argument("--blend-samples", type=int, default=1_000_000)
    p.add_argument("--workdir", default=None, help="keep files here (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.tiny:
        args.max_docs, args.vocab_size, args.index_tokens, args.blend_samples = 20, 400, 1e5, 1000
    print(f"load average (1, 5, 15 min) at the start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or tmp
        os.makedirs(work, exist_ok=True)
        rows, same, corpus_bytes = bench_preprocess(work, args.max_docs, args.vocab_size)
        idx = bench_index(work, int(args.index_tokens), [int(x) for x in args.seq_lengths.split(",")],
                          args.blend_samples)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, numpy {np.__version__}")
    print(f"preprocessing ({corpus_bytes / 1e6:.1f} MB jsonl, vocab {args.vocab_size}; outputs identical: {same})")
    print("| workers | docs | tokens | wall (s) | tokens/s | CPU s (all processes) |\n|---|---|---|---|---|---|")
    for workers, docs, tokens, wall, rate, cpu in rows:
        print(f"| {workers} | {docs:,} | {tokens:,} | {wall:.2f} | {rate:,.0f} | {cpu:.1f} |")
    print(f"index for {int(args.index_tokens):,} tokens ({idx['docs']:,} documents, one epoch):")
    print("| seq_length | samples | build, cold (s) | load from cache (s) | random sample reads/s |")
    print("|---|---|---|---|---|")
    for seq_length, r in idx["seq"].items():
        print(f"| {seq_length} | {r['samples']:,} | {r['cold']:.3f} | {r['warm']:.3f} | {r['reads_per_s']:,.0f} |")
    print(f"blending index of {args.blend_samples:,} samples over 2 datasets: {idx['blend']:.2f} s")
    print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if not same:
        sys.exit("error: --workers 1 and --workers 2 outputs differ")


if __name__ == "__main__":
    main()
