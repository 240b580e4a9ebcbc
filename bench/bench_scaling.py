"""Scaling on gloo through gptpar's DeepSpeed engine: tensor, pipeline and data (ZeRO-1) parallelism on 2 ranks.

    python bench/bench_scaling.py            # a few minutes on a 2-core CPU
    python bench/bench_scaling.py --tiny     # seconds per run; the smoke test runs this

Every run is a fresh `run_distributed` world (spawned gloo ranks) training the same GPT through `build_engine`
(fp32, ZeRO-1, gradient accumulation over the micro-batches, clipping) with the same global batch; each rank
times its steps between barriers after a warm-up step, and a run's step time is the median over its steps.
1. TP: tp=2 over 2 ranks with 1 thread each vs tp=1 on 1 rank with 2 threads (the same two cores).
   Target: tp=2 tokens/s >= 0.85x tp=1's.
2. PP: pp=2 (DeepSpeed's 1F1B pipeline, 'balanced' placement) over 2 ranks x 1 thread with m micro-batches,
   against pp=1 on 1 rank x 1 thread. Two pp=1 runs go side by side so that both cores are loaded as in pp=2.
   Efficiency = (pp=2 tokens/s / 2) / (pp=1 tokens/s); the ideal is the bubble bound m / (m + pp - 1).
   Target: efficiency within 10% of the ideal. The vocabulary is small (2048) so that the output layer costs
   about what half a transformer layer does and the 2 stages can be balanced: this isolates the schedule
   (with GPT-2's 50257 words the output layer alone outweighs 8 layers of this width).
3. ZeRO-1: optimizer-state bytes (AdamW's exp_avg + exp_avg_sq) per rank at dp=2 vs dp=1, and peak RSS
   per rank. Target: <= 0.55x.
The TP and PP pairs are repeated --repeats times, alternating which runs first; the ratios are medians.

The default model is 4 x 1024 (16 heads): tensor parallelism's all-reduces move O(s*b*h) bytes per layer
against O(s*b*h^2) FLOPs, so its efficiency grows with the hidden size, and TP is used for wide layers.
At 8 x 384 the 256 blocking gloo all-reduces of 0.75 MiB per step (gloo: ~1 MiB in 3.3 ms here) cost about
a third of the step; `--layers 8 --hidden 384 --heads 6` measures that comm-bound regime (docs/benchmarks.md
has both).
"""
import argparse
import concurrent.futures
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from gptpar.testing import run_distributed  # noqa: E402

TP_TARGET, PP_TARGET, ZERO_TARGET = 0.85, 0.90, 0.55
ENV = {"DS_ACCELERATOR": "cpu"}


def run_config(model: dict, tp: int, pp: int, dp: int, micro_batch: int, micro_batches: int):
    """The gptpar Config of one run: the DeepSpeed dict is generated from it, as the trainer does."""
    from gptpar.config import config_from_dict

    return config_from_dict({
        "model": model,
        "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "data_parallel_size": dp, "partition_method": "balanced" if pp > 1 else "auto"},
        "training": {"micro_batch_size": micro_batch, "global_batch_size": micro_batch * micro_batches * dp,
                     "train_iters": 100, "precision": "fp32", "zero_stage": 1, "lr": 1e-4, "seed": 1234},
        "data": {"synthetic": True},
    })


def _optimizer_state_bytes(engine) -> int:
    inner = getattr(engine.ds.optimizer, "optimizer", engine.ds.optimizer)
    return sum(t.numel() * t.element_size() for state in inner.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)


def train_rank(model: dict, tp: int, pp: int, dp: int, micro_batch: int, micro_batches: int, steps: int,
               warmup: int) -> dict:
    """One rank of a run: build, train warmup + steps, return step times, optimizer bytes and peak RSS."""
    import torch.distributed as dist

    from gptpar.model.config import GPTConfig
    from gptpar.parallel import init_parallel
    from gptpar.training.assembly import build_gpt
    from gptpar.training.engine import build_engine, deepspeed_config

    cfg = run_config(model, tp, pp, dp, micro_batch, micro_batches)
    st = init_parallel(tp=tp, pp=pp, dp=dp)
    config = GPTConfig(**model)
    net = build_gpt(config, st, partition_method="balanced", seed=1234)
    engine = build_engine(net, st, deepspeed_config(cfg, dp), lr=1e-4, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1000 + st.dp_rank)
    times = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, config.vocab_size, (micro_batches * micro_batch, config.seq_length + 1),
                               generator=gen)
        mbs = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens.split(micro_batch)]
        dist.barrier()
        start = time.perf_counter()
        engine.train_step(mbs)
        dist.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "steps": times, "opt_bytes": _optimizer_state_bytes(engine),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tokens_per_step": micro_batches * micro_batch * dp * config.seq_length}


def launch(model, tp, pp, dp, threads, args, micro_batches):
    """One run on tp*pp*dp spawned ranks; returns rank 0's result (and every rank's peak RSS)."""
    world = tp * pp * dp
    out = run_distributed(train_rank, world, args=(model, tp, pp, dp, args.micro_batch, micro_batches,
                                                   args.steps, args.warmup),
                          threads=threads, env=ENV, timeout=600)
    res = dict(out[0])
    res["step_s"] = max(r["step_s"] for r in out)
    res["peak_rss_mb_per_rank"] = [r["peak_rss_mb"] for r in out]
    res["opt_bytes_per_rank"] = [r["opt_bytes"] for r in out]
    res["tokens_per_s"] = res["tokens_per_step"] / res["step_s"]
    return res


def bench_tp(model, args):
    rows = []
    for r in range(args.repeats):
        order = [(1, 2), (2, 1)] if r % 2 == 0 else [(2, 1), (1, 2)]
        got = {}
        for tp, threads in order:
            got[tp] = launch(model, tp, 1, 1, threads, args, args.micro_batches)
        rows.append({"tp1": got[1], "tp2": got[2], "ratio": got[2]["tokens_per_s"] / got[1]["tokens_per_s"]})
    return {"rounds": rows, "ratio": statistics.median(r["ratio"] for r in rows), "target": TP_TARGET}


def _pp1_side_by_side(model, args):
    """Two independent pp=1, 1-thread runs at once (both cores loaded, as under pp=2); their mean."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: launch(model, 1, 1, 1, 1, args, args.micro_batches), range(2)))
    res = dict(runs[0])
    res["tokens_per_s"] = statistics.mean(r["tokens_per_s"] for r in runs)
    res["step_s"] = statistics.mean(r["step_s"] for r in runs)
    return res


def bench_pp(model, args):
    m, pp = args.micro_batches, 2
    ideal = m / (m + pp - 1)
    rows = []
    for r in range(args.repeats):
        first_pp1 = r % 2 == 0
        pp1 = _pp1_side_by_side(model, args) if first_pp1 else None
        pp2 = launch(model, 1, 2, 1, 1, args, m)
        if not first_pp1:
            pp1 = _pp1_side_by_side(model, args)
        eff = pp2["tokens_per_s"] / pp / pp1["tokens_per_s"]
        rows.append({"pp1": pp1, "pp2": pp2, "efficiency": eff, "of_ideal": eff / ideal})
    return {"rounds": rows, "micro_batches": m, "ideal": ideal,
            "efficiency": statistics.median(r["efficiency"] for r in rows),
            "of_ideal": statistics.median(r["of_ideal"] for r in rows), "target": PP_TARGET}


def bench_zero(model, args):
    dp1 = launch(model, 1, 1, 1, 1, args, args.micro_batches)
    dp2 = launch(model, 1, 1, 2, 1, args, args.micro_batches)
    return {"dp1": dp1, "dp2": dp2, "opt_bytes_ratio": max(dp2["opt_bytes_per_rank"]) / dp1["opt_bytes"],
            "target": ZERO_TARGET}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8, help="m: micro-batches per step (per dp rank)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="alternating repeats of the TP and PP pairs")
    p.add_argument("--only", default="tp,pp,zero", help="comma-separated subset of tp,pp,zero")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.heads, args.seq, args.vocab_size = 2, 64, 4, 32, 256
        args.micro_batch, args.micro_batches, args.steps, args.warmup, args.repeats = 2, 2, 1, 1, 1
    model = {"num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": args.heads,
             "seq_length": args.seq, "vocab_size": args.vocab_size}
    only = set(args.only.split(","))
    print(f"model {args.layers}x{args.hidden} ({args.heads} heads) seq {args.seq} vocab {args.vocab_size} | "
          f"micro-batch {args.micro_batch} x {args.micro_batches} | torch {torch.__version__} | cpus "
          f"{os.cpu_count()} | load {os.getloadavg()[0]:.1f}", flush=True)
    results, summary = {"model": model, "args": vars(args)}, []
    if "tp" in only:
        tp = results["tp"] = bench_tp(model, args)
        for r in tp["rounds"]:
            print(f"tp: tp=1 x 2 threads {r['tp1']['tokens_per_s']:.0f} tokens/s | tp=2 x 1 thread "
                  f"{r['tp2']['tokens_per_s']:.0f} tokens/s | ratio {r['ratio']:.3f}", flush=True)
        summary.append(f"tp=2/tp=1 tokens/s {tp['ratio']:.2f}x (target >= {TP_TARGET}: "
                       f"{'met' if tp['ratio'] >= TP_TARGET else 'NOT met'})")
    if "pp" in only:
        pp = results["pp"] = bench_pp(model, args)
        for r in pp["rounds"]:
            print(f"pp: pp=1 x 1 thread {r['pp1']['tokens_per_s']:.0f} tokens/s | pp=2 {r['pp2']['tokens_per_s']:.0f}"
                  f" tokens/s | efficiency {r['efficiency']:.3f} (ideal {pp['ideal']:.3f}) = "
                  f"{r['of_ideal']:.1%} of ideal", flush=True)
        summary.append(f"pp=2 m={pp['micro_batches']} efficiency {pp['efficiency']:.3f} = {pp['of_ideal']:.1%} of "
                       f"the ideal {pp['ideal']:.3f} (target >= {PP_TARGET:.0%}: "
                       f"{'met' if pp['of_ideal'] >= PP_TARGET else 'NOT met'})")
    if "zero" in only:
        z = results["zero"] = bench_zero(model, args)
        print(f"zero-1: optimizer state per rank dp=1 {z['dp1']['opt_bytes'] / 2**20:.1f} MiB | dp=2 "
              f"{[round(b / 2**20, 1) for b in z['dp2']['opt_bytes_per_rank']]} MiB | ratio "
              f"{z['opt_bytes_ratio']:.3f} | peak RSS per rank dp=1 "
              f"{[round(m) for m in z['dp1']['peak_rss_mb_per_rank']]} MB, dp=2 "
              f"{[round(m) for m in z['dp2']['peak_rss_mb_per_rank']]} MB", flush=True)
        summary.append(f"ZeRO-1 dp=2/dp=1 optimizer bytes per rank {z['opt_bytes_ratio']:.3f} (target <= "
                       f"{ZERO_TARGET}: {'met' if z['opt_bytes_ratio'] <= ZERO_TARGET else 'NOT met'})")
    line = "summary: " + "; ".join(summary)
    print(line)
    if args.json:
        results["summary"] = line
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
