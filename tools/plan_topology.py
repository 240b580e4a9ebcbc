#!/usr/bin/env python
"""Rank (tp, pp, dp, micro batch) layouts for a model on N nodes by predicted seconds per iteration.

    python tools/plan_topology.py --config configs/200b.json --nodes 48 --gpus-per-node 8 --gpu-mem 80

Hard constraints filter (tp <= GPUs per node, heads/hidden/ffn % tp, layer partition with >= 1 block
per stage, memory fit); soft ones are flagged and penalised (batch ramp-up vs dp*mbs, trimmed global
batch, fused softmax, hidden % 128). The time model is in docs/planning.md.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gptpar.planning import Hardware, load_config, plan_topology, settings_from_config  # noqa: E402

TOP = 20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="JSON config (model, training sections)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        if args.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
        if args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
        if args.gpu_mem <= 0:
            raise ValueError(f"--gpu-mem must be > 0 (GiB), got {args.gpu_mem}")
        s = settings_from_config(load_config(args.config))
        hw = Hardware(gpus_per_node=args.gpus_per_node, gpu_mem_gib=args.gpu_mem)
        cands = plan_topology(s, args.nodes, hw)
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
                          "candidates": [c.to_dict() for c in cands[:50]]}))
        return 0
    print(f"{len(cands)} layouts fit; best {min(TOP, len(cands))} by predicted s/it (at the requested batch "
          f"{s['global_batch_size']}), soft flags penalise the rank")
    print(f"{'#':>3} {'nodes':>5} {'tp':>3} {'pp':>3} {'dp':>3} {'mbs':>3} {'gbs':>5} {'mem GiB':>7} {'s/it':>7} "
          f"{'compute':>7} {'bubble':>6} {'tp comm':>7} {'pp comm':>7} {'dp comm':>7}  flags")
    for i, c in enumerate(cands[:TOP], 1):
        print(f"{i:>3} {c.nodes:>5} {c.tp:>3} {c.pp:>3} {c.dp:>3} {c.mbs:>3} {c.global_batch_size:>5} {c.mem_gib:>7.1f} "
              f"{c.sec_per_requested_batch:>7.1f} {c.compute_s:>7.1f} {c.bubble_s:>6.1f} {c.tp_comm_s:>7.1f} "
              f"{c.pp_comm_s:>7.1f} {c.dp_comm_s:>7.1f}  {', '.join(c.soft)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
