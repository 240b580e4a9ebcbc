"""Which rank slows the others: each rank's own compute time per iteration, gathered every log line, and the ranks
slower than `logging.straggler_threshold` times the median of the *others* named.

A rank's compute time is its step (forward, backward, optimizer step) less the time it waited inside collectives
(gptpar.training.collectives.StepClock: host time in gloo's calls, CUDA events around NCCL's on the device). The
ranks of one job end each step together, since every collective waits for the slowest rank; what differs is where
each spent its time: the slow one computing, the others waiting for it. The median of the others (not of all) keeps
one slow rank of two from pulling the reference towards itself.

One all-gather of one float64 per rank per log line, over the trainer's host (gloo) group; the hosts are gathered
once, at the start.
"""
from __future__ import annotations

import socket
import statistics
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gptpar.topology import coords_of


def stragglers(seconds: Sequence[float], threshold: float) -> List[Tuple[int, float, float]]:
    """[(rank, ratio to the others' median, that median)] of the ranks whose time exceeds `threshold` times the
    median of the other ranks' times, slowest first."""
    found = []
    for rank, mine in enumerate(seconds):
        others = [s for r, s in enumerate(seconds) if r != rank]
        if not others:
            continue
        median = statistics.median(others)
        if median > 0 and mine > threshold * median:
            found.append((rank, mine / median, median))
    return sorted(found, key=lambda f: -f[1])


class StragglerReport:
    """Keeps this rank's step clocks (`add`), gathers every rank's mean compute seconds per iteration at each log
    line (`gather`, collective) and words the report (`lines`). The clocks are read at the log line, not after each
    step: on a GPU reading one waits for its step to end on the device."""

    def __init__(self, pstate, group, threshold: float):
        self.pstate, self.group, self.threshold = pstate, group, threshold
        self.clocks: list = []
        self.hosts = [socket.gethostname()] * pstate.world_size
        if group is not None:
            dist.all_gather_object(self.hosts, socket.gethostname(), group=group)

    def add(self, clock) -> None:
        """One step's clock (gptpar.training.collectives.StepClock), closed."""
        self.clocks.append(clock)

    def gather(self) -> Optional[List[float]]:
        """Every rank's mean compute seconds per iteration since the last call (rank order); None with one rank or
        no iteration timed. Collective over the host group."""
        clocks, self.clocks = self.clocks, []
        timed = bool(clocks)
        mean = sum(c.compute_seconds() for c in clocks) / len(clocks) if timed else 0.0
        if self.group is None:
            return None
        values = torch.tensor([mean if timed else -1.0], dtype=torch.float64)
        gathered = [torch.empty_like(values) for _ in range(self.pstate.world_size)]
        dist.all_gather(gathered, values, group=self.group)
        seconds = [float(v) for v in torch.cat(gathered)]
        return None if min(seconds) < 0 else seconds

    def lines(self, seconds: Sequence[float]) -> List[str]:
        p = self.pstate
        out = []
        for rank, ratio, median in stragglers(seconds, self.threshold):
            pp, dp, tp = coords_of(rank, p.tp_size, p.pp_size, p.dp_size)
            out.append(f"straggler: rank {rank} ({self.hosts[rank]}, pp {pp}/dp {dp}/tp {tp}) computed "
                       f"{seconds[rank] * 1e3:.1f} ms per iteration, {ratio:.2f} x the others' median "
                       f"({median * 1e3:.1f} ms; logging.straggler_threshold {self.threshold:g})")
        return out


__all__ = ["StragglerReport", "stragglers"]
