"""logging.profile: torch.profiler over a range of iterations (Megatron-LM's --profile-step-start/-end).

Between the start of iteration START and the end of iteration END every rank records its CPU ops and, on a GPU,
its kernels; at END the log rank prints where the device's time went (the top kernels by self time, and how much
of the profiled wall time the device was busy at all: the rest is idle, waiting for the host; and the longest of
those idle gaps, each with the host ops that were running through it: where the host made the device wait), and with
logging.profile_dir each rank writes its Chrome trace (`trace_rank<R>.json.gz`, for chrome://tracing or Perfetto)
there. Pick iterations after the first (training.compile compiles during iteration 1).
"""
from __future__ import annotations

import os
import time
from typing import Callable, List, Optional, Tuple

import torch

from gptpar.config import parse_range


class IterationProfiler:
    """Wraps the trainer's iterations: `before(n)` ahead of iteration n, `after(n)` once it is done."""

    def __init__(self, spec: str, trace_dir: Optional[str], rank: int, device: torch.device,
                 say: Callable[[str], None], rows: int = 25):
        self.start, self.end = parse_range(spec)
        self.trace_dir, self.rank, self.device, self.say, self.rows = trace_dir, rank, device, say, rows
        self.prof = None
        self.began = 0.0
        self.stopped_before: Optional[int] = None  # the range's END when the run stopped first (`finish`)

    def before(self, iteration: int) -> None:
        if iteration != self.start or self.prof is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        _synchronize(self.device)
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.began = time.perf_counter()

    def after(self, iteration: int) -> None:
        if self.prof is None or iteration < self.end:
            return
        _synchronize(self.device)
        wall = time.perf_counter() - self.began
        self.prof.__exit__(None, None, None)
        events, prof, self.prof = self.prof.key_averages(), self.prof, None
        if self.trace_dir:
            os.makedirs(self.trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(self.trace_dir, f"trace_rank{self.rank}.json.gz"))
        report = self.report(events, wall)
        if self.device.type == "cuda":
            raw = prof.events()
            kernels = [(e.time_range.start, e.time_range.end) for e in raw if e.device_type.name == "CUDA"]
            host = [(e.time_range.start, e.time_range.end, e.name) for e in raw if e.device_type.name == "CPU"]
            report += "\n" + format_idle_gaps(idle_gaps(kernels, host))
        self.say(report)

    def finish(self, iteration: int) -> None:
        """At the end of a run that stopped inside the range (a signal, an exit condition): report the iterations
        profiled so far instead of nothing."""
        if self.prof is not None and iteration >= self.start:
            self.stopped_before, self.end = self.end, iteration
            self.after(iteration)

    def report(self, events, wall: float) -> str:
        """The table of the top ops by device (CPU: host) self time, and the device's busy share of `wall`."""
        on_device = self.device.type == "cuda"
        key = "self_device_time_total" if on_device else "self_cpu_time_total"
        busy_us = sum(getattr(e, key) for e in events if not on_device or e.device_type.name == "CUDA")
        n = self.end - self.start + 1
        head = (f"logging.profile: iterations {self.start}-{self.end} on rank {self.rank}"
                + (f" (the run stopped before iteration {self.stopped_before})" if self.stopped_before else "")
                + f": {wall:.3f} s wall ({wall / n:.3f} s per iteration)")
        if on_device:
            head += (f"; kernels busy {busy_us / 1e6:.3f} s = {100 * busy_us / 1e6 / wall:.1f}% of it (the rest: "
                     "the device waiting for the host)")
        if self.trace_dir:
            head += f"; trace in {self.trace_dir}/trace_rank{self.rank}.json.gz"
        return head + "\n" + events.table(sort_by=key, row_limit=self.rows, max_name_column_width=60)


def idle_gaps(kernels: List[Tuple[float, float]], host: List[Tuple[float, float, str]], *, min_us: float = 20.0,
              top: int = 8) -> dict:
    """Where the device sat idle between kernels: `kernels` (start, end) in us on the device (any stream), `host`
    (start, end, name) the host ops. Returns the number and total of gaps of at least `min_us` between the union of
    the kernels' intervals, and the `top` longest, each with the host ops spanning its middle (outermost first:
    what the host was doing while the device waited)."""
    merged: List[List[float]] = []
    for start, end in sorted(kernels):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    gaps = [(b[0] - a[1], a[1], b[0]) for a, b in zip(merged, merged[1:]) if b[0] - a[1] >= min_us]
    longest = []
    for length, start, end in sorted(gaps, reverse=True)[:top]:
        middle = (start + end) / 2
        spanning = sorted((h for h in host if h[0] <= middle <= h[1]), key=lambda h: (h[0], -h[1]))
        longest.append({"us": length, "start_us": start, "host": [name for _, _, name in spanning]})
    return {"count": len(gaps), "total_us": sum(g[0] for g in gaps), "min_us": min_us, "longest": longest}


def format_idle_gaps(gaps: dict, depth: int = 4) -> str:
    """`idle_gaps` as lines: the total, then each long gap with the outermost `depth` host ops running through it."""
    lines = [f"device idle between kernels: {gaps['total_us'] / 1e3:.2f} ms in {gaps['count']} gaps of "
             f">= {gaps['min_us']:.0f} us; the longest:"]
    for gap in gaps["longest"]:
        host = " > ".join(gap["host"][:depth]) or "(no host op: Python between ops)"
        lines.append(f"  {gap['us'] / 1e3:8.3f} ms at +{gap['start_us'] / 1e3:.1f} ms, host in: {host}")
    return "\n".join(lines)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["IterationProfiler", "idle_gaps", "format_idle_gaps"]
