"""The run config's `deepspeed` section: merged over the generated DeepSpeed config, read back from the engine
DeepSpeed built; a typo (top-level, which DeepSpeed alone would ignore, or nested), an ill-typed value or a key
gptpar sets itself exits 2 naming the key, before any process group exists."""
import copy
import json
import math

import pytest
import torch.distributed as dist

from gptpar.testing import run_distributed
from gptpar.config import ConfigError, config_from_dict, parse_override
from gptpar.training.engine.ds_config import deepspeed_config, merge_overrides
from gptpar.training.reporting import is_training_record
from gptpar.testing.runs import TINY, read_jsonl


def write(tmp_path, deepspeed=None, **logging):
    cfg = copy.deepcopy(TINY)
    cfg["training"]["train_iters"] = 3
    cfg["logging"].update(logging)
    if deepspeed is not None:
        cfg["deepspeed"] = deepspeed
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def build_and_read_back(argv):
    """On a harness rank: the run pretrain_gpt.py would build from `argv` (gptpar.training.cli.parse, then
    gptpar.training.assembly.build_trainer), what DeepSpeed's engine and its ZeRO optimizer hold; then it trains."""
    from gptpar.parallel import init_parallel
    from gptpar.training.assembly import build_trainer, setup_environment
    from gptpar.training.cli import parse

    cfg, _, (tp, pp, dp) = parse(argv)
    setup_environment()
    pstate = init_parallel(tp, pp, dp)
    trainer = build_trainer(cfg, pstate, lambda *args, **kwargs: None, None)
    ds = trainer.engine.ds
    held = {"engine": (ds.zero_reduce_bucket_size(), ds.zero_allgather_bucket_size(), str(ds.communication_data_type)),
            "optimizer": (ds.optimizer.reduce_bucket_size, ds.optimizer.allgather_bucket_size,
                          str(ds.optimizer.communication_data_type))}
    trainer.train()
    return held


def test_overrides_reach_deepspeeds_engine(tmp_path):
    """reduce_bucket_size from the config file, allgather_bucket_size and communication_data_type from --set:
    all three in the engine's config and in the ZeRO-1 optimizer it built (2 ranks, dp 2), which then trains."""
    path = write(tmp_path, {"zero_optimization": {"reduce_bucket_size": 1000000}},
                 metrics_file=str(tmp_path / "metrics.jsonl"))
    argv = ["--config", path, "--set", "deepspeed.zero_optimization.allgather_bucket_size=3000000",
            "--set", "deepspeed.communication_data_type=bf16"]
    for held in run_distributed(build_and_read_back, 2, (argv,), timeout=300):
        assert held["engine"] == held["optimizer"] == (1000000, 3000000, "torch.bfloat16")
    losses = [r["lm_loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if is_training_record(r)]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)


def test_without_overrides_deepspeed_keeps_its_defaults():
    """An empty section leaves the generated config as it was (DeepSpeed's 5e8 buckets, no comm dtype)."""
    cfg = config_from_dict(TINY)
    assert cfg.deepspeed == {}
    generated = deepspeed_config(cfg, 2)
    assert generated["zero_optimization"] == {"stage": 1} and "communication_data_type" not in generated
    with_overrides = config_from_dict(TINY, ["deepspeed.zero_optimization.reduce_bucket_size=1000000"])
    assert deepspeed_config(with_overrides, 2)["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000000}


def test_an_override_that_changes_the_numerics_is_said():
    from gptpar.training.engine.ds_config import TUNING_KEYS, describe_overrides

    assert describe_overrides({"zero_optimization": {key: 1 for key in TUNING_KEYS}}) == []
    (line,) = describe_overrides({"communication_data_type": "bf16"})
    assert line.startswith("deepspeed.communication_data_type=bf16: gradients are reduced over dp in that dtype")


def test_merge_is_key_by_key_and_config_round_trips():
    merged = merge_overrides({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"c": 5, "e": 6}, "d": {"x": 1}})
    assert merged == {"a": {"b": 1, "c": 5, "e": 6}, "d": {"x": 1}}
    cfg = config_from_dict(TINY, ["deepspeed.zero_optimization.reduce_bucket_size=1000000",
                                  "deepspeed.zero_optimization.overlap_comm=true",
                                  "deepspeed.communication_data_type=fp32"])
    assert cfg.deepspeed == {"zero_optimization": {"reduce_bucket_size": 1000000, "overlap_comm": True},
                             "communication_data_type": "fp32"}
    assert config_from_dict(cfg.to_dict()) == cfg
    assert parse_override("deepspeed.a.b=x") == ("deepspeed", "a.b", "x")
    with pytest.raises(ConfigError, match="deepspeed.communication_data_type is 'fp32', not an object"):
        config_from_dict(TINY, ["deepspeed.communication_data_type=fp32", "deepspeed.communication_data_type.x=1"])


REFUSED = [
    # (section in the config file, --set overrides, what the one-line message must say)
    ({"zero_optimisation": {"reduce_bucket_size": 1000000}}, [],
     "unknown key deepspeed.zero_optimisation (did you mean 'zero_optimization'?)"),
    ({}, ["--set", "deepspeed.zero_optimization.reduce_bukcet_size=1000000"],
     "deepspeed.zero_optimization.reduce_bukcet_size: unknown key (did you mean 'reduce_bucket_size'?)"),
    ({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}}, [],
     "deepspeed.zero_optimization.offload_optimizer.devcie: unknown key"),
    ({"train_batch_size": 64}, [], "deepspeed.train_batch_size is set by gptpar from training.global_batch_size"),
    ({}, ["--set", "deepspeed.zero_optimization.stage=2"],
     "deepspeed.zero_optimization.stage is set by gptpar from training.zero_stage"),
    ({"communication_data_type": 123}, [],
     "deepspeed.communication_data_type: must be a string (fp32, fp16 or bf16) or null, got 123 (int)"),
    ({"communication_data_type": "fp8"}, [], "deepspeed.communication_data_type: Invalid communication_data_type"),
    ({"zero_optimization": {"reduce_bucket_size": "big"}}, [],
     "deepspeed.zero_optimization.reduce_bucket_size: Input should be a valid integer"),
    ({"zero_optimization": 1}, [], "deepspeed.zero_optimization: must be an object of keys, got 1 (int)"),
    # keys DeepSpeed takes but that change what is trained or resumed, or that gptpar does not support
    ({"zero_optimization": {"load_from_fp32_weights": False}}, [],
     "deepspeed.zero_optimization.load_from_fp32_weights is refused: false restores the fp32 master weights"),
    ({}, ["--set", "deepspeed.zero_optimization.offload_optimizer.device=cpu"],
     "deepspeed.zero_optimization.offload_optimizer is refused: gptpar does not support offloading"),
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, [],
     "deepspeed.zero_optimization.offload_param is refused: gptpar does not support offloading"),
    ({"zero_optimization": {"elastic_checkpoint": True}}, [],
     "deepspeed.zero_optimization.elastic_checkpoint is refused: it changes the layout of the optimizer files"),
    ({"zero_optimization": {"sub_group_size": 1000}}, [],
     "deepspeed.zero_optimization.sub_group_size is refused: it is not one of the keys gptpar passes through"),
]


@pytest.mark.parametrize("section,overrides,message", REFUSED)
def test_bad_deepspeed_keys_exit_2_naming_the_key(tmp_path, capsys, section, overrides, message):
    from gptpar.training.pretrain import main as pretrain_main

    assert pretrain_main(["--config", write(tmp_path, section)] + overrides) == 2
    err = capsys.readouterr().err
    assert err.startswith("pretrain_gpt.py: config error: ") and message in err and err.count("\n") == 1, err
    assert not dist.is_initialized()  # refused before any process group
