"""Where a profiled trainer iteration's GPU time goes, from the Chrome trace `logging.profile_dir` writes.

    python bench/trace_kernels.py gpu_out/trace/trace_rank0.json.gz --iterations 2

(`TRACE=1 bash bench/gpu.sh speed` with the step trainer_profile writes that trace on the GPU.) Prints, per
iteration: the kernel time of the GEMMs, attention and everything else; the other kernels, each with the host op
that launched it (through the runtime call's correlation id); the host's blocking synchronizations (a
cudaStreamSynchronize is the host waiting for the device, and the device then idles until the host has queued its
next work); and the device's idle gaps, the longest with the kernels on either side. The profiler slows the host,
so its idle gaps are an upper bound of the unprofiled run's.
"""
import argparse
import bisect
import collections
import gzip
import json


def load(path):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def category(name: str) -> str:
    if "nvjet" in name or "gemm" in name.lower() or "cutlass" in name:
        return "GEMM"
    if "sdpa" in name or "flash" in name or "cudnn" in name:
        return "attention"
    return "other"


class HostOps:
    """The host ops (cpu_op, user annotations) of each host thread, to ask which enclose a moment."""

    def __init__(self, events):
        self.by_tid = collections.defaultdict(list)
        for e in events:
            if e.get("cat") in ("cpu_op", "user_annotation") and e.get("ph") == "X":
                self.by_tid[e["tid"]].append(e)
        self.starts, self.parent = {}, {}
        for tid, ops in self.by_tid.items():
            ops.sort(key=lambda e: (e["ts"], -e["dur"]))  # an enclosing op before the ops it encloses
            self.starts[tid] = [e["ts"] for e in ops]
            parent, open_ops = [], []  # each op's enclosing op (index, -1 at the top), from a stack of open ones
            for i, e in enumerate(ops):
                while open_ops and ops[open_ops[-1]]["ts"] + ops[open_ops[-1]]["dur"] < e["ts"]:
                    open_ops.pop()
                parent.append(open_ops[-1] if open_ops else -1)
                open_ops.append(i)
            self.parent[tid] = parent

    def enclosing(self, tid, ts, depth=4) -> str:
        """The innermost `depth` host ops running at `ts`, outermost first."""
        ops, parent = self.by_tid.get(tid, []), self.parent.get(tid, [])
        i = bisect.bisect_right(self.starts.get(tid, []), ts) - 1
        while i >= 0 and ops[i]["ts"] + ops[i]["dur"] < ts:  # an op that encloses ts encloses op i's start too
            i = parent[i]
        names = []
        while i >= 0 and len(names) < depth:
            names.append(ops[i]["name"])
            i = parent[i]
        return " > ".join(reversed(names)) or "(no host op)"


def summarize(events, iterations: int = 1, min_gap_us: float = 20.0) -> dict:
    """The figures `main` prints, per iteration where a time: kernel time by category, the other kernels grouped
    by (name, launching host op), the host's waits of >= 0.1 ms, and the device's idle gaps (on no stream)."""
    n = iterations
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    host = HostOps(events)
    t0 = kernels[0]["ts"]

    by_cat = collections.Counter()
    other = collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        cat = category(k["name"])
        by_cat[cat] += k["dur"]
        if cat == "other":
            call = runtime.get(k["args"].get("correlation"))
            launcher = host.enclosing(call["tid"], call["ts"]) if call else "?"
            row = other[(k["name"], launcher)]
            row[0] += 1
            row[1] += k["dur"]
    waits = [{"at_ms": (e["ts"] - t0) / 1e3, "ms": e["dur"] / 1e3, "call": e["name"],
              "in": host.enclosing(e["tid"], e["ts"])}
             for e in sorted(events, key=lambda e: e.get("ts", 0))
             if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"] and e["dur"] >= 100]

    merged = []  # the union of the kernels' intervals, every stream: [start, end, first kernel, last kernel]
    for k in kernels:
        start, end = k["ts"], k["ts"] + k["dur"]
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
            merged[-1][3] = k
        else:
            merged.append([start, end, k, k])
    gaps = sorted(((b[0] - a[1], a, b) for a, b in zip(merged, merged[1:]) if b[0] - a[1] >= min_gap_us),
                  key=lambda g: -g[0])
    return {
        "kernels": len(kernels), "iterations": n,
        "ms": {c: v / 1e3 / n for c, v in by_cat.most_common()},
        "other": [{"ms": dur / 1e3 / n, "launches": count / n, "us_each": dur / count, "kernel": name,
                   "launched_in": launcher}
                  for (name, launcher), (count, dur) in sorted(other.items(), key=lambda x: -x[1][1])],
        "waits": waits,
        "idle_ms": sum(g[0] for g in gaps) / 1e3 / n, "gap_count": len(gaps), "min_gap_us": min_gap_us,
        "span_ms": (merged[-1][1] - merged[0][0]) / 1e3,
        "gaps": [{"ms": length / 1e3, "at_ms": (a[1] - t0) / 1e3, "after": a[3]["name"], "before": b[2]["name"]}
                 for length, a, b in gaps],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--iterations", type=int, default=1, help="iterations the trace covers (figures are per one)")
    ap.add_argument("--top", type=int, default=25, help="rows of the other-kernels table")
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    args = ap.parse_args(argv)
    r = summarize(load(args.trace), args.iterations, args.min_gap_us)

    print(f"{args.trace}: {r['kernels']} kernels, {sum(r['ms'].values()):.1f} ms of kernel time per iteration "
          f"({r['iterations']} iteration(s)); " + ", ".join(f"{c} {v:.1f} ms" for c, v in r["ms"].items()))
    print("\nthe other kernels (ms and launches per iteration, mean us each; the host op that launched them):")
    for row in r["other"][:args.top]:
        print(f"{row['ms']:7.2f} ms {row['launches']:6.0f}x {row['us_each']:7.1f} us  {row['kernel'][:70]}  <-  "
              f"{row['launched_in'][-110:]}")
    print(f"\nhost waits of >= 0.1 ms for the device ({len(r['waits'])}):")
    for w in r["waits"]:
        print(f"  +{w['at_ms']:9.3f} ms  {w['ms']:7.3f} ms  {w['call']} in {w['in']}")
    print(f"\ndevice idle: {r['idle_ms']:.2f} ms per iteration in gaps of >= {r['min_gap_us']:.0f} us "
          f"({r['gap_count']} gaps; {r['span_ms']:.1f} ms from the first kernel to the last); the longest:")
    for g in r["gaps"][:10]:
        print(f"  {g['ms']:7.3f} ms at +{g['at_ms']:9.3f} ms, after {g['after'][:45]}  before {g['before'][:45]}")


if __name__ == "__main__":
    main()
