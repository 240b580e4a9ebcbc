"""Logs that cannot be written, through pretrain_gpt.py on 2 gloo ranks (one spawn runs every case): a
logging.metrics_file, logging.tensorboard_dir or logging.diagnostics_dir under a regular file, naming a folder or a
file, or in a folder that takes no new file (/proc, a read-only folder), is refused by the preflight (exit 2 on
every rank, one line naming the key, before the model is built); a metrics file that stops taking writes mid-run
ends the run with a checkpoint saved first (exit 1, one line on every rank).

Faults are injected from here (the folder swapped for a file inside the ranks), never through hooks in the library.
"""
import os
import shutil

import pytest

from gptpar.testing import run_distributed
from gptpar.checkpoint.checkpointer import read_latest
from gptpar.training.trainer import Trainer
from gptpar.testing.runs import log_lines, main_output, write_config


def run_cases(d, read_only_blocks):
    """On each rank: the cases in order; {name: (exit code, output)}."""
    import torch.distributed as dist

    out = {}

    def run(name, config, *extra, patch=None):
        dist.barrier()
        patches = [(Trainer, "train_step", patch)] if patch is not None else []
        out[name] = main_output(["--config", config] + list(extra), patches)
        dist.barrier()

    if dist.get_rank() == 0:
        (d / "a_file").write_text("not a folder")
        os.makedirs(d / "locked")
        os.chmod(d / "locked", 0o555)
    cfg = write_config(d / "two.json", training=dict(train_iters=2, lr_warmup_iters=1))
    run("metrics_under_a_file", cfg, "--set", f"logging.metrics_file={d}/a_file/m.jsonl")
    run("metrics_is_a_folder", cfg, "--set", f"logging.metrics_file={d}")
    run("tensorboard_is_a_file", cfg, "--set", f"logging.tensorboard_dir={d}/a_file")
    run("tensorboard_under_a_file", cfg, "--set", f"logging.tensorboard_dir={d}/a_file/tb")
    run("diagnostics_under_a_file", cfg, "--set", f"logging.diagnostics_dir={d}/a_file/diag")
    run("metrics_where_no_file_can_be_made", cfg, "--set", "logging.metrics_file=/proc/gptpar-metrics.jsonl")
    if read_only_blocks:
        run("metrics_read_only", cfg, "--set", f"logging.metrics_file={d}/locked/sub/m.jsonl")

    # The metrics file's folder replaced by a regular file after iteration 2 (a volume gone): iteration 3's record
    # cannot be written, so the run saves iteration 3 and stops there.
    logs = d / "logs"
    real_step = Trainer.train_step

    def logs_gone_after_two(self):
        if self.counters.iteration == 2 and self.is_log_rank:
            shutil.rmtree(logs)
            logs.write_text("the log volume is gone")
        return real_step(self)
    five = write_config(d / "five.json", training=dict(train_iters=5, lr_warmup_iters=1),
                        checkpoint=dict(save=str(d / "ck"), load=str(d / "ck")),
                        logging=dict(log_interval=1, metrics_file=str(logs / "m.jsonl")))
    run("metrics_fails_mid_run", five, patch=logs_gone_after_two)
    if dist.get_rank() == 0:
        os.chmod(d / "locked", 0o755)
    return out


def _read_only_blocks_writes(folder):
    """Whether a chmod 555 folder refuses this user a new file (root writes anyway)."""
    os.makedirs(folder)
    os.chmod(folder, 0o555)
    try:
        open(os.path.join(folder, "probe"), "w").close()
        return False
    except PermissionError:
        return True
    finally:
        os.chmod(folder, 0o755)
        shutil.rmtree(folder)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    d = tmp_path_factory.mktemp("log_faults")
    blocks = _read_only_blocks_writes(str(d / "probe_folder"))
    return d, blocks, run_distributed(run_cases, 2, (d, blocks), timeout=300)


def _expect(cases, name, rc, *messages):
    """Both ranks exit with `rc`; rank 0 says each message on one line, and there is no traceback."""
    _, _, out = cases
    (rc0, out0), (rc1, out1) = out[0][name], out[1][name]
    assert (rc0, rc1) == (rc, rc), out0 + out1
    for m in messages:
        assert m in out0, f"{m!r} not in:\n{out0}"
    assert "Traceback" not in out0 + out1, out0 + out1
    return out0


@pytest.mark.parametrize("name,message", [
    ("metrics_under_a_file", "logging error: logging.metrics_file {d}/a_file/m.jsonl cannot be created: {d}/a_file "
                             "is a file, not a folder"),
    ("metrics_is_a_folder", "logging error: logging.metrics_file {d} is a folder: point logging.metrics_file at a "
                            "file in it"),
    ("tensorboard_is_a_file", "logging error: logging.tensorboard_dir {d}/a_file is a file, not a folder"),
    ("tensorboard_under_a_file", "logging error: logging.tensorboard_dir {d}/a_file/tb cannot be created: "
                                 "{d}/a_file is a file, not a folder"),
    ("diagnostics_under_a_file", "logging error: logging.diagnostics_dir {d}/a_file/diag cannot be created: "
                                 "{d}/a_file is a file, not a folder"),
    ("metrics_where_no_file_can_be_made", "logging error: logging.metrics_file /proc/gptpar-metrics.jsonl cannot be "
                                          "written: "),
])
def test_unwritable_log_paths_exit_2_before_the_model_is_built(cases, name, message):
    d, _, _ = cases
    out = _expect(cases, name, 2, message.format(d=d))
    assert not log_lines(out) and "precision plan" not in out  # refused before the engine was built
    assert not os.path.exists(d / "a_file" / "tb") and (d / "a_file").read_text() == "not a folder"


def test_a_read_only_log_folder_exits_2_before_the_model_is_built(cases):
    d, blocks, _ = cases
    if not blocks:
        pytest.skip("this user writes into a read-only folder (root): the case cannot be made here")
    out = _expect(cases, "metrics_read_only", 2, f"logging error: logging.metrics_file {d}/locked/sub/m.jsonl cannot "
                                                 f"be written: {d}/locked is not writable for this user")
    assert not log_lines(out) and os.listdir(d / "locked") == []


def test_a_log_write_failing_mid_run_saves_then_exits_1(cases):
    d, _, out = cases
    logs = d / "logs"
    out0 = _expect(cases, "metrics_fails_mid_run", 1,
                   f"pretrain_gpt.py: log write failed: logging.metrics_file {logs}/m.jsonl could not be written "
                   f"(Not a directory) at iteration 3; saved iteration 3 to {d}/ck first: resume from it once the "
                   f"logs can be written")
    assert "the log rank could not write its logs" in out[1]["metrics_fails_mid_run"][1]  # rank 1's one line
    assert [line.split("/")[0].split()[-1] for line in log_lines(out0)] == ["1", "2", "3"]  # stopped at 3
    assert read_latest(str(d / "ck")) == "iter_0000003"
    assert sum(line.startswith("pretrain_gpt.py:") for line in out0.splitlines()) == 1
