"""Checkpoint conversion: a DeepSpeed checkpoint written at tp x pp, exported to Hugging Face GPT-2 (or BLOOM for
an ALiBi + embedding-LayerNorm model), gives the loss the distributed model computed; the universal checkpoint's
weights load into a tp = 1 model with the same loss."""
import dataclasses
import json
import os

import pytest
import torch
from torch.testing import assert_close

from gptpar.model.config import GPTConfig
from gptpar.testing import run_distributed

transformers = pytest.importorskip("transformers")

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=60,
           make_vocab_size_divisible_by=16)
BLOOM_CFG = dict(CFG, hidden_size=48, num_attention_heads=6, activation="gelu_tanh", position_embedding_type="alibi",
                 embed_layernorm=True)


def _tokens(seed):
    return torch.randint(0, CFG["vocab_size"], (4, CFG["seq_length"] + 1), generator=torch.Generator().manual_seed(seed))


def _micro_batches(seed):
    t = _tokens(seed)
    return [{"input_ids": x[:, :-1], "labels": x[:, 1:]} for x in t.split(2)]


def _train_and_save(tp, pp, save_dir, cfg=CFG):
    from gptpar.checkpoint.durable import write_manifest
    from gptpar.parallel import init_parallel
    from gptpar.training.assembly import build_gpt
    from gptpar.training.engine import build_engine

    st = init_parallel(tp=tp, pp=pp)
    config = GPTConfig(**cfg)
    model = build_gpt(config, st, seed=3)
    ds_config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                 "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9}
    engine = build_engine(model, st, ds_config, lr=1e-2)
    engine.train_step(_micro_batches(0))  # move the weights away from their init
    loss = engine.eval_step(_micro_batches(1))
    tag = "iter_0000001"
    engine.ds.save_checkpoint(save_dir, tag=tag, save_latest=False)
    torch.distributed.barrier()
    if st.rank == 0:
        with open(os.path.join(save_dir, tag, "config.json"), "w") as f:
            json.dump({"model": dataclasses.asdict(config),
                       "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                    "partition_method": "auto"}}, f)
        write_manifest(os.path.join(save_dir, tag), "checkpoint", iteration=1, world_size=st.world_size)
        with open(os.path.join(save_dir, "latest"), "w") as f:
            f.write(tag)
    return loss


def _hf_loss(model_dir, architecture="GPT2LMHeadModel"):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(model).__name__ == architecture
    losses = []
    with torch.no_grad():
        for x in _tokens(1).split(2):
            logits = model(x[:, :-1]).logits  # HF's own `labels=` shifts inside: do the shift as gptpar does
            losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))
    return torch.stack(losses).mean().item()


@pytest.mark.parametrize("tp,pp", [(2, 2), pytest.param(2, 1, marks=pytest.mark.slow)])  # (2,1): make test-slow
def test_export_to_hf_and_universal(tmp_path, tp, pp):
    from gptpar.tools import convert_checkpoint

    from gptpar.checkpoint.weights import read_weights
    from gptpar.model.gpt import GPTModel
    from gptpar.model.sharding import load_full_state_dict

    save = str(tmp_path / "ckpt")
    loss = run_distributed(_train_and_save, tp * pp, args=(tp, pp, save), timeout=400)[0]

    hf_dir = str(tmp_path / "hf")
    assert convert_checkpoint.main(["--load", save, "--to", "hf", "--output", hf_dir]) == 0
    assert_close(_hf_loss(hf_dir), loss, rtol=1e-5, atol=0)

    universal = str(tmp_path / "universal")
    assert convert_checkpoint.main(["--load", save, "--to", "universal", "--output", universal]) == 0
    state, config = read_weights(universal)  # its fp32 master weights: the model's (fp32 training)
    model = GPTModel(config).eval()
    load_full_state_dict(model, state)
    with torch.no_grad():
        serial = torch.stack([model(**mb) for mb in _micro_batches(1)]).mean().item()
    assert_close(serial, loss, rtol=1e-5, atol=0)

    # Never written inside the checkpoint folder; a Hugging Face model has no optimizer state to carry.
    assert convert_checkpoint.main(["--load", save, "--to", "universal", "--output", os.path.join(save, "u")]) == 2
    assert not os.path.exists(os.path.join(save, "u"))
    with pytest.raises(SystemExit):
        convert_checkpoint.main(["--from-hf", hf_dir, "--to", "universal", "--output", str(tmp_path / "u2")])

    # HF -> gptpar weights gives the same tensors back.
    again, _ = read_weights(hf_dir)
    for name, t in state.items():
        assert torch.equal(again[name], t), name


def test_bad_checkpoint_is_a_clear_error(tmp_path, capsys):
    from gptpar.tools import convert_checkpoint

    assert convert_checkpoint.main(["--load", str(tmp_path), "--to", "universal",
                                    "--output", str(tmp_path.parent / f"{tmp_path.name}_x")]) == 2
    err = capsys.readouterr().err
    assert "holds no checkpoint" in err and "is empty" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--tp", "--pp"])
def test_a_parallel_size_below_1_is_refused(tmp_path, capsys, flag):
    """--tp 0 wrote a tp-1 layout (0 read as "not given"); a size below 1 is one line, exit 2, nothing written."""
    from gptpar.tools import convert_checkpoint

    out = tmp_path / "out"
    for size in ("0", "-2"):
        assert convert_checkpoint.main(["--load", str(tmp_path), "--to", "gptpar", "--output", str(out), flag,
                                        size]) == 2
        assert capsys.readouterr().err == (f"convert_checkpoint.py: error: {flag} {size}: a parallel size is >= 1 "
                                           "(1 = not split; leave it out for 1)\n")
    assert not out.exists()


def test_bloom_export_from_tp2_pp2_and_import(tmp_path):
    """An ALiBi + embedding-LayerNorm model trained a step at tp = 2, pp = 2 exports as BloomForCausalLM: its
    loss is the distributed model's, its logits the serial gptpar model's; importing it gives the tensors back."""
    from gptpar.tools import convert_checkpoint

    from gptpar.checkpoint.weights import read_checkpoint_weights, read_weights
    from gptpar.model.gpt import GPTModel
    from gptpar.model.sharding import load_full_state_dict

    save = str(tmp_path / "ckpt")
    loss = run_distributed(_train_and_save, 4, args=(2, 2, save, BLOOM_CFG), timeout=400)[0]
    hf_dir = str(tmp_path / "hf")
    assert convert_checkpoint.main(["--load", save, "--to", "hf", "--output", hf_dir]) == 0
    assert_close(_hf_loss(hf_dir, "BloomForCausalLM"), loss, rtol=1e-5, atol=0)

    state, config, _ = read_checkpoint_weights(save)
    model = GPTModel(config).eval()
    load_full_state_dict(model, state)
    hf = transformers.BloomForCausalLM.from_pretrained(hf_dir).eval()
    x = _tokens(2)
    with torch.no_grad():
        assert_close(model(x)[..., :CFG["vocab_size"]], hf(x).logits, rtol=1e-5, atol=1e-5)

    again, imported = read_weights(hf_dir)
    # The architecture and seq_length travel in the BLOOM config.json (the vocab padding is gptpar's own choice).
    assert dataclasses.replace(imported, make_vocab_size_divisible_by=16) == config
    for name, t in state.items():
        assert torch.equal(again[name], t), name
