"""The figures of bench/gpu_speed.sh in one place, and gptpar/estimate/memory.py's estimates beside the measured peaks.

    python bench/gpu_speed_summary.py --out gpu_out                      # -> gpu_out/summary.{json,txt}
    python bench/gpu_speed_summary.py --memory-estimates configs/1.3b.json

Reads what the script wrote: peer_{compiled,eager}.json (bench_peer_loop.py), trainer_metrics.jsonl (the
trainer's metrics file, one record per iteration), layer_200b_tp8_mbs*.json (bench_layer.py) and
single_rank_1.3b_{none,selective,full}.json (bench_single_rank.py). A missing file is reported, not fatal.
The trainer's seconds per iteration are the median over its iterations after the first two (start-up).
"""
import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gptpar.estimate.memory import GIB, memory_per_gpu  # noqa: E402
from gptpar.estimate.settings import settings_of  # noqa: E402
from gptpar.training.config import load_config  # noqa: E402
from gptpar.training.logging import read_metrics  # noqa: E402

RATIO_TARGET = 1.05   # issue 12: gptpar's tokens/s >= 1.05 x the compiled peer's


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def trainer_figures(path, skip=2):
    """Median seconds per iteration, samples/s and TFLOPs of the trainer's metrics file (train records only)."""
    try:
        recs = read_metrics(path)
    except OSError:
        return None
    recs = [r for r in recs if not r.get("eval")]
    timed = recs[skip:] or recs
    if not timed:
        return None
    sec = statistics.median(r["elapsed_s"] for r in timed)
    return {"iterations": len(recs), "timed_iterations": len(timed), "sec_per_iter_median": sec,
            "global_batch_size": timed[-1]["global_batch_size"],
            "samples_per_s": timed[-1]["global_batch_size"] / sec,
            "tflops_median": statistics.median(r["tflops"] for r in timed),
            "lm_loss_last": timed[-1]["lm_loss"]}


def summarize(out_dir: str) -> dict:
    res = {"peer_compiled": _load(os.path.join(out_dir, "peer_compiled.json")),
           "peer_eager": _load(os.path.join(out_dir, "peer_eager.json")),
           "trainer": trainer_figures(os.path.join(out_dir, "trainer_metrics.jsonl"))}
    lines = []
    for name in ("peer_compiled", "peer_eager"):
        p = res[name]
        lines.append(f"{name}: " + (f"{p['sec_per_iter_median']:.3f} s/iter, {p['tokens_per_s']:,.0f} tokens/s, "
                                    f"{p['tflops']:.1f} TFLOPs, peak {p.get('peak_memory_gib', float('nan')):.1f} "
                                    f"GiB ({p['device']})" if p else "missing"))
    t, peer = res["trainer"], res["peer_compiled"]
    if t and peer:
        seq = peer["config"]["block_size"]   # the script runs both at the same shape and global batch
        t["tokens_per_s"] = t["samples_per_s"] * seq
        same_batch = t["global_batch_size"] == peer["global_batch_size"]
        res["ratio_trainer_vs_compiled_peer"] = t["tokens_per_s"] / peer["tokens_per_s"] if same_batch else None
        lines.append(f"trainer: {t['sec_per_iter_median']:.3f} s/iter (median of {t['timed_iterations']}), "
                     f"{t['tokens_per_s']:,.0f} tokens/s, {t['tflops_median']:.1f} TFLOPs (log line)")
        if same_batch:
            r = res["ratio_trainer_vs_compiled_peer"]
            lines.append(f"ratio trainer / compiled peer tokens/s: {r:.3f} (target >= {RATIO_TARGET}: "
                         f"{'met' if r >= RATIO_TARGET else 'NOT met'})")
        else:
            lines.append(f"global batch differs (trainer {t['global_batch_size']}, peer {peer['global_batch_size']}): "
                         "no ratio")
    else:
        lines.append("trainer: " + ("missing (no metrics file)" if not t else "present, peer missing"))
    res["layer"] = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "layer_200b_tp8_mbs*.json"))):
        cal = _load(path)
        if not cal:
            continue
        mbs = cal["shape"]["micro_batch_size"]
        res["layer"][mbs] = cal
        parts = [f"{m} {r['sec_per_layer'] * 1e3:.2f} ms / {r['tflops']:.0f} TFLOPs" for m, r in cal["modes"].items()]
        lines.append(f"200B layer tp {cal['shape']['tp_size']} mbs {mbs} ({cal['gpu']}): " + ", ".join(parts))
    res["single_rank"] = {}
    for mode in ("none", "selective", "full"):
        d = _load(os.path.join(out_dir, f"single_rank_1.3b_{mode}.json"))
        if not d:
            lines.append(f"single rank 1.3B {mode}: missing")
            continue
        g = d["results"][0]["gptpar"]
        res["single_rank"][mode] = g
        lines.append(f"single rank 1.3B {mode}: {g['step_s_median']:.3f} s/step, {g['tokens_per_s']:,.0f} tokens/s, "
                     f"{g['tflops']:.1f} TFLOPs (no-recompute count), MFU {g['mfu']:.1%}, peak "
                     f"{g.get('peak_memory_gib', float('nan')):.1f} GiB")
    res["lines"] = lines
    return res


def memory_estimates(config_path: str) -> str:
    """gptpar/estimate/memory.py's estimate for what bench_single_rank runs (one micro-batch, fp32 parameters and AdamW:
    16 bytes per parameter, bf16 autocast activations, fp32 logits + gradient, no CUDA context since the
    bench reads torch's allocator) and for the trainer in bf16 (18 bytes per parameter), per recompute mode."""
    s = settings_of(load_config(config_path))
    out = []
    # bench_single_rank holds a plain torch AdamW (fp32 at ZeRO 0 in memory.py's table: 16 bytes per parameter)
    for label, precision, zero, gbs in (("bench_single_rank (fp32 params + AdamW, bf16 autocast)", "fp32", 0,
                                         s["micro_batch_size"]),
                                        ("trainer, DeepSpeed bf16, global batch 32", "bf16", 1, 32)):
        for mode in ("none", "selective", "full"):
            m = memory_per_gpu(num_layers=s["num_layers"], hidden_size=s["hidden_size"],
                               num_attention_heads=s["num_attention_heads"], vocab_size=s["vocab_size"],
                               seq_length=s["seq_length"], micro_batch_size=s["micro_batch_size"],
                               global_batch_size=gbs, precision=precision, zero_stage=zero,
                               activation_checkpointing=mode, cuda_context_bytes=0)["max"]
            states = m["weights"] + m["gradients"] + m["optimizer"]
            out.append(f"{label}, recompute {mode}: states {states / GIB:.2f} + activations "
                       f"{m['activations'] / GIB:.2f} = {m['total'] / GIB:.2f} GiB")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="the directory bench/gpu_speed.sh wrote")
    p.add_argument("--memory-estimates", metavar="CONFIG", help="print memory.py's estimates for this config")
    args = p.parse_args(argv)
    if args.memory_estimates:
        print(memory_estimates(args.memory_estimates))
    if args.out:
        res = summarize(args.out)
        text = "\n".join(res["lines"])
        print(text)
        with open(os.path.join(args.out, "summary.txt"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
