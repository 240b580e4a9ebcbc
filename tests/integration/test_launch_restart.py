"""`python -m gptpar.launch`: an in-job restart after a rank is killed resumes from `latest` with the losses of an
uninterrupted run; a refusal (exit 2) ends the job in its one line without burning the restarts; a master port in
use is named before any rank starts (and by rank 0 itself under a launcher that leaves the store to it)."""
import socket
import subprocess
import sys

import pytest

from gptpar.training.reporting import is_training_record, read_metrics
from gptpar.testing.runs import ROOT, rank_env, write_config

LAUNCH = [sys.executable, "-m", "gptpar.launch", "--nproc_per_node", "2"]
from gptpar.testing import FAULTS  # pretrain_gpt.py with a fault injected
from gptpar.testing.deadline import stretched


def _launch(argv, timeout=240, **env):
    return subprocess.run(LAUNCH + argv, cwd=ROOT, env=rank_env(**env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=stretched(timeout))


def _losses(metrics_file):
    """{iteration: (lm loss, grad norm, lr)} of the last record of each iteration (a restart logs some twice)."""
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"], r["lr"]) for r in read_metrics(metrics_file)
            if is_training_record(r)}


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_resumes_from_latest(tmp_path):
    """Rank 1 SIGKILLed right after iteration 5 (save every 3, load = save): rank 0 ends in one line, the launcher
    restarts both, they resume from iter_0000003 and iterations 7-12 equal an uninterrupted run's bitwise."""
    runs = {}
    for name, faults in (("uninterrupted", {}), ("killed", {"GPTPAR_TEST_KILL_AT": "1:5"})):
        ck, metrics = str(tmp_path / name / "ck"), str(tmp_path / name / "metrics.jsonl")
        cfg = write_config(tmp_path / f"{name}.json", training=dict(train_iters=12),
                           checkpoint=dict(save=ck, load=ck, save_interval=3), logging=dict(metrics_file=metrics))
        p = _launch(["--max-restarts", "1", FAULTS, "--config", cfg], **faults)
        runs[name] = (p, _losses(metrics))
    p, killed = runs["killed"]
    assert p.returncode == 0, p.stdout
    assert "Traceback" not in p.stdout and "ChildFailedError" not in p.stdout, p.stdout
    assert "pretrain_gpt.py: rank 0: another rank's process is gone" in p.stdout, p.stdout
    assert "gptpar.launch: rank 1 (pid" in p.stdout and "(killed by SIGKILL): restarting every rank" in p.stdout
    assert "resumed from " + str(tmp_path / "killed" / "ck" / "iter_0000003") in p.stdout, p.stdout
    reference = runs["uninterrupted"][1]
    assert runs["uninterrupted"][0].returncode == 0, runs["uninterrupted"][0].stdout
    assert sorted(killed) == list(range(1, 13)) == sorted(reference)
    for iteration in range(7, 13):
        assert killed[iteration] == reference[iteration], iteration


def test_a_refusal_ends_the_job_in_one_line_without_restarts():
    p = _launch(["--max-restarts", "3", "pretrain_gpt.py", "--config", "configs/cpu_tp2.json",
                 "--set", "parallel.tensor_model_parallel_size=4"], timeout=120)
    assert p.returncode == 2, p.stdout
    refusals = [line for line in p.stdout.splitlines() if line.startswith("pretrain_gpt.py: ")]
    assert len(refusals) == 1 and "config error: world size 2 != tp (4)" in refusals[0], p.stdout
    assert "Traceback" not in p.stdout and "ChildFailedError" not in p.stdout and "restarting" not in p.stdout


def test_a_master_port_in_use_is_named(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # gptpar.launch hosts the store: it says so before starting any rank
        p = _launch(["--master-port", str(port), "pretrain_gpt.py", "--config", "configs/cpu_dp2.json"], timeout=60)
        assert p.returncode == 2 and p.stdout.startswith(f"gptpar.launch: port {port} on 127.0.0.1"), p.stdout
        assert "--master-port" in p.stdout and "Traceback" not in p.stdout
        # under DeepSpeed's launcher rank 0 hosts it: its init_parallel names it (rank 0 alone is enough to see it)
        env = rank_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        rank0 = subprocess.run([sys.executable, "pretrain_gpt.py", "--config", write_config(tmp_path / "c.json")],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=stretched(120))
    assert rank0.returncode == 2, rank0.stdout
    assert f"pretrain_gpt.py: launch error: the master port {port} (MASTER_PORT) on 127.0.0.1 is already in use" \
        in rank0.stdout and "Traceback" not in rank0.stdout, rank0.stdout
