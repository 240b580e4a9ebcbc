"""Does fp16 / bf16 training work on this CPU, and how fast is it against fp32? The trainer itself, one rank.

    python bench/bench_cpu_precision.py                # 4 x 256, seq 256, 24 iterations per precision (~2 min)
    python bench/bench_cpu_precision.py --json out.json

Runs `pretrain_gpt.py` (DeepSpeed's CPU accelerator, synthetic data) at fp32, bf16 (BF16_Optimizer) and fp16
(dynamic loss scaling, initial scale 2**16) and prints, per precision: the median seconds per iteration after
warm-up, its speed against fp32, whether the loss fell and stayed finite, and the skipped iterations. The CPU's
AVX512-BF16 / AVX512-FP16 / AMX flags and DeepSpeed's own fp16 answer are printed first: where the accelerator
reports no fp16 support (oneDNN has no fp16 kernels without AVX512-FP16 / AMX-FP16) the fp16 run goes through
bench/pretrain_fp16_cpu.py, which overrides that answer, and the line says so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gptpar.training.reporting import read_metrics  # noqa: E402

SHAPE = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "model.seq_length=256",
         "model.max_position_embeddings=256", "model.vocab_size=2048", "training.micro_batch_size=4",
         "training.global_batch_size=8", "training.lr_warmup_iters=2", "logging.log_interval=1"]


def cpu_flags() -> list:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                                            "amx_fp16"))


def run(precision: str, iters: int, out: str, override_fp16: bool) -> dict:
    metrics = os.path.join(out, f"{precision}.jsonl")
    script = "bench/pretrain_fp16_cpu.py" if override_fp16 else "pretrain_gpt.py"
    sets = SHAPE + [f"training.train_iters={iters}", f"training.precision={precision}",
                    "training.initial_loss_scale=65536", f"logging.metrics_file={metrics}"]
    cmd = [sys.executable, script, "--config", "configs/cpu_tiny.json"] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    if proc.returncode != 0:
        return {"precision": precision, "exit": proc.returncode, "error": proc.stderr.strip().splitlines()[-1:]}
    rows = [r for r in read_metrics(metrics) if "elapsed_s" in r]  # train records, not eval ones
    losses = [r["lm_loss"] for r in rows if r["lm_loss"] is not None]
    timed = [r["elapsed_s"] for r in rows[4:]]  # after warm-up
    return {"precision": precision, "exit": 0, "s_per_iteration": statistics.median(timed),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "finite": all(x == x and abs(x) != float("inf") for x in losses),
            "skipped_iterations": sum(r["skipped_iterations"] for r in rows),
            "fp16_support_overridden": override_fp16,
            "plan": next((line for line in proc.stdout.splitlines() if line.startswith("precision plan")), None)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=24)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from gptpar.training.engine import detect_accelerator

    accelerator = detect_accelerator()
    print(f"CPU flags: {' '.join(cpu_flags()) or 'unknown'}; {accelerator.name}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as out:
        for precision in ("fp32", "bf16", "fp16"):
            r = run(precision, args.iters, out, override_fp16=precision == "fp16" and not accelerator.fp16)
            results.append(r)
            if r["exit"]:
                print(f"{precision}: exit {r['exit']}: {r['error']}", flush=True)
                continue
            base = results[0].get("s_per_iteration")
            print(f"{precision}: {r['s_per_iteration']:.3f} s/iteration ({base / r['s_per_iteration']:.2f}x fp32), "
                  f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}, finite {r['finite']}, skipped "
                  f"{r['skipped_iterations']}{' (fp16 support overridden)' if r['fp16_support_overridden'] else ''}"
                  f" | {r['plan']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu_flags": cpu_flags(), "accelerator": accelerator.name, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
