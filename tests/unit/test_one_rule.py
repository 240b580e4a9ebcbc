"""Every input a component rejects, the config check rejects first: exit 2 before any process group.

Each case names the component's own rule (called directly here, so the case cannot pass vacuously if the
component starts accepting the input) and the same input as a config override of configs/cpu_dp2.json
(2 ranks, dp 2, micro batch 2, global batch 8, 20 iterations, synthetic data)."""
import math

import pytest
import torch.distributed as dist

from gptpar.data.blending import BlendedDataset
from gptpar.data.gpt_dataset import parse_data_path, parse_split
from gptpar.data.indexed import DataError
from gptpar.estimate.flops import layer_params
from gptpar.model.config import GPTConfig
from gptpar.schedules import BatchSizeRampup, LearningRateSchedule

REAL_DATA = ["--set", "data.synthetic=false"]


def _blend(weights):
    BlendedDataset([[0], [1]], weights, num_samples=4)


CASES = [
    # (id, the component rejecting the input, the same input as config overrides)
    ("blend_weight_zero", lambda: _blend([0.0, 1.0]), REAL_DATA + ["--set", 'data.data_path=["0", "A", "1", "B"]']),
    ("blend_weight_negative", lambda: _blend([-1.0, 2.0]), REAL_DATA + ["--set", 'data.data_path=["-1", "A", "2", "B"]']),
    ("blend_weight_nan", lambda: _blend([math.nan, 1.0]), REAL_DATA + ["--set", 'data.data_path=["nan", "A", "1", "B"]']),
    ("blend_weight_inf", lambda: _blend([math.inf, 1.0]), REAL_DATA + ["--set", 'data.data_path=["inf", "A", "1", "B"]']),
    ("blend_in_one_string", lambda: _blend([0.0, 1.0]), REAL_DATA + ["--set", "data.data_path=0 A 1 B"]),
    ("data_path_grammar", lambda: parse_data_path(["0.3", "A", "B"]),
     REAL_DATA + ["--set", 'data.data_path=["0.3", "A", "B"]']),
    ("split", lambda: parse_split("90,a"), ["--set", "data.split=90,a"]),
    ("tp_vs_heads", lambda: GPTConfig(hidden_size=60, num_attention_heads=6, ffn_hidden_size=240).check_parallel(4),
     ["--set", "model.hidden_size=60", "--set", "model.num_attention_heads=6", "--set", "model.ffn_hidden_size=240",
      "--set", "parallel.tensor_model_parallel_size=4", "--set", "parallel.data_parallel_size=1"]),
    ("tp_vs_ffn", lambda: layer_params(64, 66, tp_size=4),
     ["--set", "model.ffn_hidden_size=66", "--set", "parallel.tensor_model_parallel_size=4",
      "--set", "parallel.data_parallel_size=null"]),
    ("warmup_vs_decay", lambda: LearningRateSchedule(1e-3, 1e-4, warmup_steps=20 * 8, decay_steps=20 * 8),
     ["--set", "training.lr_warmup_iters=20"]),
    ("batch_vs_micro_dp", lambda: BatchSizeRampup(6, 2, 2), ["--set", "training.global_batch_size=6"]),
    ("rampup_start_vs_gbs", lambda: BatchSizeRampup(8, 2, 2, start=8, increment=4, samples=40),
     ["--set", "training.train_iters=null", "--set", "training.train_samples=200", "--set",
      "training.lr_warmup_iters=0", "--set", "training.rampup_batch_size=[8,4,40]"]),
    ("rampup_increment_vs_micro_dp", lambda: BatchSizeRampup(8, 2, 2, start=4, increment=2, samples=40),
     ["--set", "training.train_iters=null", "--set", "training.train_samples=200", "--set",
      "training.lr_warmup_iters=0", "--set", "training.rampup_batch_size=[4,2,40]"]),
]


@pytest.mark.parametrize("reject, overrides", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_config_check_rejects_what_a_component_rejects(reject, overrides, monkeypatch, capsys):
    from gptpar.training.pretrain import main as pretrain_main

    with pytest.raises((ValueError, DataError)):
        reject()
    monkeypatch.setenv("WORLD_SIZE", "4" if "parallel.tensor_model_parallel_size=4" in overrides else "2")
    assert pretrain_main(["--config", "configs/cpu_dp2.json"] + overrides) == 2
    err = capsys.readouterr().err
    assert err.startswith("pretrain_gpt.py: config error: ") and len(err.strip().splitlines()) == 1, err
    assert not dist.is_initialized()
