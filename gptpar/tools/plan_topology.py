"""Rank (tp, pp, dp, micro batch) layouts for a model on N nodes by predicted seconds per iteration.

    python tools/plan_topology.py --config configs/200b.json --nodes 48 --gpus-per-node 8 --gpu-mem 80
    python tools/plan_topology.py --config configs/200b.json --nodes 40 --calibration h100

Hard constraints filter (tp <= GPUs per node, heads/hidden/ffn % tp, layer partition with >= 1 block
per stage, memory fit); soft ones are flagged and penalised (batch ramp-up vs dp*mbs, trimmed global
batch, fused softmax, hidden % 128). Each layout's days and GPU-hours are the config's train_samples (or
train_iters global batches) at its predicted time per iteration. The time model is in docs/planning.md, its rate
fitted to measured Megatron-DeepSpeed runs on A100 80GB nodes. With training.precision fp8 each
layout's flags say which GEMMs its tp pads or keeps in bf16 (gptpar.tensor_parallel.float8.plan_float8_gemm), and
the config's own tp is described in full; the time model does not yet rate float8 GEMMs faster.

--calibration FILE (repeatable; written by bench/bench_layer.py --json, or the name of one gptpar ships in
gptpar/estimate/calibrations/: h100) adds a GPU kind whose compute rate comes from measured seconds per layer:
the config's own layout is then predicted for the A100 fit and for every calibrated kind side by side, with each
kind's best layout on --nodes.
"""
import argparse
import json
import sys


from gptpar.estimate.planner import (a100_kind, calibrated_kind, plan_topology, predict_layout,
                                     training_time)
from gptpar.estimate.settings import settings_of
from gptpar.tensor_parallel.float8_shapes import describe_float8_gemms, layer_float8_gemms
from gptpar.config import load_config

TOP = 20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="JSON config, read and checked as pretrain_gpt.py reads it")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key, as pretrain_gpt.py --set (repeatable)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
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
        if args.gpu_mem <= 0:
            raise ValueError(f"--gpu-mem must be > 0 (GiB), got {args.gpu_mem}")
        s = settings_of(load_config(args.config, args.set))
        a100 = a100_kind(args.gpus_per_node, args.gpu_mem)
        hw = a100.hardware
        cands = plan_topology(s, args.nodes, hw)
        kinds = [a100] + [calibrated_kind(path, s, hw) for path in args.calibration]
        layouts = [_layout_row(s, kind, args.nodes) for kind in kinds] if args.calibration else []
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not cands:
        print(f"error: no layout fits {args.nodes} nodes x {args.gpus_per_node} GPUs with {args.gpu_mem} GiB: "
              f"raise --nodes or --gpu-mem", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "gpu_mem": args.gpu_mem,
                          "hardware": hw.__dict__, "num_candidates": len(cands),
                          "candidates": [c.to_dict() for c in cands[:50]], "layouts": layouts}))
        return 0
    print(f"{len(cands)} layouts fit; best {min(TOP, len(cands))} by predicted s/it on {a100.name} ({a100.source}; "
          f"at the requested batch {s['global_batch_size']}), soft flags penalise the rank; days and GPU-hours to "
          f"train {s['train_samples']:,} samples")
    if s["precision"] == "fp8":
        print(describe_float8_gemms(layer_float8_gemms(s["hidden_size"], s["ffn_hidden_size"], s["tp_size"]),
                                    s["tp_size"]))
    print(f"{'#':>3} {'nodes':>5} {'tp':>3} {'pp':>3} {'dp':>3} {'mbs':>3} {'gbs':>5} {'mem GiB':>7} {'s/it':>7} "
          f"{'days':>7} {'GPU-hours':>10} {'compute':>7} {'bubble':>6} {'tp comm':>7} {'pp comm':>7} {'dp comm':>7}  "
          "flags")
    for i, c in enumerate(cands[:TOP], 1):
        print(f"{i:>3} {c.nodes:>5} {c.tp:>3} {c.pp:>3} {c.dp:>3} {c.mbs:>3} {c.global_batch_size:>5} {c.mem_gib:>7.1f} "
              f"{c.sec_per_requested_batch:>7.1f} {c.days:>7.1f} {c.gpu_hours:>10,.0f} {c.compute_s:>7.1f} "
              f"{c.bubble_s:>6.1f} {c.tp_comm_s:>7.1f} {c.pp_comm_s:>7.1f} {c.dp_comm_s:>7.1f}  {', '.join(c.soft)}")
    if layouts:
        print_layouts(s, layouts, args.nodes, _measured_runs(args.measured))
    return 0


def _layout_row(s, kind, nodes):
    """The config's layout predicted on one GPU kind (with its days and GPU-hours), and that kind's best layout on
    `nodes` nodes."""
    row = {"kind": kind.name, "source": kind.source, "achieved_tflops": kind.hardware.achieved_tflops,
           "gpu_mem_gib": kind.hardware.gpu_mem_gib, "notes": list(kind.notes), **predict_layout(s, kind.hardware)}
    row.update(training_time(s["train_samples"], s["global_batch_size"], row["sec_per_iter"],
                             s["tp_size"] * s["pp_size"] * s["dp_size"]))
    best = plan_topology(s, nodes, kind.hardware)
    row["best"] = best[0].to_dict() if best else None
    return row


def _measured_runs(path):
    if path is None:
        return []
    with open(path) as f:
        return json.load(f)["runs"]


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
        best = (f"tp {b['tp']} pp {b['pp']} dp {b['dp']} mbs {b['mbs']}: {b['sec_per_requested_batch']:.1f} s/it, "
                f"{b['days']:.1f} days" if b else "none fits")
        mem = f"{r['mem_gib']:.1f}" + ("" if r["fits"] else "!")
        print(f"  {r['kind'][:24]:<24} {r['achieved_tflops']:>6.1f} {mem:>8} {r['sec_per_iter']:>8.1f} "
              f"{r['days']:>7.1f} {r['gpu_hours']:>10,.0f} {r['compute_s']:>8.1f} {r['bubble_s']:>7.1f} "
              f"{r['tp_comm_s']:>7.1f} {r['pp_comm_s']:>7.1f} {r['dp_comm_s']:>7.1f}  {best}")
        print(f"  {'':<24} source: {r['source']}")
        if r["notes"]:
            print(f"  {'':<24} calibrated at another shape: {'; '.join(r['notes'])}")
    measured = [row for row in runs if tuple(row[1:8]) == (L, h, tp, pp, dp, mbs, gbs)]
    for where, *_, sec, _printed, _how in measured:
        print(f"  measured ({where}): {sec} s/it")
    if any(not r["fits"] for r in layouts):
        print("  (! = the memory estimate exceeds that GPU's memory)")
