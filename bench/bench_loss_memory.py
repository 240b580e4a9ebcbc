"""Peak memory of the loss (output layer + cross-entropy, forward and backward), counted, at a reduced 1.3B shape.

    python bench/bench_loss_memory.py            # N = 512 tokens (seq 128 x micro-batch 4), vocab 50257 -> 50304, h 32
    python bench/bench_loss_memory.py --tiny     # seconds (the smoke test)

Bytes are counted, not sampled: `gptpar.testing.LiveTensorBytes` adds up every tensor the loss's forward and backward
create while they are alive (the hidden states, the weight and the labels exist before and are not counted; the
gradients of the hidden states and of the weight are, as they are created). So the figure does not depend on the
allocator or the machine, and extrapolates exactly: per path, peak = a * N * V + b * N * h + c * V * h + small terms,
printed beside the measurement, then evaluated at the full 1.3B shape (seq 2048 x micro-batch 4 = 8192 tokens).

Paths, in the training model's dtype (bf16, as on a GPU; fp32 too):
  model       what GPTModel runs: `lm_loss` (the output layer fused with the loss), or, in a gptpar that has no
              lm_loss, GPTModel's own loss path (`lm_logits` + GPTLoss; the fused CPU loss for fp32 at tp = 1);
  pipeline    the pipeline's last stage: `lm_logits` + `GPTLoss`;
  textbook    `F.cross_entropy(logits.float())` after `F.linear`, the usual way (for scale).
The script runs against older gptpar checkouts too (`PYTHONPATH=OLD python bench/bench_loss_memory.py`, with this
file copied there) to measure the code before a change with the same counter.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gptpar.model import gpt  # noqa: E402
from gptpar.model.config import GPTConfig  # noqa: E402
from gptpar.testing import LiveTensorBytes  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def loss_paths(config: GPTConfig, dtype):
    """{name: fn(embedding, hidden (s, b, h), labels (b, s)) -> scalar loss}."""
    loss_fn = gpt.GPTLoss(config.vocab_size)

    def pipeline(emb, hidden, labels):
        return loss_fn(gpt.lm_logits(emb, hidden), labels)

    def model(emb, hidden, labels):
        if hasattr(gpt, "lm_loss"):
            return gpt.GPTLoss.reduce(gpt.lm_loss(emb, hidden, labels.t(), config.vocab_size), None)
        # An older gptpar: GPTModel.forward's own choice between its fused CPU loss (fp32, tp = 1) and logits +
        # GPTLoss (every other case, the GPU's included).
        if dtype == torch.float32 and hasattr(gpt, "linear_cross_entropy"):
            losses = gpt.linear_cross_entropy(hidden, emb.word_embeddings.weight, labels.t(),
                                              vocab_size=config.vocab_size)
            return loss_fn.reduce(losses, None)
        return pipeline(emb, hidden, labels)

    def textbook(emb, hidden, labels):
        logits = F.linear(hidden, emb.word_embeddings.weight[:config.vocab_size])  # (s, b, V real)
        return F.cross_entropy(logits.float().reshape(-1, config.vocab_size), labels.t().reshape(-1))

    return {"model": model, "pipeline": pipeline, "textbook": textbook}


def measure(fn, emb, hidden, labels, repeats: int) -> dict:
    """Peak bytes created and alive at once during forward + backward; the largest tensor; median seconds."""
    times, peak, largest = [], 0, 0
    for _ in range(repeats):
        hidden.grad = emb.word_embeddings.weight.grad = None
        start = time.perf_counter()
        with LiveTensorBytes() as m:
            fn(emb, hidden, labels).backward()
        times.append(time.perf_counter() - start)
        peak, largest = max(peak, m.peak), max(largest, m.largest)
    return {"peak_bytes": peak, "largest_bytes": largest, "seconds_median": statistics.median(times)}


GPU_BLOCK_BYTES = 16 << 20  # one fp32 block of gptpar's loss on a GPU (cross_entropy._BLOCK_ELEMENTS_ACCELERATOR)


def predicted_bytes(path: str, n: int, v: int, v_real: int, h: int, dtype_bytes: int, block_bytes: int) -> int:
    """The accounting of each path's peak (bytes), to compare with the count and to extrapolate.

    model / pipeline (gptpar, block-wise): the logits in their dtype (which become their gradient in place) + at
    most three fp32 blocks (a bf16 block's conversion, logsumexp's temporaries) + the gradients of the hidden states
    and of the weight: an upper bound. textbook: F.cross_entropy's backward, when
    three fp32 (N, V) tensors are alive: the saved log-probabilities, nll_loss's zero-filled gradient and
    log_softmax's gradient (its forward peak, bf16 logits + their fp32 copy + the log-probabilities, is lower)."""
    if path in ("model", "pipeline"):
        return n * v * dtype_bytes + 3 * min(block_bytes, n * v_real * 4) + n * h * dtype_bytes + v * h * dtype_bytes
    return n * v_real * 12


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32, help="small: this CPU's bf16 GEMM with K = 50304 (the "
                                                            "hidden gradient) takes ~20 s at N 64 x h 256")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--block-elements", type=int, default=1 << 18,
                   help="gptpar's fp32 block on this CPU (default 1 MB: about the share of the logits that a GPU's 16 "
                        "MB block is at the 1.3B shape, so the count extrapolates; the CPU's own default is 32 MB)")
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.batch, args.hidden, args.vocab_size, args.repeats = 32, 2, 16, 500, 1
    from gptpar.tensor_parallel import cross_entropy

    if hasattr(cross_entropy, "_BLOCK_ELEMENTS"):  # (older gptpar had no blocks)
        cross_entropy._BLOCK_ELEMENTS["cpu"] = args.block_elements
    config = GPTConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1, seq_length=args.seq,
                       vocab_size=args.vocab_size)
    v, n, h = config.padded_vocab_size(1), args.seq * args.batch, args.hidden
    print(f"loss memory | N = {n} tokens (seq {args.seq} x micro-batch {args.batch}), V = {v} (real "
          f"{args.vocab_size}), h = {h} | torch {torch.__version__} | load {os.getloadavg()[0]:.1f}")
    rows = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        torch.manual_seed(0)
        emb = gpt.GPTEmbedding(config, words_only=True, dtype=dtype)
        hidden = torch.randn(args.seq, args.batch, h, dtype=dtype, requires_grad=True)
        labels = torch.randint(0, args.vocab_size, (args.batch, args.seq))
        for path, fn in loss_paths(config, dtype).items():
            res = measure(fn, emb, hidden, labels, args.repeats)
            pred = predicted_bytes(path, n, v, args.vocab_size, h, dtype.itemsize, 4 * args.block_elements)
            rows.append(dict(dtype=name, path=path, n=n, v=v, h=h, **res, predicted_bytes=pred,
                             bytes_per_logit=res["peak_bytes"] / (n * v)))
            r = rows[-1]
            print(f"  {name:5s} {path:9s} peak {r['peak_bytes'] / 2 ** 20:9.1f} MiB = {r['bytes_per_logit']:5.2f} "
                  f"bytes/logit | largest tensor {r['largest_bytes'] / 2 ** 20:8.1f} MiB | "
                  f"{r['seconds_median']:.3f} s"
                  + f" | accounted {pred / 2 ** 20:9.1f} MiB", flush=True)
    full = dict(n=2048 * 4, v=50304, v_real=50257, h=2048)
    print(f"at the 1.3B shape (N = {full['n']}, V = {full['v']}, h = {full['h']}; a GPU's block), by the same "
          "accounting:")
    for name in args.dtypes.split(","):
        for path in ("model", "textbook"):
            b = predicted_bytes(path, **full, dtype_bytes=DTYPES[name].itemsize, block_bytes=GPU_BLOCK_BYTES)
            print(f"  {name:5s} {path:9s} {b / 2 ** 30:6.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("summary: " + "; ".join(f"{r['dtype']} {r['path']} {r['bytes_per_logit']:.2f} B/logit" for r in rows))


if __name__ == "__main__":
    main()
