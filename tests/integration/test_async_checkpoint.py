"""Asynchronous checkpoints (checkpoint.async_save) on 2 gloo ranks with the tiny model, against blocking saves
and uninterrupted runs:

- an async run's checkpoints equal a blocking run's, tensor for tensor (dp = 2 fp32 ZeRO-1, pp = 2 bf16), while
  the snapshot copy is held back from here so that it is still running when the next optimizer step comes (the
  step must wait for it) and the writes are slowed so that each save waits for the one before (said once); every
  manifest's sha256 is the sha256 of the file's bytes;
- the same through a bounded host pool (checkpoint.async_host_buffer_mb): the files equal the unbounded async
  run's byte for byte;
- a job SIGKILLed while a save is in flight resumes from the previous complete checkpoint, bitwise as the killed
  run went on from there, and the partial folder is removed at the next start;
- a SIGTERM while a save is in flight: the final save waits for it, both are complete, exit 0.

Faults are injected from here (monkeypatching inside the ranks) or by gptpar/testing/faults.py, never through
hooks in the library. Corrupted files (checksums) are in tests/integration/test_reliability.py.
"""
import hashlib
import json
import os
import signal
import time

import pytest
import torch

from gptpar.testing import run_distributed
from gptpar.checkpoint.checkpointer import read_latest
from gptpar.training.reporting import parse_log_line
from gptpar.testing.runs import finish_ranks, launch_ranks, log_lines, read_jsonl, run_mains, write_config

from gptpar.testing import FAULTS  # pretrain_gpt.py with a fault injected
from gptpar.testing.deadline import Deadline
MANIFEST = "gptpar_manifest.json"
CASES = {"dp_fp32_zero1": dict(parallel=dict(data_parallel_size=2), training=dict(precision="fp32", zero_stage=1)),
         "pp_bf16": dict(parallel=dict(pipeline_model_parallel_size=2, data_parallel_size=1),
                         training=dict(precision="bf16"))}


BOUNDED_CASE = "dp_fp32_zero1"  # also saved async through a 1 MiB host pool (checkpoint.async_host_buffer_mb)


def blocking_and_async_runs(d):
    """On each rank: every case saved blocking and async (6 iterations, a save every 2), the async snapshot copy
    held back 0.5 s and each async file's write 0.2 s; BOUNDED_CASE also async through a bounded pool."""
    from gptpar.checkpoint import writer as checkpoint_writer

    real_copy, real_write = checkpoint_writer._Snapshot.copy, checkpoint_writer.write_file

    def late_copy(self):
        time.sleep(0.5)  # the next iteration's forward and backward are done long before: its step must wait
        real_copy(self)

    def slow_write(state, path, *args, **kwargs):
        if "_async" in path:
            time.sleep(0.2)
        return real_write(state, path, *args, **kwargs)

    checkpoint_writer._Snapshot.copy, checkpoint_writer.write_file = late_copy, slow_write
    runs = []
    for name, sections in CASES.items():
        for mode in ("blocking", "async") + (("bounded",) if name == BOUNDED_CASE else ()):
            bound = dict(async_host_buffer_mb=1) if mode == "bounded" else {}
            cfg = write_config(d / f"{name}_{mode}.json", **sections,
                               checkpoint=dict(save=str(d / f"{name}_{mode}"), save_interval=2,
                                               async_save=mode != "blocking", **bound),
                               logging=dict(log_interval=1, metrics_file=str(d / f"{name}_{mode}.jsonl")))
            runs.append((f"{name}_{mode}", ["--config", cfg]))
    return run_mains(runs)


@pytest.fixture(scope="module")
def equal_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("async")
    return d, run_distributed(blocking_and_async_runs, 2, (d,), timeout=600)


def _same(a, b, where):
    """Assert two loaded checkpoint objects are equal: tensors in dtype, shape, values and requires_grad;
    containers item by item; other objects by their attributes."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            if key != "config":  # gptpar's rank files hold the run's config: its save folder and async_save differ
                _same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), where
        _same(vars(a), vars(b), where)
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("name", list(CASES))
def test_async_checkpoints_equal_blocking_ones(equal_runs, name):
    d, out = equal_runs
    for rank_out in out:
        for mode in ("blocking", "async"):
            rc, text = rank_out[f"{name}_{mode}"]
            assert rc == 0, text
    text = "".join(rank_out[f"{name}_async"][1] for rank_out in out)  # rank 0's and the last stage's lines
    assert text.count("(training stopped ") == 3 and text.count("(written while training went on)") == 3, text
    assert text.count("to finish writing before saving the next one") == 1, text  # waited twice, said once
    assert text.count("to finish writing before exiting") == 1, text
    for mode in ("blocking", "async"):
        assert read_latest(str(d / f"{name}_{mode}")) == "iter_0000006"
    for tag in ("iter_0000002", "iter_0000004", "iter_0000006"):
        blocking, in_background = d / f"{name}_blocking" / tag, d / f"{name}_async" / tag
        files = sorted(os.listdir(blocking))
        assert files == sorted(os.listdir(in_background)) and MANIFEST in files
        for folder in (blocking, in_background):
            with open(folder / MANIFEST) as f:
                manifest = json.load(f)["files"]
            assert sorted(manifest) == [f for f in files if f != MANIFEST]
            for rel, record in manifest.items():
                data = (folder / rel).read_bytes()
                assert record["size"] == len(data) and record["sha256"] == hashlib.sha256(data).hexdigest(), rel
        for rel in files:
            if rel.endswith(".pt"):
                _same(torch.load(blocking / rel, weights_only=False),
                      torch.load(in_background / rel, weights_only=False), f"{tag}/{rel}")
    losses = {mode: [r["lm_loss"] for r in read_jsonl(d / f"{name}_{mode}.jsonl")] for mode in ("blocking", "async")}
    assert len(losses["async"]) == 6 and losses["async"] == losses["blocking"]


def test_a_bounded_async_save_writes_the_unbounded_ones_bytes(equal_runs):
    d, out = equal_runs
    for rank_out in out:
        rc, text = rank_out[f"{BOUNDED_CASE}_bounded"]
        assert rc == 0, text
    text = "".join(rank_out[f"{BOUNDED_CASE}_bounded"][1] for rank_out in out)
    assert "at most 1 MiB of host memory on this rank hold a snapshot at once" in text, text
    for tag in ("iter_0000002", "iter_0000004", "iter_0000006"):
        unbounded, bounded = d / f"{BOUNDED_CASE}_async" / tag, d / f"{BOUNDED_CASE}_bounded" / tag
        files = sorted(os.listdir(unbounded))
        assert files == sorted(os.listdir(bounded))
        for rel in files:
            if rel.endswith(".pt") and not rel.startswith("gptpar_rank_"):  # DeepSpeed's: no run-specific paths
                assert (unbounded / rel).read_bytes() == (bounded / rel).read_bytes(), f"{tag}/{rel}"
            elif rel.endswith(".pt"):
                _same(torch.load(unbounded / rel, weights_only=False), torch.load(bounded / rel, weights_only=False),
                      f"{tag}/{rel}")
    losses = {mode: [r["lm_loss"] for r in read_jsonl(d / f"{BOUNDED_CASE}_{mode}.jsonl")]
              for mode in ("async", "bounded")}
    assert len(losses["bounded"]) == 6 and losses["bounded"] == losses["async"]


def _read_until(proc, prefix, seen, timeout=180):
    """Lines of `proc`'s output up to the first that starts with `prefix`."""
    deadline = Deadline(timeout)
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return
        assert not deadline.expired(), "".join(seen)
    raise AssertionError(f"{prefix!r} never came:\n" + "".join(seen))


def test_a_job_killed_mid_save_resumes_from_the_previous_checkpoint(tmp_path):
    """A save every 5 iterations; iteration 10's files never finish (the writer sleeps mid-file) while training
    goes on; the whole job is SIGKILLed at iteration 14. The next start removes the partial iter_0000010 and
    resumes from iter_0000005: iterations 6-13 equal the killed run's bitwise."""
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", training=dict(train_iters=40),
                       checkpoint=dict(save=ck, load=ck, save_interval=5, async_save=True),
                       logging=dict(log_interval=1, metrics_file=str(tmp_path / "killed.jsonl")))
    procs = launch_ranks(2, ["--config", cfg], FAULTS, own_group=True, GPTPAR_TEST_SLOW_SAVE="10:600")
    seen = []
    try:
        _read_until(procs[0], " iteration       14/", seen)  # iteration 13's metrics record is written
        (staged,) = [name for name in os.listdir(ck) if name.startswith("iter_0000010.tmp-")]
        in_flight = sorted(os.listdir(os.path.join(ck, staged)))
        latest = read_latest(ck)
    finally:
        os.killpg(procs[0].pid, signal.SIGKILL)
        finish_ranks(procs)
    assert latest == "iter_0000005", "".join(seen)
    assert in_flight and MANIFEST not in in_flight  # a save in flight: files begun, no manifest
    assert not os.path.exists(os.path.join(ck, "iter_0000010"))  # its temporary folder only
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2

    codes, outs = finish_ranks(launch_ranks(2, ["--config", cfg, "--set", "training.exit_interval=13", "--set",
                                                f"logging.metrics_file={tmp_path / 'resumed.jsonl'}"]))
    assert codes == [0, 0], outs[0] + outs[1]
    assert f"removing partial checkpoint {os.path.join(ck, staged)}" in outs[0]
    assert f"resumed from {os.path.join(ck, 'iter_0000005')}: iteration 5" in outs[0]
    killed = {r["iteration"]: r for r in read_jsonl(tmp_path / "killed.jsonl")}
    resumed = read_jsonl(tmp_path / "resumed.jsonl")
    assert [r["iteration"] for r in resumed] == list(range(6, 14))
    for r in resumed:
        for key in ("lm_loss", "grad_norm", "lr", "consumed_samples"):
            assert r[key] == killed[r["iteration"]][key], (r["iteration"], key)
    assert read_latest(ck) == "iter_0000013"


@pytest.mark.slow  # too slow for make test's budget: in make test-slow
def test_a_signal_during_an_in_flight_save_exits_after_both_are_written(tmp_path):
    """SIGTERM while iteration 4's save is being written (2 s per file): the run stops after the current
    iteration, its final save waits for iteration 4's, then for itself; both complete, `latest` on the final."""
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", training=dict(train_iters=100000),
                       checkpoint=dict(save=ck, load=ck, save_interval=4, async_save=True))
    procs = launch_ranks(2, ["--config", cfg], FAULTS, GPTPAR_TEST_SLOW_SAVE="4:2")
    seen = []
    _read_until(procs[0], "saving checkpoint ", seen)
    procs[1].send_signal(signal.SIGTERM)
    codes, outs = finish_ranks(procs)
    out = "".join(seen) + outs[0]
    assert codes == [0, 0], out + outs[1]
    stopped = parse_log_line(log_lines(out)[-1])["iteration"]
    final = f"iter_{stopped:07d}"
    assert stopped > 4 and read_latest(ck) == final, out
    assert "waiting for checkpoint " + os.path.join(ck, "iter_0000004") + " to finish writing before saving" in out
    for tag in ("iter_0000004", final):
        assert os.path.isfile(os.path.join(ck, tag, MANIFEST)), out
    # both whole: the next start verifies every checksum (each rank its own files) and resumes
    codes, outs = finish_ranks(launch_ranks(2, ["--config", cfg, "--set", f"training.train_iters={stopped + 1}"]))
    assert codes == [0, 0], outs[0] + outs[1]
    resumed = next(line for line in outs[0].splitlines() if line.startswith(f"resumed from {os.path.join(ck, final)}:"))
    assert resumed.endswith("; every file matched its checksum"), resumed
