"""The trainer itself on one GPU: pretrain_gpt.py through DeepSpeed's launcher, configs/1.3b.json's shape.

    bash bench/gpu.sh checks                        # on a CUDA machine: installs the carried wheels, runs this
    python bench/gpu_trainer.py --out DIR           # the same, DeepSpeed already importable
    python bench/gpu_trainer.py --out DIR --cpu-smoke   # every step at a tiny shape on CPU/gloo (the flow)

Runs, each `deepspeed --num_gpus 1 pretrain_gpt.py --config configs/1.3b.json --set ...` with synthetic data,
global batch 32 (8 micro-batches of 4 x 2048 tokens), an iteration-based schedule of 16 iterations:
  a. bf16 (BF16_Optimizer, ZeRO-1), no recompute: iterations 1-12, exit_interval 12 saves a checkpoint;
  b. resume from it to iteration 16, with logging.timers (the per-iteration breakdown), params norm and num zeros,
     and Megatron's memory report (on a GPU the caching allocator's allocated / reserved and their peaks);
  c. the same 16 iterations straight, activation checkpointing on: the reference for a + b's losses (full
     recompute replays dropout's RNG, so the arithmetic is the same up to the GPU's non-deterministic kernels);
  d. fp16 with dynamic loss scaling (initial scale 2**32, hysteresis 2), 4 layers, 16 iterations, saved: the
     logged loss scale and skipped iterations against the scale the optimizer wrote into its checkpoint;
  e. bench/bench_single_rank.py at the same shape (no DeepSpeed, bf16 autocast): its MFU and TFLOPs next to
     the trainer's log-line TFLOPs.
Every run's output is kept in DIR (a.log, a.jsonl, ...); DIR/summary.json holds the figures and the checks,
and a short summary is printed. A failed step is reported and the next one still runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gptpar.training.reporting import read_metrics  # noqa: E402

ITERS, SPLIT = 16, 12
# bf16 losses of two runs of the same math on a GPU (atomics, recompute, split-K GEMMs): relative agreement
LOSS_TOLERANCE = 2e-2

SCHEDULE = ["training.train_samples=null", f"training.train_iters={ITERS}", "training.lr_warmup_samples=0",
            "training.lr_decay_samples=null", "training.lr_warmup_iters=4", "training.global_batch_size=32",
            "training.eval_interval=null", "logging.log_interval=1", "logging.tensorboard_dir=null",
            "checkpoint.save=null", "checkpoint.load=null", "checkpoint.save_interval=null",
            "checkpoint.keep_last=null"]
# --cpu-smoke: the same flow at a tiny shape (the model keeps 1.3b.json's structure: dropout, padding), eager: 1.3b.json
# compiles, which would add ~1 min per run on a CPU (tests/integration/test_compile.py checks the compiled trainer there)
CPU_SHAPE = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
             "model.max_position_embeddings=32", "model.vocab_size=512", "training.micro_batch_size=2",
             "training.global_batch_size=8", "training.compile=false"]


def sets(items):
    return [arg for item in items for arg in ("--set", item)]


def launch(name, overrides, out, cpu):
    """One pretrain_gpt.py run through DeepSpeed's launcher; (exit code, seconds); log in out/name.log."""
    fp16_on_cpu = cpu and "training.precision=fp16" in overrides  # this CPU's oneDNN may lack fp16 kernels
    script = "bench/pretrain_fp16_cpu.py" if fp16_on_cpu else "pretrain_gpt.py"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", script,
           "--config", "configs/1.3b.json"] + sets(SCHEDULE + (CPU_SHAPE if cpu else []) + overrides +
                                                   [f"logging.metrics_file={os.path.join(out, name + '.jsonl')}"])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    print(f"== {name}: {' '.join(cmd[2:])}", flush=True)
    start = time.time()
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    seconds = time.time() - start
    print(f"   exit {rc} after {seconds:.0f} s", flush=True)
    return rc, seconds


def records(out, name):
    path = os.path.join(out, f"{name}.jsonl")
    if not os.path.exists(path):
        return [], []
    rows = read_metrics(path)
    return [r for r in rows if not r.get("timers") and not r.get("eval")], [r for r in rows if r.get("timers")]


def speed(rows, skip=2):
    """Medians over the iterations after the first `skip` (warm-up, allocator growth, cuDNN autotuning)."""
    rows = [r for r in rows if r["iteration"] > skip] or rows
    if not rows:
        return None
    elapsed = statistics.median(r["elapsed_s"] for r in rows)
    return {"iterations": [r["iteration"] for r in rows], "s_per_iteration": elapsed,
            "tokens_per_s": rows[0]["global_batch_size"] * (rows[0]["consumed_tokens"] // rows[0]["consumed_samples"])
            / elapsed, "tflops": statistics.median(r["tflops"] for r in rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for logs, metrics and summary.json")
    p.add_argument("--scratch", default=None, help="folder for the checkpoints (tens of GB at 1.3B; deleted at "
                                                   "the end); default: OUT/checkpoints")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU: checks the flow, not the speed")
    p.add_argument("--steps", default="abcde", help="which of the steps a-e to run (default: all)")
    args = p.parse_args(argv)
    out, cpu = os.path.abspath(args.out), args.cpu_smoke
    os.makedirs(out, exist_ok=True)
    scratch = os.path.abspath(args.scratch or os.path.join(out, "checkpoints"))
    ck_bf16, ck_fp16 = os.path.join(scratch, "ck_bf16"), os.path.join(scratch, "ck_fp16")
    summary = {"cpu_smoke": cpu, "loss_tolerance": LOSS_TOLERANCE, "runs": {}, "checks": {}}
    runs = summary["runs"]
    bf16 = ["training.precision=bf16", "training.zero_stage=1"]

    if "a" in args.steps:
        runs["a"] = launch("a", bf16 + ["training.activation_checkpointing=false", f"training.exit_interval={SPLIT}",
                                        f"checkpoint.save={ck_bf16}"], out, cpu)
    if "b" in args.steps:
        runs["b"] = launch("b", bf16 + ["training.activation_checkpointing=false", f"checkpoint.load={ck_bf16}",
                                        "logging.timers=true", "logging.log_params_norm=true",
                                        "logging.log_num_zeros=true"], out, cpu)
    if "c" in args.steps:
        runs["c"] = launch("c", bf16 + ["training.activation_checkpointing=true"], out, cpu)
    if "d" in args.steps:
        runs["d"] = launch("d", ["training.precision=fp16", "training.zero_stage=1", "model.num_layers=2" if cpu
                                 else "model.num_layers=4", "training.activation_checkpointing=false",
                                 f"checkpoint.save={ck_fp16}"], out, cpu)
    if "e" in args.steps:
        bench = [sys.executable, "bench/bench_single_rank.py", "--no-hf", "--json", os.path.join(out, "e.json")]
        bench += (["--tiny"] if cpu else ["--device", "cuda", "--dtype", "bf16", "--config", "configs/1.3b.json",
                                          "--rounds", "5", "--warmup", "2"])
        print(f"== e: {' '.join(bench[1:])}", flush=True)
        start = time.time()
        with open(os.path.join(out, "e.log"), "w") as log:
            rc = subprocess.call(bench, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        runs["e"] = (rc, time.time() - start)
        print(f"   exit {rc} after {runs['e'][1]:.0f} s", flush=True)

    summarize(summary, out, ck_bf16, ck_fp16)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["checks"], indent=1))
    return 0 if all(v is True for v in summary["checks"].values()) else 1


def memory_report_ok(line, cpu) -> bool:
    """Megatron's report_memory line: the allocator's numbers on a GPU, the process's resident memory on CPU,
    each peak at least its current value."""
    if line is None:
        return False
    values = {part.split(":")[0].strip(): float(part.split(":")[1]) for part in line.split("|")[1:]}
    pairs = [("resident", "max resident")] if cpu else [("allocated", "max allocated"), ("reserved", "max reserved")]
    return all(values[peak] >= values[now] > 0 for now, peak in pairs)


def summarize(summary, out, ck_bf16, ck_fp16) -> None:
    checks, figures = summary["checks"], summary.setdefault("figures", {})
    a, _ = records(out, "a")
    b, timers = records(out, "b")
    c, _ = records(out, "c")
    d, _ = records(out, "d")
    if a:
        checks["a_trained_to_the_exit_interval"] = [r["iteration"] for r in a] == list(range(1, SPLIT + 1))
        checks["a_saved"] = os.path.isdir(os.path.join(ck_bf16, f"iter_{SPLIT:07d}"))
        figures["a_bf16_no_recompute"] = speed(a)
        with open(os.path.join(out, "a.log")) as f:
            log = f.read()
        figures["precision_plan"] = next((line for line in log.splitlines() if "precision plan:" in line), None)
    if b:
        checks["b_resumed_at_the_split"] = [r["iteration"] for r in b] == list(range(SPLIT + 1, ITERS + 1))
        if timers:
            figures["b_ms_per_iteration"] = {k: statistics.median(t["ms_per_iteration"][k] for t in timers[1:] or timers)
                                             for k in timers[0]["ms_per_iteration"]}
        figures["b_params_norm"] = [r["params_norm"] for r in b]
        checks["b_params_norm_and_num_zeros_logged"] = all(
            r["params_norm"] is not None and math.isfinite(r["params_norm"]) and r["params_norm"] > 0
            and r["num_zeros"] is not None for r in b)
        with open(os.path.join(out, "b.log")) as f:
            report = next((line for line in f if "] (after " in line and "memory (MB)" in line), None)
        figures["b_memory_report"] = report and report.strip()
        checks["b_memory_report"] = memory_report_ok(report, summary["cpu_smoke"])
    if c:
        figures["c_bf16_full_recompute"] = speed(c)
        if a and b and len(c) == ITERS:
            both = [r["lm_loss"] for r in a + b]
            ref = [r["lm_loss"] for r in c]
            worst = max(abs(x - y) / abs(y) for x, y in zip(both, ref))
            figures["a_b_vs_c_max_relative_loss_difference"] = worst
            checks["a_b_losses_follow_c"] = worst <= LOSS_TOLERANCE
    if d:
        scales = [r["loss_scale"] for r in d]
        skipped = sum(r["skipped_iterations"] for r in d)
        figures["d_fp16"] = {"loss_scales": scales, "skipped_iterations": skipped,
                             "lm_loss": [r["lm_loss"] for r in d]}
        checks["d_skipped_from_real_overflows"] = skipped > 0 and all(
            (r["lm_loss"] is None) == (r["skipped_iterations"] > 0) for r in d)
        checks["d_scale_halves_only_on_skips"] = all(
            later <= earlier and (later == earlier or prev["skipped_iterations"] or row["skipped_iterations"])
            for prev, row, earlier, later in zip(d, d[1:], scales, scales[1:]))
        try:
            from gptpar.training.engine import checkpoint_loss_scale

            saved = checkpoint_loss_scale(os.path.join(ck_fp16, f"iter_{ITERS:07d}"))
            figures["d_saved_loss_scale"] = saved
            checks["d_logged_scale_is_the_saved_one"] = saved == scales[-1]
        except (OSError, ValueError, KeyError) as e:
            checks["d_logged_scale_is_the_saved_one"] = f"could not read the checkpoint: {e}"
    path = os.path.join(out, "e.json")
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)["results"][0]
        figures["e_single_rank_bench"] = {"name": res["name"], "dtype": res["dtype"],
                                          "step_s": res["gptpar"]["step_s_median"],
                                          "tokens_per_s": res["gptpar"]["tokens_per_s"],
                                          "tflops": res["gptpar"]["tflops"], "mfu": res["gptpar"]["mfu"],
                                          "peak_tflops": res["peak_flops_median"] / 1e12}
    for ck in (ck_bf16, ck_fp16):  # tens of GB on the GPU machine; the figures are in summary.json
        shutil.rmtree(ck, ignore_errors=True)
    summary["exit_codes"] = {k: v[0] for k, v in summary["runs"].items()}
    for k, (rc, _) in summary["runs"].items():
        checks[f"{k}_exit_0"] = rc == 0


if __name__ == "__main__":
    sys.exit(main())
