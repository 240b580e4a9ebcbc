"""`training.optimizer=adamw8bit` (bitsandbytes' AdamW8bit) through the trainer on 2 gloo ranks: checkpoints hold
its quantised state and a resumed run equals an uninterrupted one, at ZeRO-1 (fp32 and bf16's BF16_Optimizer) and
through the pipeline; a missing package is a config error naming the fix. Bytes per parameter against the memory
estimate: tests/integration/test_precision.py; the 104B tune-up notes' rows: tests/unit/test_memory.py; the demo's loss
and state ratios:
bench/bench_optimizer8bit.py.
"""
import glob
import os

import pytest
import torch

from gptpar.testing import run_distributed
from gptpar.config import ConfigError, config_from_dict
from gptpar.testing.runs import read_jsonl, run_mains, write_config

bnb = pytest.importorskip("bitsandbytes", reason="training.optimizer=adamw8bit needs bitsandbytes")

# hidden 64: the weight matrices (>= 4096 elements) get 8-bit moments even without ZeRO
MODEL = dict(hidden_size=64, hidden_dropout=0.1, attention_dropout=0.1)  # dropout: the RNG streams resume too
CASES = {"zero1": ({}, {}), "bf16": ({}, dict(precision="bf16")),
         "pp2": (dict(pipeline_model_parallel_size=2, data_parallel_size=1), dict(zero_stage=0))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per case: 6 iterations straight, and 3 (exit_interval, saving) + resume + 3."""
    d = tmp_path_factory.mktemp("adamw8bit")
    plan = []
    for name, (parallel, training) in CASES.items():
        training = dict(training, optimizer="adamw8bit")
        full = write_config(d / f"{name}_full.json", model=MODEL, parallel=parallel, training=training,
                            logging=dict(metrics_file=str(d / f"{name}_full.jsonl")))
        split = write_config(d / f"{name}_split.json", model=MODEL, parallel=parallel, training=training,
                             checkpoint=dict(save=str(d / f"{name}_ck"), load=str(d / f"{name}_ck")),
                             logging=dict(metrics_file=str(d / f"{name}_split.jsonl")))
        plan += [(f"{name}_full", ["--config", full]),
                 (f"{name}_a", ["--config", split, "--set", "training.exit_interval=3"]),
                 (f"{name}_b", ["--config", split])]
    # Last: the 8-bit checkpoint resumed with AdamW (whose state it does not hold), or at another (tp, pp, dp)
    # (the universal form carries AdamW's moments only), must be refused up front.
    split = ["--config", str(d / "zero1_split.json")]
    plan += [("other_optimizer", split + ["--set", "training.optimizer=adamw"]),
             ("other_shape", split + ["--set", "parallel.tensor_model_parallel_size=2",
                                      "--set", "parallel.data_parallel_size=1"])]
    return d, run_distributed(run_mains, 2, (plan,), timeout=400)


@pytest.mark.parametrize("name", CASES)
def test_resume_equals_uninterrupted(runs, name):
    d, out = runs
    assert all(out[rank][run][0] == 0 for rank in (0, 1) for run in (f"{name}_full", f"{name}_a", f"{name}_b")), \
        [out[0][run] for run in (f"{name}_full", f"{name}_a", f"{name}_b")]
    log = out[0][f"{name}_full"][1]
    assert "optimizer=bitsandbytes AdamW8bit" in log and ("around AdamW8bit" in log or "optimizer AdamW8bit" in log)
    full, split = read_jsonl(d / f"{name}_full.jsonl"), read_jsonl(d / f"{name}_split.jsonl")
    assert [r["iteration"] for r in split] == [1, 2, 3, 4, 5, 6]
    assert f"resumed from {d / f'{name}_ck' / 'iter_0000003'}" in out[0][f"{name}_b"][1]
    for key in ("lm_loss", "grad_norm", "lr"):
        assert [r[key] for r in split] == [r[key] for r in full], key


def test_checkpoint_holds_the_quantised_moments(runs):
    """The ZeRO-1 optimizer shards hold bitsandbytes' uint8 moments and their block scales, not fp32 moments
    (except for a partition under bitsandbytes' 4096-element threshold: here the no-decay group's)."""
    d, _ = runs
    shards = sorted(glob.glob(str(d / "zero1_ck" / "iter_0000003" / "*optim_states.pt")))
    assert len(shards) == 2  # one per dp rank
    for shard in shards:
        states = _tensors_by_key(torch.load(shard, map_location="cpu", weights_only=False))
        moments = states["state1"] + states["state2"]
        assert {t.dtype for t in moments if t.numel() >= 4096} == {torch.uint8}
        assert {t.dtype for t in moments if t.numel() < 4096} <= {torch.float32}
        assert sum(t.numel() for t in states["absmax1"]) == sum(-(-t.numel() // 256) for t in states["state1"]
                                                                if t.dtype == torch.uint8)
        assert "exp_avg" not in states


def test_resuming_with_another_optimizer_or_shape_is_refused(runs):
    """Its state would not fit the other optimizer, and is not reshaped: exit 2 before training, naming the
    difference and the fix."""
    d, out = runs
    rc, log = out[0]["other_optimizer"]
    assert rc == 2
    assert "training.optimizer: checkpoint 'adamw8bit', config 'adamw'" in log
    assert "resume with the config it was saved with" in log
    rc, log = out[0]["other_shape"]
    assert rc == 2
    assert "training.optimizer=adamw8bit state cannot be reshaped" in log and "(tp, pp, dp) = (1, 1, 2)" in log
    assert (d / "zero1_ck" / "latest").read_text().strip() == "iter_0000006"  # nothing written
    assert not os.path.exists(str(d / "zero1_ck") + "_universal")


def _tensors_by_key(obj, out=None):
    out = {} if out is None else out
    if isinstance(obj, dict):
        for key, value in obj.items():
            if torch.is_tensor(value):
                out.setdefault(key, []).append(value)
            else:
                _tensors_by_key(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors_by_key(value, out)
    return out


# -- a missing package: one config error, before any process group --------------------------------------------

def _config(optimizer):
    return config_from_dict({"training": {"optimizer": optimizer, "train_iters": 1}, "data": {"synthetic": True}})


def test_missing_package_is_a_config_error_with_the_pip_command():
    with pytest.raises(ConfigError, match=r"training.optimizer=adamw8bit needs the bitsandbytes package.*"
                                          r"pip install bitsandbytes"):
        _config("adamw8bit").check(1, installed=lambda package: False)
    _config("adamw").check(1, installed=lambda package: False)  # nothing optional needed
    _config("adamw8bit").check(1)  # planning and dry runs do not need it


def test_pretrain_refuses_before_starting(monkeypatch, capsys):
    from gptpar.training.pretrain import main as pretrain_main
    from gptpar.training import cli

    monkeypatch.setattr(cli, "package_installed", lambda package: package != "bitsandbytes")
    assert pretrain_main(["--config", "configs/cpu_tiny.json", "--use-bnb-optimizer"]) == 2
    err = capsys.readouterr().err
    assert "config error: training.optimizer=adamw8bit needs the bitsandbytes package" in err
    assert pretrain_main(["--config", "configs/cpu_tiny.json", "--use-bnb-optimizer", "--dry-run"]) == 0


def test_checkpoints_from_before_the_option_hold_adamw_state():
    from gptpar.checkpoint.checkpointer import CheckpointError, check_shape

    old = {"model": {"hidden_size": 64}, "parallel": {"zero_stage": 1}}   # saved without a "training" section
    check_shape(old, dict(old, training={"optimizer": "adamw"}), "iter_0000003")
    with pytest.raises(CheckpointError, match="training.optimizer: checkpoint 'adamw', config 'adamw8bit'"):
        check_shape(old, dict(old, training={"optimizer": "adamw8bit"}), "iter_0000003")
