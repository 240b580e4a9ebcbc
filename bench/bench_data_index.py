"""Data index build time and peak memory: gptpar now, gptpar's first index (the plain numpy and Python-loop one kept in
gptpar.testing.data_index_reference) and, given a Python that has it, Megatron-Core, on the same generated files.

    python bench/bench_data_index.py                          # a few seconds on a 2-core CPU
    python bench/bench_data_index.py --docs 200000 --sample-tokens 3e9 --blend-samples 14.6e6 \\
        --megatron-python /path/to/venv/bin/python             # megatron-core 0.19.x importable there

The corpus: --datasets files of --docs documents in all (sizes drawn around --doc-tokens, uint16 tokens, sparse
.bin files: building an index reads only the .idx). Three builds, each in a fresh process per library, one at a time:
  single  every index of one file holding all the documents, for --sample-tokens tokens of samples at --seq-length
          (GPTDataset: document order, sample starts, shuffle, written to a fresh cache folder as .npy)
  blend   the --datasets files blended with random weights for the same number of samples: the blending index
          and each member's indices (build_train_valid_test_datasets; Megatron's BlendedMegatronDatasetBuilder)
  greedy  the blending index alone, --blend-samples samples over the --datasets weights
Time is the build's wall time and its CPU time (user + system of the process, getrusage): every build here runs on one
thread, so on a shared host CPU time is the fairer figure, the wall time grows with the load. Memory is the peak
resident set's growth during the build (ru_maxrss after minus before: a high-water mark, so imports and the opened
files are not counted). With --repeat N each build runs N times, interleaved, and the smallest figures are kept.
gptpar's indices are checked identical, file by file, to the first implementation's before any number is printed.
"""
import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIBRARIES = ("gptpar", "gptpar-first", "megatron")
CASES = ("single", "blend", "greedy")


def make_corpus(work, num_docs, doc_tokens, num_datasets, seed):
    """Writes all.bin/.idx and part{k}.bin/.idx; returns (prefix of all, prefixes of the parts, their weights)."""
    import numpy as np
    from gptpar.data.indexed import write_index
    rng = np.random.default_rng(seed)
    sizes = np.maximum(1, rng.exponential(doc_tokens, size=num_docs)).astype(np.int64)
    parts = np.array_split(sizes, num_datasets)
    prefixes = [os.path.join(work, "all")] + [os.path.join(work, f"part{k}") for k in range(num_datasets)]
    for prefix, s in zip(prefixes, [sizes] + parts):
        write_index(prefix + ".idx", np.uint16, s, np.arange(len(s) + 1))
        with open(prefix + ".bin", "wb") as f:
            f.truncate(int(s.sum()) * 2)
    weights = (rng.random(num_datasets) + 0.1).round(4).tolist()
    return prefixes[0], prefixes[1:], weights, int(sizes.sum())


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(args):
    """One library, one case, this process: prints a JSON line {seconds, cpu_seconds, peak_mib, samples}."""
    spec = json.load(open(os.path.join(args.workdir, "corpus.json")))
    cache = os.path.join(args.workdir, f"cache-{args.library}-{args.case}")
    n = spec["num_samples"]
    build = (_megatron if args.library == "megatron" else _gptpar)(args.library, args.case, spec, cache)
    before, cpu = peak_rss_mib(), cpu_seconds()
    start = time.perf_counter()
    samples = build()
    seconds = time.perf_counter() - start
    print(json.dumps(dict(seconds=seconds, cpu_seconds=cpu_seconds() - cpu, peak_mib=peak_rss_mib() - before,
                          samples=samples, requested=n)))


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _gptpar(library, case, spec, cache):
    sys.path.insert(0, ROOT)
    import numpy as np
    from gptpar.data import blending, gpt_dataset
    if library == "gptpar-first":
        from gptpar.testing import data_index_reference as first
        gpt_dataset.build_indices = first.build_indices
        gpt_dataset.build_blending_indices = first.build_blending_indices
        greedy = first.build_blending_indices
    else:
        blending._compiled_helper()  # compiled once per machine, not part of a build
        greedy = blending.build_blending_indices
    gpt_dataset.log = lambda msg: None
    if case == "greedy":
        return lambda: len(greedy(np.array(spec["weights"]), spec["blend_samples"])[0])
    path = spec["single"] if case == "single" else " ".join(f"{w} {p}" for w, p in zip(spec["weights"], spec["parts"]))
    n, seq, seed = spec["num_samples"], spec["seq_length"], spec["seed"]
    return lambda: len(gpt_dataset.build_train_valid_test_datasets(path, "1", seq, seed, (n, 0, 0), cache)[0])


def _megatron(library, case, spec, cache):
    import numpy as np
    import torch
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: 0  # some logging paths ask for it; nothing here runs on a GPU
    import logging
    logging.disable(logging.WARNING)
    from megatron.core.datasets import helpers
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if case == "greedy":
        def greedy():
            weights = np.array(spec["weights"], dtype=np.float64)
            weights /= weights.sum()
            size = spec["blend_samples"]
            dataset_index = np.zeros(size, dtype=np.int16)
            dataset_sample_index = np.zeros(size, dtype=np.int64)
            helpers.build_blending_indices(dataset_index, dataset_sample_index, weights, len(weights), size, False)
            return size
        return greedy

    class Tokenizer:  # what the config reads of a tokenizer
        vocab_size, eod, pad, bos = 65536, 0, 1, 2
        unique_identifiers = {"class": "bench"}

    blend = ([spec["single"]], None) if case == "single" else (spec["parts"], spec["weights"])
    config = GPTDatasetConfig(random_seed=spec["seed"], sequence_length=spec["seq_length"], blend=blend,
                              split="100,0,0", path_to_cache=cache, tokenizer=Tokenizer(), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False)

    def build():
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [spec["num_samples"], 0, 0], lambda: True,
                                                    config).build()
        return len(train)
    return build


def run_worker(python, library, case, workdir):
    env = dict(os.environ, PYTHONPATH=ROOT if library != "megatron" else "")
    out = subprocess.run([python, os.path.abspath(__file__), "--worker", library, case, "--workdir", workdir],
                         capture_output=True, text=True, env=env, cwd=workdir)
    if out.returncode != 0:
        raise RuntimeError(f"{library} {case} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_files(a, b):
    import numpy as np
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)) or not names:
        return False
    for name in names:
        x, y = np.load(os.path.join(a, name)), np.load(os.path.join(b, name))
        if x.dtype != y.dtype or not np.array_equal(x, y):
            return False
    return True


def megatron_usable(python):
    if not python:
        return False, "no --megatron-python given"
    out = subprocess.run([python, "-c", "import megatron.core.datasets.helpers, megatron.core; "
                          "print(megatron.core.__version__)"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=""))
    if out.returncode != 0:
        return False, f"megatron-core does not import in {python}: {out.stderr.strip().splitlines()[-1:]}"
    return True, out.stdout.strip().splitlines()[-1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=20_000, help="documents in the corpus, all files together")
    p.add_argument("--doc-tokens", type=int, default=500, help="mean tokens per document")
    p.add_argument("--datasets", type=int, default=10, help="files the documents are split into for the blend")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--sample-tokens", type=float, default=3e8, help="tokens of samples requested (epochs = this "
                   "/ corpus tokens)")
    p.add_argument("--blend-samples", type=float, default=1e6, help="samples of the greedy-only blending index")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeat", type=int, default=1, help="runs of each build (fresh caches), the smallest figures kept")
    p.add_argument("--megatron-python", default=None, help="a python with megatron-core importable")
    p.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated subset of " + ",".join(LIBRARIES))
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    p.add_argument("--workdir", default=None, help="where the corpus and caches go (a temporary folder if unset)")
    p.add_argument("--worker", nargs=2, metavar=("LIBRARY", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.library, args.case = args.worker
        return worker(args)
    libraries, cases = args.libraries.split(","), args.cases.split(",")
    if not set(libraries) <= set(LIBRARIES) or not set(cases) <= set(CASES):
        p.error(f"--libraries takes {LIBRARIES}, --cases {CASES}")
    ok, megatron_version = megatron_usable(args.megatron_python) if "megatron" in libraries else (False, "not asked")
    if not ok and "megatron" in libraries:
        print(f"Megatron-Core skipped: {megatron_version}")
        libraries.remove("megatron")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or tmp
        os.makedirs(work, exist_ok=True)
        sys.path.insert(0, ROOT)
        single, parts, weights, tokens = make_corpus(work, args.docs, args.doc_tokens, args.datasets, args.seed)
        num_samples = int(args.sample_tokens) // args.seq_length
        json.dump(dict(single=single, parts=parts, weights=weights, num_samples=num_samples, seed=args.seed,
                       seq_length=args.seq_length, blend_samples=int(args.blend_samples)),
                  open(os.path.join(work, "corpus.json"), "w"))
        print(f"corpus: {args.docs:,} documents, {tokens:,} tokens in {args.datasets} files (+ one file of all); "
              f"{num_samples:,} samples of {args.seq_length} ({args.sample_tokens / tokens:.1f} epochs); greedy "
              f"blend {int(args.blend_samples):,} samples; weights {weights}")
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; Megatron-Core: {megatron_version}")
        results = {}
        for round_ in range(args.repeat):
            for case in cases:
                for library in libraries:
                    python = args.megatron_python if library == "megatron" else sys.executable
                    # A fresh cache folder: every run builds (nothing left by an earlier run or round is loaded).
                    shutil.rmtree(os.path.join(work, f"cache-{library}-{case}"), ignore_errors=True)
                    r = run_worker(python, library, case, work)
                    old = results.setdefault((case, library), r)
                    for key in ("seconds", "cpu_seconds", "peak_mib"):
                        old[key] = min(old[key], r[key])
        if {"gptpar", "gptpar-first"} <= set(libraries):
            for case in cases:
                if case != "greedy":
                    same = same_files(os.path.join(work, f"cache-gptpar-{case}"),
                                      os.path.join(work, f"cache-gptpar-first-{case}"))
                    print(f"{case}: gptpar's indices identical to the first implementation's: {same}")
                    if not same:
                        return 1
        print(f"{'case':8} {'library':13} {'samples':>12} {'wall s':>8} {'CPU s':>8} {'peak MiB':>9} "
              f"{'CPU vs gptpar':>14} {'memory vs gptpar':>17}")
        for case in cases:
            ours = results.get((case, "gptpar"))
            for library in libraries:
                r = results[case, library]
                ratio = (f"{r['cpu_seconds'] / max(ours['cpu_seconds'], 1e-3):>13.2f}x "
                         f"{r['peak_mib'] / max(ours['peak_mib'], 1):>16.2f}x" if ours else "")
                print(f"{case:8} {library:13} {r['samples']:>12,} {r['seconds']:>8.2f} {r['cpu_seconds']:>8.2f} "
                      f"{r['peak_mib']:>9.0f} {ratio}")
        print("ratios are the library's over gptpar's: above 1 means gptpar is faster / smaller")
    return 0


if __name__ == "__main__":
    sys.exit(main())
