"""All-reduce bandwidth over message sizes, with nccl-tests' definitions, launched like the trainer.

    torchrun --nproc_per_node 8 tools/allreduce_bench.py                    # NCCL on GPUs
    torchrun --nnodes 2 --nproc_per_node 8 ... tools/allreduce_bench.py     # between nodes
    python -m torch.distributed.run --nproc_per_node 2 tools/allreduce_bench.py --max-bytes 1M   # gloo, CPU

algbw = bytes / time; busbw = algbw * 2(n-1)/n (what a ring moves per rank; compare with the link speed).
Times are the mean over --iters after --warmup, the slowest rank's (max over ranks).
"""
import argparse
import json
import sys
import time


import torch
import torch.distributed as dist

from gptpar.parallel import default_device, init_distributed

_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def parse_bytes(text: str) -> int:
    t = text.strip().upper().rstrip("B")
    unit = t[-1] if t and t[-1] in "KMG" else ""
    try:
        value = int(float(t[:-1] if unit else t) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 4096, 64K, 1M, 1G)") from None
    if value < 4:
        raise ValueError(f"size {text!r} is below one float32 element")
    return value


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw * 2(n-1)/n."""
    return algbw * 2 * (world_size - 1) / world_size


def sizes_between(lo: int, hi: int, factor: int = 2):
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= factor
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-bytes", default="1K")
    parser.add_argument("--max-bytes", default="256M")
    parser.add_argument("--factor", type=int, default=2, help="size step: multiply by this")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--backend", default=None, help="nccl | gloo (default: nccl on CUDA, else gloo)")
    parser.add_argument("--json", action="store_true", help="rank 0 prints one JSON object")
    args = parser.parse_args(argv)
    try:
        lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
        if lo > hi or args.factor < 2 or args.iters < 1 or args.warmup < 0:
            raise ValueError("need --min-bytes <= --max-bytes, --factor >= 2, --iters >= 1, --warmup >= 0")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_distributed(args.backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = default_device() if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for size in sizes_between(lo, hi, args.factor):
        x = torch.ones(max(1, size // elem), dtype=dtype, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(x)
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(x)
        _sync(device)
        elapsed = torch.tensor([(time.perf_counter() - t0) / args.iters], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # the collective ends when the slowest rank does
        sec = elapsed.item()
        nbytes = x.numel() * elem
        algbw = nbytes / sec / 1e9
        rows.append({"bytes": nbytes, "time_us": sec * 1e6, "algbw_GBps": algbw,
                     "busbw_GBps": bus_bandwidth(algbw, world)})
    if rank == 0:
        if args.json:
            print(json.dumps({"world_size": world, "backend": dist.get_backend(), "dtype": args.dtype, "results": rows}))
        else:
            print(f"all-reduce, {world} ranks, {dist.get_backend()}, {args.dtype}")
            print(f"{'bytes':>12} {'time (us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11} {'busbw Gbps':>11}")
            for r in rows:
                print(f"{r['bytes']:>12} {r['time_us']:>11.1f} {r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f} "
                      f"{r['busbw_GBps'] * 8:>11.2f}")
    dist.destroy_process_group()
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
