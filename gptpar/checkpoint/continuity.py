"""Whether a checkpoint is the one its name says, and what differs between the run that saved it and this one:
checked by `gptpar.checkpoint.resume.plan_load` before anything is built.

An `iter_N` folder must hold iteration N (its rank files' counter): a folder copied or renamed by hand under another
iteration's name would resume at the wrong place without a word, so it is refused, naming both.

The run-defining keys that may differ from the saved run's config.json are said, one line each, before the
checkpoint is used; none refuses the resume, since continuing a run on a new data mix, seed or batch size is a
legitimate choice (as in Megatron-DeepSpeed, which resumes with a new global batch size and continues from the
consumed samples), but pointing `checkpoint.load` at another experiment's folder should not pass unnoticed:

    training.seed, data.data_path, data.split, data.synthetic, model.seq_length
        the sample order: sample i of the run (consumed samples + its place in the global batch) is another one
    training.global_batch_size, training.rampup_batch_size
        the consumed samples carry over; each iteration from here takes the new batch (the LR schedule, by
        iterations or samples, continues from the saved counters)

The data-parallel size is not among them: gptpar's global batch is the same samples at any dp (each rank takes its
slice of it), so another dp changes no sample, only the layout (the reshaping line says so).
"""
from __future__ import annotations

import json
from typing import List

from gptpar.checkpoint.exceptions import CheckpointError
from gptpar.checkpoint.layout import TAG_RE, LoadTarget

# (section, key, what a change means for the resumed run)
_ORDER = "the samples from here on are another sequence than the saved run's"
RUN_KEYS = (
    ("training", "seed", _ORDER),
    ("data", "data_path", _ORDER),
    ("data", "split", _ORDER),
    ("data", "synthetic", _ORDER),
    ("model", "seq_length", _ORDER + " (each sample is seq_length + 1 tokens)"),
    ("training", "global_batch_size", "its consumed samples carry over; each iteration from here takes the new "
                                      "batch size"),
    ("training", "rampup_batch_size", "its consumed samples carry over; the batch sizes from here follow the new "
                                      "ramp-up"),
)


def check_tag_iteration(target: LoadTarget, iteration: int) -> None:
    """Refuse an `iter_N` folder whose rank files hold another iteration than N."""
    match = TAG_RE.match(target.tag or "")
    if match is not None and int(match.group(1)) != iteration:
        raise CheckpointError(f"checkpoint {target.path} is named {target.tag} but holds iteration {iteration} (its "
                              f"rank files' counter): it was renamed or copied under another iteration's name; "
                              f"rename it iter_{iteration:07d}, or point checkpoint.load at the folder you meant")


def run_changes(saved: dict, current: dict) -> List[str]:
    """One line per run-defining key (RUN_KEYS) whose value in `current` (this run's config as a dict) differs
    from `saved` (the checkpoint's config.json); a key the saved config lacks is not compared."""
    lines = []
    for section, key, meaning in RUN_KEYS:
        if key not in saved.get(section, {}):
            continue
        was, now = saved[section][key], current.get(section, {}).get(key)
        if _canonical(was) != _canonical(now):
            lines.append(f"note: this run's {section}.{key} differs from the checkpoint's run: checkpoint {was!r}, "
                         f"config {now!r}: {meaning}")
    return lines


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True)


__all__ = ["RUN_KEYS", "check_tag_iteration", "run_changes"]
