"""How long the ranks get to save after a stop signal before their launcher kills them.

On SIGTERM or SIGINT the ranks finish their iteration, save and exit 0 (gptpar.training.trainer); a launcher waits
a while for them, then SIGKILLs them: torchrun's elastic agent `--shutdown-timeout` seconds (30 by default), which
at 200B is less than one iteration plus a save. gptpar.launch passes torchrun `grace_seconds(cfg)` instead:

    checkpoint.shutdown_grace_seconds   when set
    otherwise                           the larger of FLOOR_SECONDS and MARGIN x (the last iteration's seconds + the
                                        last save's seconds) + SLACK_SECONDS, as rank 0 measured them in this save
                                        folder (`{checkpoint.save}/.gptpar-save-times.json`, rewritten after every
                                        save: `record`)

A rank that ends sooner ends the job sooner: the grace only bounds the wait for a rank that never ends.
"""
from __future__ import annotations

import json
import math
import os
from typing import Callable, Optional, Tuple

from gptpar.checkpoint.layout import SAVE_TIMES

FLOOR_SECONDS = 300  # no measurement yet (a fresh save folder): five minutes, ten times torch's default
MARGIN = 2.0  # a save under SIGTERM may meet a slower file system than the last one (other jobs saving too)
SLACK_SECONDS = 60  # the process group's teardown and the launcher's own polling


def record(save_dir: str, iteration: int, iteration_seconds: float, save_seconds: float,
           log: Callable[[str], None] = print) -> None:
    """Rank 0, after a save was written: keep its duration and the last iteration's for the launcher's next start.
    Written under a temporary name and renamed (a reader never sees half of it); a failure is said, not raised:
    the save itself succeeded."""
    path = os.path.join(save_dir, SAVE_TIMES)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump({"iteration": iteration, "iteration_seconds": round(iteration_seconds, 3),
                       "save_seconds": round(save_seconds, 3)}, f)
        os.replace(tmp, path)
    except OSError as e:
        log(f"warning: could not record the save's duration in {path} ({type(e).__name__}: {e.strerror}): "
            "gptpar.launch's next start gives a stop its default grace")


def read_times(save_dir: Optional[str]) -> Optional[dict]:
    """The recorded {"iteration", "iteration_seconds", "save_seconds"}; None when there is none (or it is garbled)."""
    if not save_dir:
        return None
    try:
        with open(os.path.join(save_dir, SAVE_TIMES)) as f:
            times = json.load(f)
        float(times["iteration_seconds"]), float(times["save_seconds"])
        return times
    except (OSError, ValueError, KeyError, TypeError):
        return None


def grace_seconds(cfg) -> Tuple[int, str]:
    """(seconds, where they come from, for the launcher's line) for the run configured by `cfg`."""
    ck = cfg.checkpoint
    if ck.shutdown_grace_seconds is not None:
        return ck.shutdown_grace_seconds, "checkpoint.shutdown_grace_seconds"
    times = read_times(ck.save)
    if times is None:
        where = f"no save measured in {ck.save} yet" if ck.save else "checkpoint.save is null"
        return FLOOR_SECONDS, f"the default, {where}"
    measured = float(times["iteration_seconds"]) + float(times["save_seconds"])
    seconds = max(FLOOR_SECONDS, math.ceil(MARGIN * measured + SLACK_SECONDS))
    return seconds, (f"{MARGIN:g} x (iteration {float(times['iteration_seconds']):.1f} s + save "
                     f"{float(times['save_seconds']):.1f} s, measured at iteration {times.get('iteration')}) + "
                     f"{SLACK_SECONDS} s, at least {FLOOR_SECONDS} s")


__all__ = ["record", "read_times", "grace_seconds", "FLOOR_SECONDS", "MARGIN", "SLACK_SECONDS"]
