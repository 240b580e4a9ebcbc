"""bench/gpu_summary.py, the figures a GPU call is read by, on files written here: the trainer's peak memory is the
run's (the largest of its records' memory fields), never the report after iteration 1; and the tree that ran is
recorded as git would commit it, with the commit its .git names and the paths that differ from it."""
import json
import os
import subprocess
import sys

from gptpar.training.reporting import METRIC_KEYS, MetricsWriter, format_memory_line
from gptpar.testing.runs import ROOT
from gptpar.testing.deadline import stretched

GiB = 2 ** 30


def _summary(*args):
    run = subprocess.run([sys.executable, "bench/gpu_summary.py", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=stretched(120), env=dict(os.environ, PYTHONPATH=ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _trainer_run(out, name, peaks, reserved):
    """A metrics file of len(peaks) records whose memory fields are `peaks` / `reserved` (None: a file written
    before records had them), and a log whose only memory line is Megatron's report after iteration 1."""
    writer = MetricsWriter(str(out / f"{name}.jsonl"))
    for it, (peak, held) in enumerate(zip(peaks, reserved), 1):
        record = dict.fromkeys(METRIC_KEYS)
        record.update(iteration=it, train_iters=len(peaks), consumed_samples=32 * it, consumed_tokens=32 * 2048 * it,
                      elapsed_s=1.0 + 0.01 * it, lr=1e-4, global_batch_size=32, lm_loss=11.0 - it, loss_scale=1.0,
                      skipped_iterations=0, nan_iterations=0, samples_per_second=32.0, tflops=500.0,
                      max_allocated_bytes=peak, max_reserved_bytes=held)
        writer.write(record)
    report = {"allocated": 20.0 * GiB, "max allocated": 24.0 * GiB, "reserved": 30.0 * GiB, "max reserved": 30.0 * GiB}
    (out / f"{name}.log").write_text(format_memory_line(0, 1, report) + "\n")


def test_peak_memory_is_the_whole_runs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    peaks = [24.0 * GiB, 33.5 * GiB, 33.5 * GiB, 34.25 * GiB, 34.25 * GiB]  # the peak so far at each log line
    reserved = [30.0 * GiB, 36.0 * GiB, 36.0 * GiB, 37.0 * GiB, 37.0 * GiB]
    _trainer_run(out, "trainer_compiled", peaks, reserved)
    _trainer_run(out, "trainer_fp8", [None] * 5, [None] * 5)  # written before the records had memory fields
    text = _summary("--out", str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer_compiled"]["peak_memory_gib"] == max(peaks) / GiB
    assert summary["trainer_compiled"]["peak_reserved_gib"] == max(reserved) / GiB
    assert "peak 34.2 GiB allocated (37.0 reserved) over the run" in text
    assert summary["trainer_fp8"]["peak_memory_gib"] is None  # not the 24 GiB of the report after iteration 1
    assert "trainer_fp8: " in text and "peak memory not recorded" in text.split("trainer_fp8: ")[1].splitlines()[0]
    assert text.splitlines()[0] == "tree: not recorded (no tree.json)"


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_the_tree_that_ran_is_recorded_with_its_commit_and_changes(tmp_path):
    """A copy whose files moved past its .git's HEAD (what a device call carried) reads as that commit with
    changes; the recorded tree is the one a commit of those files has, found afterwards by `git rev-parse`."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    out.mkdir()
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("ignored/\n")
    (repo / "a.py").write_text("a = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    first = _git(repo, "rev-parse", "HEAD")
    clean = _summary("--tree", "--root", str(repo))
    assert clean.strip() == f"tree {_git(repo, 'rev-parse', 'HEAD^{tree}')[:12]} = commit {first[:12]}"
    (repo / "a.py").write_text("a = 2\n")
    (repo / "b.py").write_text("b = 1\n")
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_text("not part of the tree")
    objects = sorted(os.listdir(repo / ".git" / "objects"))
    line = _summary("--tree", "--root", str(repo), "--out", str(out)).strip()
    assert sorted(os.listdir(repo / ".git" / "objects")) == objects  # nothing written into the repository
    state = json.loads((out / "tree.json").read_text())
    assert state["commit"] == first and sorted(state["changed"]) == ["a.py", "b.py"]
    assert line.startswith(f"tree {state['tree'][:12]} = commit {first[:12]} with changes to 2 path(s): ")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "two")
    assert state["tree"] == _git(repo, "rev-parse", "HEAD^{tree}")  # the tree that ran is the second commit's
    assert _summary("--out", str(out)).splitlines()[0] == line  # the summary's first line says it
