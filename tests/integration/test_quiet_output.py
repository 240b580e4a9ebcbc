"""The quiet default and the verbose switch: the resolved config written to the run's folder (printed only with
--verbose), DeepSpeed's known-harmless lines held back, the file checked against the config reader."""
import io
import json
import os
import re
import subprocess
import sys
import types
import warnings

import pytest

from gptpar.checkpoint.layout import resolve_load
from gptpar.config import load_config
from gptpar.quiet import KNOWN_LINES, held_back_lines, hold_back_warnings
from gptpar.checkpoint.layout import RESOLVED_CONFIG
from gptpar.training.assembly import resolved_config_path, write_resolved_config
from gptpar.testing.runs import ROOT, rank_env
from gptpar.testing.deadline import stretched

TINY = os.path.join(ROOT, "configs", "cpu_tiny.json")


def tiny(*overrides):
    return load_config(TINY, list(overrides))


def test_the_resolved_config_goes_into_the_runs_folder(tmp_path):
    """Beside the metrics file, else in the TensorBoard folder's parent, else in checkpoint.save; nowhere when the
    run names none of them (one line says so)."""
    m, tb, ck = str(tmp_path / "m" / "metrics.jsonl"), str(tmp_path / "r" / "tb"), str(tmp_path / "ck")
    cases = [((f"logging.metrics_file={m}", f"logging.tensorboard_dir={tb}", f"checkpoint.save={ck}"),
              tmp_path / "m" / RESOLVED_CONFIG),
             ((f"logging.tensorboard_dir={tb}/", f"checkpoint.save={ck}"), tmp_path / "r" / RESOLVED_CONFIG),
             ((f"checkpoint.save={ck}",), tmp_path / "ck" / RESOLVED_CONFIG)]
    for overrides, expected in cases:
        assert resolved_config_path(tiny(*overrides)) == str(expected)
    assert resolved_config_path(tiny()) is None
    pstate = types.SimpleNamespace(dp_size=1)
    assert write_resolved_config(tiny(), pstate) == ("resolved config: not written (no logging.metrics_file, "
                                                     "logging.tensorboard_dir or checkpoint.save to put it beside); "
                                                     "--verbose prints it")


def test_the_written_config_reads_back_as_the_runs_config(tmp_path):
    """The file is a config: the trainer's reader loads it back to the run's config, with the data-parallel size
    the world gave (null in cpu_tiny.json's parallel section would mean "what the world leaves")."""
    cfg = tiny(f"checkpoint.save={tmp_path / 'ck'}", "parallel.data_parallel_size=null")
    line = write_resolved_config(cfg, types.SimpleNamespace(dp_size=1))
    path = tmp_path / "ck" / RESOLVED_CONFIG
    assert line == f"resolved config: {path} (--verbose prints it)"
    again = load_config(str(path))
    expected = cfg.to_dict()
    expected["parallel"]["data_parallel_size"] = 1
    assert again.to_dict() == expected
    assert os.listdir(tmp_path / "ck") == [RESOLVED_CONFIG]  # no temporary file left
    # a save folder holding only it holds no checkpoint: the run starts fresh, it is not a foreign file
    target, note = resolve_load(str(tmp_path / "ck"))
    assert target is None and "starting from scratch" in note


def test_known_lines_are_held_back_and_the_rest_passes_whole():
    out = io.StringIO()
    sys_stdout = sys.stdout
    sys.stdout = out
    try:
        with held_back_lines():
            print("before")
            print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
            sys.stdout.write("a line written ")
            sys.stdout.write("in two parts\nDeepSpeed x built successfully\nand a tail without newline")
    finally:
        sys.stdout = sys_stdout
    assert out.getvalue() == "before\na line written in two parts\nand a tail without newline"
    assert any(p.fullmatch("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
               for p in KNOWN_LINES)


def test_known_warnings_are_filtered():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hold_back_warnings()
        warnings.warn_explicit("deprecated", FutureWarning, "c10d_logger.py", 83,
                               module="torch.distributed.c10d_logger")
        warnings.warn_explicit("deprecated", FutureWarning, "x.py", 1, module="deepspeed.runtime.zero.stage_1_and_2")
        warnings.warn_explicit("yours", FutureWarning, "y.py", 1, module="gptpar.model.gpt")
    assert [str(w.message) for w in caught] == ["yours"]


def _run(*extra):
    out = subprocess.run([sys.executable, "pretrain_gpt.py", "--config", TINY, "--set", "training.train_iters=3",
                          "--set", "training.eval_interval=null", *extra], cwd=ROOT, env=rank_env(),
                         capture_output=True, text=True, timeout=stretched(300))
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


@pytest.mark.slow  # the same checks run in tests/integration/test_trainer.py's ranks; this is the command a user types
def test_a_run_is_quiet_by_default(tmp_path):
    """One rank of pretrain_gpt.py as a user starts it: the config's path instead of the config, no DeepSpeed
    op-load line, no warnings; the log line with its tokens per second and time left."""
    quiet = _run("--set", f"logging.metrics_file={tmp_path / 'run' / 'metrics.jsonl'}")
    path = tmp_path / "run" / RESOLVED_CONFIG
    assert f"resolved config: {path} (--verbose prints it)" in quiet
    assert '"model": {' not in quiet and "built successfully" not in quiet and "Warning" not in quiet
    assert json.loads(path.read_text())["training"]["train_iters"] == 3
    lines = [line for line in quiet.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 3 and all(re.search(r"\| tokens per second: \d+ \|", line) for line in lines)
    assert lines[-1].endswith("| time left: 0:00:00 |")


@pytest.mark.slow
def test_verbose_prints_the_resolved_config(tmp_path):
    verbose = _run("--set", f"logging.metrics_file={tmp_path / 'run' / 'metrics.jsonl'}", "--verbose")
    path = tmp_path / "run" / RESOLVED_CONFIG
    assert 'resolved config:\n{\n  "model": {' in verbose and f"resolved config: {path}\n" in verbose


def test_the_demo_launches_quietly_unless_verbose():
    """tools/demo.py: DeepSpeed's launcher at --log_level warning (its INFO lines held back); --verbose gives the
    launcher's default and passes --verbose on to pretrain_gpt.py."""
    from gptpar.tools import demo

    quiet, verbose = demo.launch_command("deepspeed", ["--resume-x"]), demo.launch_command("deepspeed", [], True)
    assert quiet[quiet.index("--log_level") + 1] == "warning" and "--verbose" not in quiet
    assert quiet.index("--log_level") < quiet.index("pretrain_gpt.py") and quiet[-1] == "--resume-x"
    assert "--log_level" not in verbose and verbose[-1] == "--verbose"
    assert demo.launch_command("torchrun", [], True)[-1] == "--verbose"
