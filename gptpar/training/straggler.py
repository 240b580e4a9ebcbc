"""Which rank slows the others: each rank's own compute time per iteration, gathered every log line, and the ranks
slower than `logging.straggler_threshold` times the median of the *others* named.

A rank's compute time is its step (forward, backward, optimizer step) less the time it waited inside collectives
(gptpar.training.collectives.StepClock: host time in gloo's calls, CUDA events around NCCL's on the device). The
ranks of one job end each step together, since every collective waits for the slowest rank; what differs is where
each spent its time: the slow one computing, the others waiting for it. The median of the others (not of all) keeps
one slow rank of two from pulling the reference towards itself.

No collective of its own: at a log line each rank's time rides in its own slot of the loop's per-iteration stop
all-reduce (over the trainer's host group, gloo: world-size more float64s there at log lines only); the hosts are
gathered once, at the start.
"""
from __future__ import annotations

import socket
import statistics
from typing import List, Optional, Sequence, Tuple

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
    """Keeps this rank's step clocks (`add`) and, at each log line, their mean compute seconds per iteration
    (`local_mean`); the trainer's per-iteration stop all-reduce carries every rank's in its own slot (`slots`), and
    `lines` words the report. The clocks are read at the log line, not after each step: on a GPU reading one waits
    for its step to end on the device."""

    def __init__(self, pstate, group, threshold: float):
        """`group`: the host group the hosts are gathered over, once (collective)."""
        self.pstate, self.threshold = pstate, threshold
        self.clocks: list = []
        self.hosts = [socket.gethostname()] * pstate.world_size
        if group is not None:
            dist.all_gather_object(self.hosts, socket.gethostname(), group=group)

    def add(self, clock) -> None:
        """One step's clock (gptpar.training.collectives.StepClock), closed."""
        self.clocks.append(clock)

    def local_mean(self) -> float:
        """This rank's mean compute seconds per iteration since the last call; -1 when no step was timed."""
        clocks, self.clocks = self.clocks, []
        return sum(c.compute_seconds() for c in clocks) / len(clocks) if clocks else -1.0

    def slots(self, mean: float) -> List[float]:
        """One value per rank, this rank's set, the others -inf: a MAX all-reduce of these gives every rank's
        (`seconds_of`)."""
        values = [float("-inf")] * self.pstate.world_size
        values[self.pstate.rank] = mean
        return values

    @staticmethod
    def seconds_of(reduced: Sequence[float]) -> Optional[List[float]]:
        """Every rank's seconds from the reduced slots; None when some rank timed nothing."""
        return None if min(reduced) < 0 else list(reduced)

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
