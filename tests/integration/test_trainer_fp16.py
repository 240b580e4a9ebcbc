"""fp16 dynamic loss scaling and honest skipped-iteration counting, on CPU.

DeepSpeed's CPU accelerator refuses fp16; the rank processes override its `is_fp16_supported` /
`supported_dtypes` (gptpar.training.engine.allow_fp16_on_cpu), after which fp16 works, slowly: the model is tiny.
A huge initial loss scale overflows on purpose: each overflow must skip the step, halve the scale
(hysteresis 1), leave the LR schedule where it was (Megatron) and be counted in the log line, at dp = 2 and
through the pipeline engine (pp = 2, zero_stage 0 asked: fp16 runs at ZeRO-1), and the logged scale is the one
the optimizer saved in its checkpoint.
"""
import glob
import math
import os

import pytest

from gptpar.testing import run_distributed
from gptpar.testing.runs import cosine_lr, log_lines, read_jsonl, run_mains_fp16, write_config

INITIAL_SCALE, ITERS, GBS, WARMUP = 2.0 ** 20, 8, 8, 2
INITIAL = {"every": INITIAL_SCALE, "pipe": INITIAL_SCALE}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp16")
    fp16 = dict(precision="fp16", initial_loss_scale=INITIAL_SCALE, hysteresis=1, train_iters=ITERS)
    every = write_config(d / "every.json", training=fp16, logging=dict(metrics_file=str(d / "every.jsonl")),
                         checkpoint=dict(save=str(d / "ck_every")))
    pipe = write_config(d / "pipe.json", training=dict(fp16, zero_stage=0),
                        parallel=dict(pipeline_model_parallel_size=2, data_parallel_size=1),
                        logging=dict(metrics_file=str(d / "pipe.jsonl")), checkpoint=dict(save=str(d / "ck_pipe")))
    by4 = write_config(d / "by4.json", training=fp16,
                       logging=dict(log_interval=4, metrics_file=str(d / "by4.jsonl")))
    bf16 = write_config(d / "bf16.json", training=dict(precision="bf16", train_iters=3),
                        logging=dict(metrics_file=str(d / "bf16.jsonl")))
    plan = [("every", ["--config", every]), ("pipe", ["--config", pipe]), ("by4", ["--config", by4]),
            ("bf16", ["--config", bf16])]
    out = run_distributed(run_mains_fp16, 2, (plan,), timeout=300)
    return d, out


@pytest.mark.parametrize("name", ["every", "pipe"])
def test_overflow_skips_halve_the_scale_and_hold_the_lr(runs, name):
    d, out = runs
    records = read_jsonl(d / f"{name}.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    scale, applied = INITIAL[name], 0
    for r in records:
        # LR of this iteration: the schedule at the steps applied before it (iteration-based: x gbs).
        assert r["lr"] == pytest.approx(cosine_lr(applied * GBS, WARMUP * GBS, ITERS * GBS, 1e-3, 1e-4), rel=1e-12)
        assert r["skipped_iterations"] in (0, 1) and r["nan_iterations"] == 0
        if r["skipped_iterations"]:
            scale /= 2
            assert r["lm_loss"] is None and r["grad_norm"] is None  # Megatron omits them for a skipped step
        else:
            applied += 1
            assert math.isfinite(r["lm_loss"]) and r["grad_norm"] > 0
        assert r["loss_scale"] == scale  # window 1000: never grows back within this run
        assert r["consumed_samples"] == r["iteration"] * GBS  # skipped or not, the batch was consumed
    skipped = ITERS - applied
    assert 2 <= skipped < ITERS, "the initial scale overflows at least twice (grads x scale > 65504) and recovers"
    printed = "".join(rank[name][1] for rank in out)  # the last stage prints the log line
    assert f"loss scale: {INITIAL[name] / 2:.1f} |" in log_lines(printed)[0]
    assert records[-1]["loss_scale"] == saved_loss_scale(d / f"ck_{name}")
    if name == "pipe":
        assert "training.zero_stage 0 -> 1 (fp16)" in printed


def saved_loss_scale(save_dir):
    """The dynamic scale DeepSpeed's fp16 optimizer wrote into the last checkpoint."""
    from gptpar.training.engine import checkpoint_loss_scale

    (last,) = sorted(glob.glob(os.path.join(save_dir, "iter_*")))[-1:]
    return checkpoint_loss_scale(last)


def test_interval_counts_skips(runs):
    d, _ = runs
    every, by4 = read_jsonl(d / "every.jsonl"), read_jsonl(d / "by4.jsonl")
    assert [r["iteration"] for r in by4] == [4, 8]
    for r in by4:
        window = every[r["iteration"] - 4:r["iteration"]]
        assert r["skipped_iterations"] == sum(w["skipped_iterations"] for w in window)
        assert r["loss_scale"] == window[-1]["loss_scale"]
        kept = [w["lm_loss"] for w in window if w["lm_loss"] is not None]
        assert r["lm_loss"] == (pytest.approx(sum(kept) / len(kept), rel=1e-12) if kept else None)


def test_bf16_line_has_loss_scale_one_and_both_counts(runs):
    """Nothing is scaled in bf16: the record's loss scale is 1.0 and the line prints it, with both iteration counts
    at 0, as the planning notes' Megatron-DeepSpeed bf16 line does (`loss scale: 1.0 | ... | number of skipped
    iterations:   0 | number of nan iterations:   0 |`)."""
    d, out = runs
    records = read_jsonl(d / "bf16.jsonl")
    assert len(records) == 3
    assert all(r["loss_scale"] == 1.0 and r["skipped_iterations"] == r["nan_iterations"] == 0 for r in records)
    lines = log_lines("".join(rank["bf16"][1] for rank in out))
    assert len(lines) == 3
    for line in lines:
        assert " | loss scale: 1.0 | " in line
        assert " | number of skipped iterations:   0 | number of nan iterations:   0 | " in line
        fields = [part.split(":")[0].strip() for part in line.split("|")[1:] if part.strip()]
        megatron = ["consumed samples", "consumed tokens", "elapsed time per iteration (s)", "learning rate",
                    "global batch size", "lm loss", "loss scale", "grad norm", "number of skipped iterations",
                    "number of nan iterations", "samples per second"]
        assert [f for f in fields if f in megatron] == megatron  # Megatron-DeepSpeed's order
