"""8-bit AdamW (training.optimizer=adamw8bit, bitsandbytes) against AdamW on the demo, in one run: optimizer-state
bytes per parameter, and the demo's loss curve trained with each.

    python bench/bench_optimizer8bit.py --out bench/results/cpu_optimizer8bit     # ~6 min on 2 CPU cores

1. State: the demo's model under its engine (dp = 2, ZeRO-1, fp32) with each optimizer, one step on synthetic
   tokens; `TrainEngine.optimizer_state_bytes()` (the client optimizer's own state: Adam's moments, for 8-bit
   their codes, block scales and maps) summed over the 2 ranks / the model's parameters, beside
   gptpar.estimate.memory's moment bytes (MOMENT_BYTES). Everything the engine holds against the estimate:
   tests/integration/test_precision.py.
2. Loss: `make demo`'s training (configs/demo_cpu.json, 150 iterations on real text, 2 ranks) once per optimizer,
   launched as tools/demo.py launches it, without checkpoints; the final logged lm loss (mean over iterations
   141-150) and the last validation loss of each, and their ratio.
Prints both ratios and writes summary.json and each run's metrics and log (train.log) under --out.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OPTIMIZERS = ("adamw", "adamw8bit")
CONFIG = os.path.join(ROOT, "configs", "demo_cpu.json")


def state_bytes(optimizer):
    """On each of 2 ranks (harness): the demo model's engine with `optimizer`, one step; (optimizer-state bytes,
    parameters) of this rank."""
    from gptpar.parallel import init_parallel
    from gptpar.training.batches import SyntheticDataset, rank_micro_batches
    from gptpar.training.assembly import build_model, seed_everything
    from gptpar.config import load_config
    from gptpar.training.engine import build_engine, deepspeed_config

    cfg = load_config(CONFIG, ["data.data_path=null", "data.synthetic=true", f"training.optimizer={optimizer}"])
    pstate = init_parallel(1, 1, 2)
    t, m = cfg.training, cfg.model
    engine = build_engine(build_model(cfg, pstate, seed_everything(t.seed, pstate)), pstate,
                          deepspeed_config(cfg, pstate.dp_size), optimizer=optimizer, lr=t.lr,
                          weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    texts = rank_micro_batches(SyntheticDataset(m.vocab_size, m.seq_length, t.seed), 0, t.global_batch_size,
                               t.micro_batch_size, pstate.dp_rank, pstate.dp_size)
    engine.train_step([{"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()} for x in texts])
    params = sum(p.numel() for p in engine.parameters())
    return engine.optimizer_state_bytes(), params


def measure_state():
    from gptpar.estimate.memory import MOMENT_BYTES
    from gptpar.testing import run_distributed

    out = {}
    for optimizer in OPTIMIZERS:
        ranks = run_distributed(state_bytes, 2, (optimizer,), timeout=600)
        params = ranks[0][1]
        out[optimizer] = {"optimizer_state_bytes_per_param": sum(r[0] for r in ranks) / params,
                          "estimate_bytes_per_param": MOMENT_BYTES[optimizer], "parameters": params}
    return out


def train_demo(optimizer, out_dir, overrides):
    """The demo's training with `optimizer` (and `overrides`, `--set` arguments); its metrics records."""
    from gptpar.tools import demo

    metrics = os.path.abspath(os.path.join(out_dir, optimizer, "metrics.jsonl"))
    os.makedirs(os.path.dirname(metrics), exist_ok=True)
    if os.path.exists(metrics):
        os.remove(metrics)
    extra = ["--set", f"training.optimizer={optimizer}", "--set", f"logging.metrics_file={metrics}",
             "--set", "logging.tensorboard_dir=null", "--set", "checkpoint.save=null", "--set", "checkpoint.load=null",
             "--set", "checkpoint.save_interval=null", "--set", "checkpoint.keep_last=null"] + overrides
    env = dict(os.environ, PYTHONUNBUFFERED="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    cmd = demo.launch_command("deepspeed", extra)
    print("$ " + " ".join(cmd), flush=True)
    start = time.time()
    with open(os.path.join(os.path.dirname(metrics), "train.log"), "w") as log:  # the run's own output, kept
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    from gptpar.training.reporting import read_metrics

    records = read_metrics(metrics)
    print(f"  {optimizer}: {time.time() - start:.0f} s", flush=True)
    return records


def smoke_overrides(iters):
    """`--set` arguments for a shorter run that still logs and evaluates at its end; none for the demo's own."""
    if iters is None:
        return []
    return [arg for key, value in (("training.train_iters", iters), ("training.lr_warmup_iters", 0),
                                   ("training.eval_interval", iters), ("training.eval_iters", 1),
                                   ("logging.log_interval", iters)) for arg in ("--set", f"{key}={value}")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for summary.json and each run's metrics")
    p.add_argument("--train-iters", type=int, help="train this many iterations instead of the demo's (a smoke run, "
                                                     "evaluating and logging at the end)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from gptpar.tools import demo

    with open(CONFIG) as f:
        demo.prepare_data(json.load(f), dict(os.environ))

    state = measure_state()
    losses = {}
    for optimizer in OPTIMIZERS:
        records = train_demo(optimizer, args.out, smoke_overrides(args.train_iters))
        train = [r for r in records if "train_iters" in r]
        valid = [r for r in records if r.get("eval")]
        losses[optimizer] = {"final_lm_loss": train[-1]["lm_loss"], "final_iteration": train[-1]["iteration"],
                             "final_validation_loss": valid[-1]["lm_loss"],
                             "lm_loss_curve": [(r["iteration"], r["lm_loss"]) for r in train]}
    a, b = state["adamw"], state["adamw8bit"]
    summary = {"state": state, "loss": losses,
               "state_ratio": b["optimizer_state_bytes_per_param"] / a["optimizer_state_bytes_per_param"],
               "final_lm_loss_ratio": losses["adamw8bit"]["final_lm_loss"] / losses["adamw"]["final_lm_loss"],
               "final_validation_loss_ratio": (losses["adamw8bit"]["final_validation_loss"]
                                               / losses["adamw"]["final_validation_loss"])}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for optimizer in OPTIMIZERS:
        s, l = state[optimizer], losses[optimizer]
        print(f"{optimizer:>9}: optimizer state {s['optimizer_state_bytes_per_param']:.3f} B/param "
              f"({s['parameters']:,} params over dp 2, ZeRO-1; estimate {s['estimate_bytes_per_param']:.3f}) | "
              f"final lm loss {l['final_lm_loss']:.4f} "
              f"(iteration {l['final_iteration']}), validation {l['final_validation_loss']:.4f}")
    print(f"adamw8bit / adamw: optimizer-state bytes x{summary['state_ratio']:.3f}, final lm loss "
          f"x{summary['final_lm_loss_ratio']:.4f} ({100 * (summary['final_lm_loss_ratio'] - 1):+.2f}%), "
          f"validation loss x{summary['final_validation_loss_ratio']:.4f}")


if __name__ == "__main__":
    main()
