"""Rank (tp, pp, dp, micro batch) layouts for a model on N nodes by predicted seconds per iteration on one GPU kind.

    python tools/plan_topology.py --config configs/200b.json --nodes 48 --gpu h100-80gb
    python tools/plan_topology.py --config configs/200b.json --nodes 48 --gpu h100-80gb --assume dp-comm-overlap
    python tools/plan_topology.py --config configs/200b.json --nodes 40 --calibration h100

Hard constraints filter (tp <= GPUs per node, heads/hidden/ffn % tp, layer partition with >= 1 block
per stage, memory fit); soft ones are flagged and penalised (batch ramp-up vs dp*mbs, trimmed global
batch, fused softmax, hidden % 128). Each layout's days and GPU-hours are the config's train_samples (or
train_iters global batches) at its predicted time per iteration; beside them, the time model's error band on
published measured runs of that GPU kind. The time model and the kinds' facts: docs/planning.md. With
training.precision fp8 each layout's flags say which GEMMs its tp pads or keeps in bf16.

--gpu KIND (a100-80gb, the default; h100-80gb; h200) is the GPU kind the layouts are ranked for: its compute rate,
memory, HBM and links. --gpu-mem GiB overrides that kind's memory (a smaller or shared card). --calibration FILE
(repeatable; bench/bench_layer.py --json, or a shipped one's name: h100) refines the kind it was measured on with
the measured seconds per layer; the config's own layout is then predicted on every kind side by side, with each
kind's best layout on --nodes. --assume X (repeatable) adds a what-if gptpar does not run: interleaved=V,
tp-comm-overlap, dp-comm-overlap, distributed-optimizer, ddp.
"""
import argparse
import json
import os
import sys


from gptpar.estimate.kinds import DEFAULT_KIND, kind_names, parse_assumptions
from gptpar.estimate.planner import calibrated_kind, gpu_kind, plan_topology, predict_layout, training_time
from gptpar.estimate.report import assumptions_line, sig3
from gptpar.estimate.settings import settings_of
from gptpar.estimate.validation import band_phrase, error_band
from gptpar.tensor_parallel.float8_shapes import describe_float8_gemms, layer_float8_gemms
from gptpar.config import load_config

TOP = 20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--config", required=True, help="JSON config, read and checked as pretrain_gpt.py reads it")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key, as pretrain_gpt.py --set (repeatable)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", default=DEFAULT_KIND, metavar="KIND",
                        help=f"the GPU kind to rank for: {', '.join(kind_names())} (default {DEFAULT_KIND})")
    parser.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU (default: the kind's)")
    parser.add_argument("--assume", action="append", default=[], metavar="X",
                        help="a what-if gptpar does not run: interleaved=V, tp-comm-overlap, dp-comm-overlap, "
                             "distributed-optimizer, ddp (repeatable)")
    parser.add_argument("--calibration", action="append", default=[], metavar="FILE",
                        help="a GPU kind's measured seconds per layer (bench/bench_layer.py --json), or a shipped "
                             "one's name (h100); repeatable")
    parser.add_argument("--measured", metavar="FILE",
                        help="measured runs to print beside the config's layout (JSON with a 'runs' list of [where, "
                             "layers, hidden, tp, pp, dp, mbs, gbs, s/it, ...], e.g. tests/data/seed_runs.json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        if args.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
        if args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
        if args.gpu_mem is not None and args.gpu_mem <= 0:
            raise ValueError(f"--gpu-mem must be > 0 (GiB), got {args.gpu_mem}")
        runs = _measured_runs(args.measured)
        assume = parse_assumptions(args.assume)
        kind = gpu_kind(args.gpu, args.gpus_per_node, args.gpu_mem)
        s = settings_of(load_config(args.config, args.set))
        hw = kind.hardware
        cands = plan_topology(s, args.nodes, hw, assume=assume)
        kinds = [kind] + [calibrated_kind(path, s, fallback=args.gpu) for path in args.calibration]
        layouts = [_layout_row(s, k, args.nodes, assume) for k in kinds] if args.calibration else []
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not cands:
        print(f"error: no layout fits {args.nodes} nodes x {args.gpus_per_node} {kind.name} GPUs with "
              f"{hw.gpu_mem_gib} GiB: raise --nodes or --gpu-mem", file=sys.stderr)
        return 1
    band = error_band(args.gpu)
    if args.json:
        best = cands[0]
        print(json.dumps({"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "gpu_mem": hw.gpu_mem_gib,
                          "gpu": kind.name, "hardware": hw.__dict__, "assumptions": assume.names(),
                          "error_band": band, "num_candidates": len(cands),
                          "gpus": best.tp * best.pp * best.dp, "sec_per_iter": best.sec_per_requested_batch,
                          "tflops_per_gpu": best.tflops_per_gpu, "memory_gib": best.mem_gib, "fits": True,
                          "days": best.days, "gpu_hours": best.gpu_hours,
                          "candidates": [c.to_dict() for c in cands[:50]], "layouts": layouts}))
        return 0
    print(f"{len(cands)} layouts fit on {args.nodes} nodes x {args.gpus_per_node} {kind.name} "
          f"({hw.gpu_mem_gib:.1f} GiB; {kind.source}); best {min(TOP, len(cands))} by predicted s/it at the requested "
          f"batch {s['global_batch_size']}, soft flags penalise the rank; days and GPU-hours to train "
          f"{s['train_samples']:,} samples, error band {band_phrase(args.gpu)}")
    print(assumptions_line(assume))
    if s["precision"] == "fp8":
        print(describe_float8_gemms(layer_float8_gemms(s["hidden_size"], s["ffn_hidden_size"], s["tp_size"]),
                                    s["tp_size"]))
    print(f"{'#':>3} {'nodes':>5} {'tp':>3} {'pp':>3} {'dp':>3} {'mbs':>3} {'gbs':>5} {'mem GiB':>7} {'s/it':>7} "
          f"{'days':>7} {'GPU-hours':>10} {'TFLOPs':>6} {'compute':>7} {'bubble':>6} {'tp comm':>7} {'pp comm':>7} "
          f"{'dp comm':>7}  flags")
    for i, c in enumerate(cands[:TOP], 1):
        print(f"{i:>3} {c.nodes:>5} {c.tp:>3} {c.pp:>3} {c.dp:>3} {c.mbs:>3} {c.global_batch_size:>5} "
              f"{c.mem_gib:>7.1f} "
              f"{sig3(c.sec_per_requested_batch):>7} {sig3(c.days):>7} {c.gpu_hours:>10,.0f} {c.tflops_per_gpu:>6.0f} "
              f"{sig3(c.compute_s):>7} {sig3(c.bubble_s):>6} {sig3(c.tp_comm_s):>7} {sig3(c.pp_comm_s):>7} "
              f"{sig3(c.dp_comm_s):>7}  {', '.join(c.soft)}")
    if layouts:
        print_layouts(s, layouts, args.nodes, runs)
    return 0


def _layout_row(s, kind, nodes, assume):
    """The config's layout predicted on one GPU kind (with its days and GPU-hours), and that kind's best layout on
    `nodes` nodes."""
    row = {"kind": kind.name, "source": kind.source, "achieved_tflops": kind.hardware.achieved_tflops,
           "gpu_mem_gib": kind.hardware.gpu_mem_gib, "notes": list(kind.notes),
           **predict_layout(s, kind.hardware, assume)}
    row.update(training_time(s["train_samples"], s["global_batch_size"], row["sec_per_iter"],
                             s["tp_size"] * s["pp_size"] * s["dp_size"]))
    best = plan_topology(s, nodes, kind.hardware, assume=assume)
    row["best"] = best[0].to_dict() if best else None
    return row


def _measured_runs(path):
    """The 'runs' list of a --measured file; ValueError naming the file when it is missing or not such a list."""
    if path is None:
        return []
    if not os.path.isfile(path):
        raise ValueError(f"--measured {path!r}: no such file (e.g. tests/data/seed_runs.json)")
    try:
        with open(path) as f:
            runs = json.load(f)["runs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--measured {path}: not a JSON object with a 'runs' list ({type(e).__name__})") from None
    if not isinstance(runs, list):
        raise ValueError(f"--measured {path}: 'runs' must be a list")
    return runs


def print_layouts(s, layouts, nodes, runs):
    L, h = s["num_layers"], s["hidden_size"]
    tp, pp, dp, mbs, gbs = s["tp_size"], s["pp_size"], s["dp_size"], s["micro_batch_size"], s["global_batch_size"]
    print(f"\nThe config's layout, tp {tp} x pp {pp} x dp {dp} ({tp * pp * dp} GPUs), micro batch {mbs}, global "
          f"batch {gbs}, recompute {s['activation_checkpointing']}, per GPU kind (rate = the model's achieved "
          f"TFLOPs before its micro-batch and shape factors; tp all-reduces from the bandwidth model):")
    print(f"  {'GPU kind':<24} {'rate':>6} {'mem GiB':>8} {'s/it':>8} {'days':>7} {'GPU-hours':>10} {'compute':>8} "
          f"{'bubble':>7} {'tp comm':>7} {'pp comm':>7} {'dp comm':>7}  best layout on {nodes} nodes")
    for r in layouts:
        b = r["best"]
        best = (f"tp {b['tp']} pp {b['pp']} dp {b['dp']} mbs {b['mbs']}: {sig3(b['sec_per_requested_batch'])} s/it, "
                f"{sig3(b['days'])} days" if b else "none fits")
        mem = f"{r['mem_gib']:.1f}" + ("" if r["fits"] else "!")
        print(f"  {r['kind'][:24]:<24} {r['achieved_tflops']:>6.1f} {mem:>8} {sig3(r['sec_per_iter']):>8} "
              f"{sig3(r['days']):>7} {r['gpu_hours']:>10,.0f} {sig3(r['compute_s']):>8} {sig3(r['bubble_s']):>7} "
              f"{sig3(r['tp_comm_s']):>7} {sig3(r['pp_comm_s']):>7} {sig3(r['dp_comm_s']):>7}  {best}")
        print(f"  {'':<24} source: {r['source']}")
        if r["notes"]:
            print(f"  {'':<24} calibrated at another shape: {'; '.join(r['notes'])}")
    measured = [row for row in runs if tuple(row[1:8]) == (L, h, tp, pp, dp, mbs, gbs)]
    for where, *_, sec, _printed, _how in measured:
        print(f"  measured ({where}): {sec} s/it")
    if any(not r["fits"] for r in layouts):
        print("  (! = the memory estimate exceeds that GPU's memory)")
