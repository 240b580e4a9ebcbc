"""Which rank slows the others: each rank's own time per iteration, gathered every log line, and a rank named only
when it stays slower than the others for several log intervals.

A rank's own time is everything it does from one iteration's end to the next's (drawing its data, the step, the
loop's host work between steps) less the time it waited inside collectives and the blocks taken off the clock
(evaluation, saves): gptpar.training.collectives.RankClock. The ranks of one job end each iteration together, since
every collective waits for the slowest rank; what differs is where each spent its time: the slow one working, the
others waiting for it, wherever the slow part is.

Per log interval each rank sends the median of its iterations' own times (one descheduled iteration does not
move it). A rank is over when its median exceeds `threshold` times the median of the *others'* (not of all: one
slow rank of two must not pull the reference towards itself) and by more than `min_gap_s` seconds (a ratio of
two short times is noise); it is named once it has been over for `intervals` log intervals in a row, and at each
log line while it stays so.

Nothing waits for the device: an interval's clocks are read at the next log line, one interval late, once their
end events have completed (queried; an interval whose events have not is dropped, the rank sending nothing that
line). No collective of its own: each rank's time rides in its own slot of the loop's per-iteration stop
all-reduce (over the trainer's host group, gloo: world-size more float64s there at log lines only); the hosts are
gathered once, at the start.
"""
from __future__ import annotations

import socket
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from gptpar.topology import coords_of


def stragglers(seconds: Sequence[float], threshold: float, min_gap_s: float = 0.0) -> List[Tuple[int, float, float]]:
    """[(rank, ratio to the others' median, that median)] of the ranks whose time exceeds `threshold` times the
    median of the other ranks' times and that median by more than `min_gap_s`, slowest first."""
    found = []
    for rank, mine in enumerate(seconds):
        others = [s for r, s in enumerate(seconds) if r != rank]
        if not others:
            continue
        median = statistics.median(others)
        if median > 0 and mine > threshold * median and mine - median > min_gap_s:
            found.append((rank, mine / median, median))
    return sorted(found, key=lambda f: -f[1])


class SustainedStragglers:
    """The rule over log intervals: `update(seconds)` returns the `stragglers` that have been over for at least
    `intervals` consecutive calls, with how many; a call with no times (some rank sent none) keeps the counts."""

    def __init__(self, threshold: float, min_gap_s: float, intervals: int):
        self.threshold, self.min_gap_s, self.intervals = threshold, min_gap_s, intervals
        self.streak: Dict[int, int] = {}

    def update(self, seconds: Sequence[float]) -> List[Tuple[int, float, float, int]]:
        over = stragglers(seconds, self.threshold, self.min_gap_s)
        self.streak = {rank: self.streak.get(rank, 0) + 1 for rank, _, _ in over}
        return [(rank, ratio, median, self.streak[rank]) for rank, ratio, median in over
                if self.streak[rank] >= self.intervals]


class StragglerReport:
    """Keeps this rank's laps (`add`, a gptpar.training.collectives.Lap per iteration) and, at each log line, the
    median own seconds of the previous interval's (`interval_seconds`); the trainer's per-iteration stop all-reduce
    carries every rank's in its own slot (`slots`), and `lines` applies the rule and words the report."""

    def __init__(self, pstate, group, threshold: float, min_gap_s: float, intervals: int):
        """`group`: the host group the hosts are gathered over, once (collective)."""
        self.pstate = pstate
        self.rule = SustainedStragglers(threshold, min_gap_s, intervals)
        self.laps: list = []  # this interval's (iteration, lap)
        self.pending: Optional[list] = None  # the last interval's
        self.reported: Optional[Tuple[int, int]] = None  # the iterations of the interval sent at this log line
        self.hosts = [socket.gethostname()] * pstate.world_size
        if group is not None:
            dist.all_gather_object(self.hosts, socket.gethostname(), group=group)

    def add(self, iteration: int, lap) -> None:
        """The lap of iteration `iteration` (gptpar.training.collectives.Lap)."""
        self.laps.append((iteration, lap))

    def interval_seconds(self) -> float:
        """At a log line: the median own seconds per iteration of the interval before this one
        (its clocks have long been read by the device); -1 when there is none or its end is not yet reached on the
        device (then it is dropped: nothing here ever waits for the device). This interval's laps wait for the
        next log line."""
        ready, self.pending, self.laps = self.pending, self.laps or None, []
        self.reported = None
        if ready is None or not ready[-1][1].ready():
            return -1.0
        self.reported = (ready[0][0], ready[-1][0])
        return statistics.median(lap.own_seconds() for _, lap in ready)

    def slots(self, seconds: float) -> List[float]:
        """One value per rank, this rank's set, the others -inf: a MAX all-reduce of these gives every rank's
        (`seconds_of`)."""
        values = [float("-inf")] * self.pstate.world_size
        values[self.pstate.rank] = seconds
        return values

    @staticmethod
    def seconds_of(reduced: Sequence[float]) -> Optional[List[float]]:
        """Every rank's seconds from the reduced slots; None when some rank timed nothing."""
        return None if min(reduced) < 0 else list(reduced)

    def lines(self, seconds: Sequence[float]) -> List[str]:
        """The rule applied to this log line's times (every rank's, `seconds_of`), one line per rank named."""
        p, rule = self.pstate, self.rule
        first, last = self.reported or (0, 0)
        out = []
        for rank, ratio, median, streak in rule.update(seconds):
            pp, dp, tp = coords_of(rank, p.tp_size, p.pp_size, p.dp_size)
            out.append(f"straggler: rank {rank} ({self.hosts[rank]}, pp {pp}/dp {dp}/tp {tp}) computed "
                       f"{seconds[rank] * 1e3:.1f} ms per iteration, {ratio:.2f} x the others' median "
                       f"({median * 1e3:.1f} ms) in iterations {first}-{last}, over for {streak} log intervals in a "
                       f"row (its own time: data, step and host work less its waits in collectives; "
                       f"logging.straggler_threshold {rule.threshold:g}, straggler_min_gap_seconds "
                       f"{rule.min_gap_s:g}, straggler_intervals {rule.intervals})")
        return out


__all__ = ["StragglerReport", "SustainedStragglers", "stragglers"]
