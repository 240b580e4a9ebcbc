"""How long a checkpoint save stops training, blocking vs asynchronous (checkpoint.async_save), in one run:

    python bench/bench_async_save.py --out bench/results/cpu_async_save     # ~13 min on 2 shared CPU cores
    python bench/bench_async_save.py --out /tmp/async_smoke --tiny          # the same path on the tiny model

A bf16 GPT of ~147M parameters (MODEL below: 2 layers x 256 and a 560k-row learned position table, vocab 8192,
seq 32, one micro-batch of 1 per rank) on 2 gloo ranks (dp = 2, ZeRO-1 BF16_Optimizer: rank 0 saves the bf16
weights and its half of the fp32 master weights and Adam moments, ~1.2 GB, rank 1 its half, ~0.9 GB), `--iters`
iterations (default 9) with a save every `--every` (default 3), trained by pretrain_gpt.py four times, each in its own 2 processes:
without saves, with blocking saves (with and without checksums), with async saves; then the blocking run's last
checkpoint resumed for one iteration twice, with and without the checksum verification (done in the pass that
loads each file, so its cost is the difference of the two loads, timed per rank). Per save and rank it records the
time training is stopped:
the save call itself (for async: the snapshot plan, plus any wait for the save before it) and every wait of the
later steps for the snapshot copy (the optimizer-step hook, `CheckpointWriter.wait_for_snapshot`); the save's
stall is the larger of the two ranks'. It also records the time each save spent in fsync (every file, the new
folder, the save folder, `latest`: the durable write), in the caller for a blocking save and in the writer thread
for an async one. Also each run's total training time (the end's wait for the last async save included) and the
peak RSS per rank (async keeps a host copy of the rank's checkpoint files).

Prints the figures and writes summary.json and each rank's log under --out (the checkpoints go to --out/ck_*,
deleted after).
"""
import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# ~147M parameters, nearly all of them a learned position table (as large as keeps the bench under ~8 GB of RAM:
# bf16 at dp = 2 holds 12 bytes per parameter per rank, plus async's host copy of the rank's files): a save's cost is its bytes (14 per parameter in
# bf16: weights, fp32 master weights, two fp32 Adam moments), whatever the parameters do, and the table keeps a
# step short on this CPU, where bf16's backward GEMM (dy @ W) runs at ~0.15-0.6 GFLOP/s (3.8 for the forward).
MODEL = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 8192,
         "max_position_embeddings": 560000}
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 256}


def overrides(model: dict, iters: int, every=None, async_save=False, save_dir=None, checksums=True,
              load_dir=None, verify=True) -> list:
    sets = {f"model.{k}": v for k, v in model.items()}
    sets.update({"parallel.tensor_model_parallel_size": 1, "parallel.data_parallel_size": 2,
                 "training.precision": "bf16", "training.micro_batch_size": 1, "training.global_batch_size": 2,
                 "training.train_iters": iters, "training.lr_warmup_iters": 0, "training.eval_interval": None,
                 "logging.log_interval": 1, "checkpoint.save": save_dir, "checkpoint.save_interval": every,
                 "checkpoint.async_save": async_save, "checkpoint.checksums": checksums, "checkpoint.load": load_dir,
                 "checkpoint.verify_checksums": verify,
                 "checkpoint.keep_last": 1 if save_dir else None})
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={json.dumps(value)}")]


def timed_run(argv, log_prefix):
    """On each rank: pretrain_gpt.main(argv) with its saves and the optimizer-step hook's waits timed; its output
    goes to `{log_prefix}.rank{R}.log`."""
    import pretrain_gpt
    from gptpar.checkpoint.checkpointer import Checkpointer
    from gptpar.checkpoint.writer import CheckpointWriter
    from gptpar.training.trainer import Trainer

    saves, train = [], {}
    real_save, real_hook, real_train = Checkpointer._save, CheckpointWriter.wait_for_snapshot, Trainer.train
    real_load, real_fsync = Checkpointer.load, os.fsync

    def save(self, *args, **kwargs):
        saves.append({"save_s": 0.0, "hook_s": 0.0, "fsync_s": 0.0, "fsyncs": 0})
        start = time.perf_counter()
        try:
            return real_save(self, *args, **kwargs)
        finally:
            saves[-1]["save_s"] = time.perf_counter() - start

    def fsync(fd):  # one save at a time: its fsyncs, in the caller or the writer thread, are the last save's
        start = time.perf_counter()
        try:
            return real_fsync(fd)
        finally:
            if saves:
                saves[-1]["fsync_s"] += time.perf_counter() - start
                saves[-1]["fsyncs"] += 1

    def hook(self):
        start = time.perf_counter()
        real_hook(self)
        if saves:
            saves[-1]["hook_s"] += time.perf_counter() - start

    def timed_train(self):
        start = time.perf_counter()
        try:
            return real_train(self)
        finally:
            train["total_s"] = time.perf_counter() - start

    def timed(name, real):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                train[name] = time.perf_counter() - start
        return call

    Checkpointer._save, CheckpointWriter.wait_for_snapshot, Trainer.train = save, hook, timed_train
    Checkpointer.load, os.fsync = timed("load_s", real_load), fsync
    import torch.distributed as dist

    with open(f"{log_prefix}.rank{dist.get_rank()}.log", "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        code = pretrain_gpt.main(["--config", os.path.join(ROOT, "configs", "cpu_tiny.json")] + argv)
    return {"exit": code, "saves": saves, "total_s": train.get("total_s"), "load_s": train.get("load_s"), "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def run(label: str, argv: list, out: str) -> dict:
    from gptpar.testing import run_distributed

    print(f"-- {label} (each rank's output: {out}/{label.replace(' ', '_')}.rank*.log)", flush=True)
    ranks = run_distributed(timed_run, 2, (argv, os.path.join(out, label.replace(" ", "_"))), timeout=3000,
                            threads=1)
    assert all(r["exit"] == 0 for r in ranks), ranks
    stalls = [max(r["saves"][i]["save_s"] + r["saves"][i]["hook_s"] for r in ranks)
              for i in range(len(ranks[0]["saves"]))]
    out = {"total_s": max(r["total_s"] for r in ranks), "stall_per_save_s": stalls,
           "save_call_s": [max(r["saves"][i]["save_s"] for r in ranks) for i in range(len(stalls))],
           "step_hook_wait_s": [max(r["saves"][i]["hook_s"] for r in ranks) for i in range(len(stalls))],
           "fsync_per_save_s": [max(r["saves"][i]["fsync_s"] for r in ranks) for i in range(len(stalls))],
           "fsyncs_per_save": [[r["saves"][i]["fsyncs"] for r in ranks] for i in range(len(stalls))],
           "peak_rss_gib": [r["peak_rss_gib"] for r in ranks], "load_s": [r["load_s"] for r in ranks]}
    print(f"   total {out['total_s']:.1f} s; stall per save {', '.join(f'{s:.2f}' for s in stalls) or '-'} s; "
          f"peak RSS {' / '.join(f'{g:.2f}' for g in out['peak_rss_gib'])} GiB", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for summary.json (and, while running, the checkpoints)")
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="the tiny model: checks the path, measures nothing")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = TINY if args.tiny else MODEL
    out = os.path.abspath(args.out)
    ck = {name: os.path.join(out, f"ck_{name}") for name in ("blocking", "blocking_no_checksums", "async")}
    for folder in ck.values():
        shutil.rmtree(folder, ignore_errors=True)
    results = {"no saves": run("no saves", overrides(model, args.iters), out)}
    for label, async_save, checksums in (("blocking", False, True), ("blocking_no_checksums", False, False),
                                         ("async", True, True)):
        results[label] = run(label, overrides(model, args.iters, args.every, async_save, ck[label], checksums), out)
    # Resuming the blocking run's last checkpoint (one more iteration), with and without the verification done in
    # the pass that loads each file. The files were just written, so both read from the page cache.
    results["resume"] = run("resume", overrides(model, args.iters + 1, load_dir=ck["blocking"]), out)
    results["resume_unverified"] = run("resume_unverified", overrides(model, args.iters + 1, load_dir=ck["blocking"],
                                                                      verify=False), out)
    for folder in ck.values():
        shutil.rmtree(folder, ignore_errors=True)
    labels = ("blocking", "blocking_no_checksums", "async")
    mean = {label: statistics.mean(results[label]["stall_per_save_s"]) for label in labels}
    fsync = {label: statistics.mean(results[label]["fsync_per_save_s"]) for label in labels}
    summary = {"model": model, "iters": args.iters, "save_every": args.every, "runs": results,
               "mean_stall_s": mean, "async_stall_fraction": mean["async"] / mean["blocking"],
               "checksum_save_cost_fraction": mean["blocking"] / mean["blocking_no_checksums"] - 1,
               "mean_fsync_per_save_s": fsync, "load_s": max(results["resume"]["load_s"]),
               "load_unverified_s": max(results["resume_unverified"]["load_s"]), "load_average": os.getloadavg()}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"summary: stall per save: blocking {mean['blocking']:.2f} s (without checksums "
          f"{mean['blocking_no_checksums']:.2f} s), async {mean['async']:.3f} s "
          f"({100 * summary['async_stall_fraction']:.1f}% of blocking); {args.iters} iterations, a save every "
          f"{args.every}: " + ", ".join(f"{k} {results[k]['total_s']:.1f} s" for k in
                                        ("no saves", "blocking", "blocking_no_checksums", "async"))
          + "; fsync per save: " + ", ".join(f"{k} {v:.3f} s" for k, v in fsync.items())
          + f"; resume: load verified {summary['load_s']:.2f} s, unverified {summary['load_unverified_s']:.2f} s; "
          f"load average {summary['load_average'][0]:.1f}")


if __name__ == "__main__":
    main()
