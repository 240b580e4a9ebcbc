"""What padding a float8 GEMM costs (training.precision fp8), counted on the CPU: FLOPs and bytes written.

    python bench/bench_fp8_padding.py            # every padded GEMM of the shipped configs, 4096 tokens (mbs 2 x 2048)
    python bench/bench_fp8_padding.py --tiny     # one small shape (the smoke test)

For each weight slice that gptpar pads (gptpar.tensor_parallel.float8.plan_float8_gemm: a dimension not divisible by
16), one forward + backward of gptpar's float8 GEMM (torchao's emulation: exact float8 rounding, fp32 matmuls) runs
twice on the same tensors: padded as gptpar runs it, and unpadded (the emulation does not check shapes, where
torch._scaled_mm on a GPU refuses them). torch.utils.flop_counter counts the matmul FLOPs; a dispatch mode adds up
the bytes of every tensor the float8 GEMM's ops write at the level gptpar and torchao call them (the pads, the
float8 casts, the GEMM outputs and gradients; not inside the GEMM kernel), which is the memory traffic that padding
adds. Everything but the token count is counted at full size; the bytes are measured at two token counts and put
on the line through them (every op's output is a fixed size or proportional to the tokens), so --tokens costs
nothing to raise. Times are not measured: emulated float8 says nothing about float8 speed.
"""
import argparse
import glob
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gptpar.tensor_parallel.float8 import Float8Gemm, Float8Matmul, layer_float8_gemms  # noqa: E402
from gptpar.config import load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VIEWS = {"view", "_unsafe_view", "t", "transpose", "slice", "as_strided", "detach", "alias", "_reshape_alias",
         "expand", "unsqueeze", "squeeze", "permute", "select"}


class BytesWritten(TorchDispatchMode):
    """Bytes of every tensor an op outputs (views excluded: they write nothing), per op name."""

    def __init__(self):
        super().__init__()
        self.by_op = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name not in VIEWS:
            outs = out if isinstance(out, (tuple, list)) else [out]
            n = sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
            self.by_op[name] = self.by_op.get(name, 0) + n
        return out


def count(mm: Float8Matmul, gemm: Float8Gemm, tokens: int, seed: int = 0):
    """(matmul FLOPs, bytes written) of one forward + backward of `gemm` over `tokens` rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, gemm.in_features, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(gemm.out_features, gemm.in_features, generator=gen) * 0.02).bfloat16().requires_grad_()
    dy = torch.randn(tokens, gemm.out_features, generator=gen).bfloat16()
    with FlopCounterMode(display=False) as flops, BytesWritten() as written:
        mm.linear(x, w, gemm).backward(dy)
    return flops.get_total_flops(), written.by_op


def padding_cost(mm: Float8Matmul, gemm: Float8Gemm, tokens: int, probe=(64, 128)) -> dict:
    """Padded vs unpadded `gemm`: FLOPs at `tokens`, bytes on the line through the two `probe` token counts."""
    unpadded = Float8Gemm(gemm.name, gemm.out_features, gemm.in_features, "fp8", gemm.out_features, gemm.in_features)
    flops, written = {}, {}
    for label, g in (("padded", gemm), ("unpadded", unpadded)):
        (f0, b0), (f1, b1) = (count(mm, g, m) for m in probe)
        per_token = {k: (b1.get(k, 0) - b0.get(k, 0)) / (probe[1] - probe[0]) for k in set(b0) | set(b1)}
        at = {k: b0.get(k, 0) + per_token[k] * (tokens - probe[0]) for k in per_token}
        flops[label] = f0 + (f1 - f0) / (probe[1] - probe[0]) * (tokens - probe[0])
        written[label] = at
    total = {k: sum(v.values()) for k, v in written.items()}
    pads = {k: v for k, v in written["padded"].items() if k in ("constant_pad_nd", "slice_backward", "clone")}
    return {"gemm": gemm.describe(), "tokens": tokens,
            "flops": flops, "extra_flops": flops["padded"] / flops["unpadded"] - 1, "planned_extra_flops":
            gemm.extra_flops, "bytes_written": total, "extra_bytes": total["padded"] - total["unpadded"],
            "padded_ops_bytes": pads}


def shipped_padded_gemms():
    """(config name, its padded GEMMs at its own tp)."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.json"))):
        cfg = load_config(path)
        tp = cfg.parallel.tensor_model_parallel_size
        gemms = [g for g in layer_float8_gemms(cfg.model.hidden_size, cfg.model.ffn_hidden_size, tp)
                 if g.mode == "padded"]
        if gemms:
            out.append((f"{os.path.basename(path)} tp {tp}", gemms))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="micro batch x seq_length (default 2 x 2048)")
    p.add_argument("--tiny", action="store_true", help="one small padded GEMM (40 x 24 -> 48 x 32), 64 tokens")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    mm = Float8Matmul("tensorwise", emulate=True)
    if args.tiny:
        cases, tokens = [("tiny", [Float8Gemm("tiny", 40, 24, "padded", 48, 32)])], 64
    else:
        cases, tokens = shipped_padded_gemms(), args.tokens
    rows = []
    for where, gemms in cases:
        for gemm in gemms:
            r = dict(padding_cost(mm, gemm, tokens, probe=(16, 32) if args.tiny else (64, 128)), config=where)
            rows.append(r)
            mb = lambda n: f"{n / 1e6:,.{0 if n > 1e7 else 3}f} MB"  # noqa: E731
            written = r["bytes_written"]
            print(f"{where}: {r['gemm']}, {tokens} tokens: FLOPs +{100 * r['extra_flops']:.2f}%, bytes written "
                  f"{mb(written['unpadded'])} -> {mb(written['padded'])} (+{mb(r['extra_bytes'])}, "
                  f"+{100 * r['extra_bytes'] / r['bytes_written']['unpadded']:.1f}%; pad/slice copies "
                  f"{mb(sum(r['padded_ops_bytes'].values()))}) per micro-batch, forward + backward")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "emulated": True, "recipe": "tensorwise"}, f, indent=1)


if __name__ == "__main__":
    main()
