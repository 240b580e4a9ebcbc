"""Launching: the multi-node scripts' argument handling (dry-run lines, and a real run with a stub launcher),
pretrain_gpt.py --dry-run for the big configs, and config errors (exit 2, one message, no process group)."""
import json
import os
import shlex
import stat
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from gptpar.testing.runs import ROOT
from gptpar.testing.deadline import stretched

HOSTFILE_SH = os.path.join(ROOT, "examples", "launch_hostfile.sh")
SLURM = os.path.join(ROOT, "examples", "slurm_200b.sbatch")
EXTRA = ["--set", "training.train_iters=10", "--set", "data.split=98, 2"]  # a value with a space survives


def _run(cmd, **env):
    full = dict(os.environ, PYTHON=sys.executable)
    full.update(env)
    for key in ("SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NTASKS_PER_NODE", "DRY_RUN"):
        if key not in env:
            full.pop(key, None)
    return subprocess.run(cmd, cwd=ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=stretched(60))


def _hostfile(tmp_path, nodes):
    path = tmp_path / "hostfile"
    path.write_text("# comment\n\n" + "".join(f"node{i:03d} slots=8\n" for i in range(nodes)))
    return str(path)


def _stub(tmp_path, name):
    """An executable that prints its argv and the rank variables as JSON (stands in for a launcher/python)."""
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps({{'argv': sys.argv[1:], 'env': "
                    "{k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'DS_ENV_FILE', "
                    "'CUDA_LAUNCH_BLOCKING', 'OMP_NUM_THREADS')}}))\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _config_world(name="200b"):
    with open(os.path.join(ROOT, "configs", f"{name}.json")) as f:
        p = json.load(f)["parallel"]
    return p["tensor_model_parallel_size"] * p["pipeline_model_parallel_size"] * p["data_parallel_size"]


# -- DeepSpeed hostfile launch ----------------------------------------------------------------------

def test_hostfile_dry_run_prints_the_launch_line(tmp_path):
    nodes = _config_world() // 8
    hostfile = _hostfile(tmp_path, nodes)
    p = _run(["bash", HOSTFILE_SH, "--dry-run", hostfile] + EXTRA)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "export CUDA_LAUNCH_BLOCKING=1" in lines and "export OMP_NUM_THREADS=1" in lines
    launch = shlex.split(lines[-1])
    assert launch == ["deepspeed", "--hostfile", hostfile, "--num_nodes", str(nodes), "--num_gpus", "8",
                      "--master_port", "6000", "pretrain_gpt.py", "--config", "configs/200b.json"] + EXTRA
    assert _run(["bash", HOSTFILE_SH, hostfile], DRY_RUN="1", CUDA_LAUNCH_BLOCKING="0").stdout.count(
        "export CUDA_LAUNCH_BLOCKING=0") == 1


def test_hostfile_launch_hands_over_arguments_and_environment(tmp_path):
    hostfile = _hostfile(tmp_path, _config_world() // 8)
    p = _run(["bash", HOSTFILE_SH, hostfile] + EXTRA, DEEPSPEED=_stub(tmp_path, "deepspeed"), TMPDIR=str(tmp_path))
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["argv"][-len(EXTRA) - 3:] == ["pretrain_gpt.py", "--config", "configs/200b.json"] + EXTRA
    with open(got["env"]["DS_ENV_FILE"]) as f:  # what DeepSpeed copies to every node
        env_file = f.read().splitlines()
    assert "CUDA_LAUNCH_BLOCKING=1" in env_file and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in env_file


@pytest.mark.parametrize("case", ["wrong_nodes", "missing_hostfile", "no_arguments"])
def test_hostfile_argument_errors(tmp_path, case):
    args = {"wrong_nodes": [_hostfile(tmp_path, 3)], "missing_hostfile": [str(tmp_path / "nope")],
            "no_arguments": []}[case]
    p = _run(["bash", HOSTFILE_SH, "--dry-run"] + args)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("launch_hostfile.sh: ") and len(p.stderr.splitlines()) == 1


# -- SLURM ------------------------------------------------------------------------------------------

def test_slurm_dry_run_and_rank_mapping(tmp_path):
    world = _config_world()
    p = _run(["bash", SLURM] + EXTRA, DRY_RUN="1")
    assert p.returncode == 0, p.stderr
    assert f"= {world} ranks" in p.stdout and "export CUDA_LAUNCH_BLOCKING=1" in p.stdout
    srun = shlex.split(p.stdout.splitlines()[-1])
    assert srun[:3] == ["srun", "--kill-on-bad-exit=1", "--wait=120"] and srun[3:5] == ["bash", "-c"]
    # What one task runs: SLURM's variables become the launcher variables, the arguments arrive intact.
    assert f"exec {shlex.quote(sys.executable)} -u pretrain_gpt.py" in srun[5]
    rank_command = srun[5].replace(shlex.quote(sys.executable), _stub(tmp_path, "python"))
    task = subprocess.run(["bash", "-c", rank_command], cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True,
                          env=dict(os.environ, SLURM_PROCID="13", SLURM_LOCALID="5", SLURM_NTASKS=str(world),
                                   SLURM_NTASKS_PER_NODE="8"))
    got = json.loads(task.stdout)
    assert got["argv"] == ["-u", "pretrain_gpt.py", "--config", "configs/200b.json"] + EXTRA
    assert (got["env"]["RANK"], got["env"]["LOCAL_RANK"], got["env"]["WORLD_SIZE"]) == ("13", "5", str(world))


@pytest.mark.parametrize("env", [{"SLURM_NNODES": "3", "DRY_RUN": "1"}, {}])
def test_slurm_errors(env):
    p = _run(["bash", SLURM], **env)  # wrong node count; outside a job without DRY_RUN
    assert p.returncode == 2 and p.stderr.startswith("slurm_200b.sbatch: ")


# -- pretrain_gpt.py --dry-run and config errors --------------------------------------------------

@pytest.mark.parametrize("name", ["200b", "104b"])
def test_dry_run_big_configs(name, capsys):
    from gptpar.training.pretrain import main as pretrain_main

    assert pretrain_main(["--config", f"configs/{name}.json", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not dist.is_initialized()
    for part in ("== plan ==", "== resolved config ==", "== pipeline partition", "== memory per GPU",
                 "== TFLOPs per GPU", "real model on the meta device", "matches the formula",
                 "real model's stages on the meta device: each matches its row of the table"):
        assert part in out, part
    assert out.startswith("== plan ==\nGPUs: ")  # the answer first
    assert out.count("== pipeline partition") == 1 and "stages of the real model" not in out  # one table


CONFIG_ERRORS = [
    (["--set", "training.micro_batch=4"], {}, "did you mean 'micro_batch_size'"),
    (["--set", "trainig.lr=1"], {}, "unknown config section"),
    (["--bogus-flag"], {}, "unknown option --bogus-flag"),
    (["--set", "training.micro_batch_size=abc"], {}, "training.micro_batch_size must be int"),
    ([], {"WORLD_SIZE": "3"}, "world size 3"),
    (["--set", "training.global_batch_size=6"], {}, "must divide by training.micro_batch_size"),
    (["--set", "training.train_iters=null", "--set", "training.train_samples=100",
      "--set", "training.lr_warmup_iters=0", "--set", "training.rampup_batch_size=[4,2,50]"], {},
     "rampup_batch_size increment (2)"),
    (["--set", "training.train_samples=100"], {}, "exactly one of training.train_iters"),
    (["--set", "data.synthetic=false"], {}, "data.data_path is not set"),
    (["--set", "parallel.tensor_model_parallel_size=3", "--set", "parallel.data_parallel_size=1"],
     {"WORLD_SIZE": "3"}, "num_attention_heads (4) must divide"),
    (["--set", "parallel.pipeline_model_parallel_size=4", "--set", "parallel.data_parallel_size=1"],
     {"WORLD_SIZE": "4"}, "pipeline_model_parallel_size (4) exceeds model.num_layers"),
    (["--set", "training.lr_warmup_iters=50"], {}, "warmup"),
    (["--set", "training.min_lr=1"], {}, "min_lr"),
    (["--set", "checkpoint.save_interval=5"], {}, "checkpoint.save is null"),
    (["--set", "model.hidden_size=66"], {}, "hidden_size (66) must divide by model.num_attention_heads"),
    (["--config", "configs/does_not_exist.json"], {}, "not found"),
    (["--set", 'data.valid_data_path={"en": "a", "en": "b"}'], {}, "the key 'en' appears twice in one JSON object"),
]


def test_a_name_given_twice_in_a_config_file_exits_2(tmp_path, monkeypatch, capsys):
    """Two validation sets under one name in data.valid_data_path's dict form: a JSON reader would keep the
    second alone without a word; the config is refused naming the key."""
    from gptpar.training.pretrain import main as pretrain_main

    with open(os.path.join(ROOT, "configs", "cpu_dp2.json")) as f:
        text = f.read()
    data = ('"data_path": "data/corpus", "valid_data_path": {"en": "data/en_valid", "fr": "data/fr_valid", '
            '"en": "data/en_other"}')
    path = tmp_path / "twice.json"
    path.write_text(text.replace('"synthetic": true', data))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert pretrain_main(["--config", str(path), "--dry-run"]) == 2  # else the plan, with one 'en' set
    err = capsys.readouterr().err
    assert err.startswith(f"pretrain_gpt.py: config error: config file {path}: the key 'en' appears twice in one "
                          "JSON object (keys 'en', 'fr', 'en')"), err
    assert not dist.is_initialized()


def _cpu_accelerator_fp16(monkeypatch, supported: bool):
    """Decide DeepSpeed's CPU accelerator's answer instead of the CPU's (oneDNN reports fp16 on AVX512-FP16/AMX)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: supported)


def test_fp16_without_accelerator_support_exits_2(monkeypatch, capsys):
    from gptpar.training.pretrain import main as pretrain_main

    _cpu_accelerator_fp16(monkeypatch, False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert pretrain_main(["--config", "configs/cpu_dp2.json", "--set", "training.precision=fp16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pretrain_gpt.py: config error: training.precision fp16 is not supported here: "
                          "DeepSpeed's cpu accelerator (reports no fp16 support"), err
    assert "training.precision=bf16" in err and not dist.is_initialized()


def test_fp16_with_accelerator_support_passes_the_config_check(monkeypatch):
    from gptpar.training.cli import parse

    _cpu_accelerator_fp16(monkeypatch, True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg, _, sizes = parse(["--config", "configs/cpu_dp2.json", "--set", "training.precision=fp16"])
    assert cfg.training.precision == "fp16" and sizes == (1, 1, 2) and not dist.is_initialized()


@pytest.mark.parametrize("argv,env,message", CONFIG_ERRORS, ids=[m for _, _, m in CONFIG_ERRORS])
def test_config_errors_exit_2_with_one_message(argv, env, message, monkeypatch, capsys):
    from gptpar.training.pretrain import main as pretrain_main

    monkeypatch.setenv("WORLD_SIZE", env.get("WORLD_SIZE", "2"))
    config = [] if "--config" in argv else ["--config", "configs/cpu_dp2.json"]
    assert pretrain_main(config + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pretrain_gpt.py: config error: ") and message in err, err
    assert not dist.is_initialized()
