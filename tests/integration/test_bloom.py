"""BLOOM's architecture (ALiBi, the embedding LayerNorm): slopes and attention against the written-out formulas,
Hugging Face's `BloomForCausalLM` imported at tp = 1 and tp = 2, a prefix-LM step through the pipeline against the
serial model, the parameter and memory formulas, and BLOOM-176B's published parameter count from
configs/176b_bloom.json."""
import math

import pytest
import torch
from torch.testing import assert_close

from gptpar.estimate.flops import exact_model_params, params_per_stage
from gptpar.model.alibi import alibi_slopes, rank_alibi_slopes
from gptpar.model.config import GPTConfig
from gptpar.model.gpt import GPTModel, TransformerLayer
from gptpar.model.hf import config_from_hf, from_hf_state_dict, to_hf_state_dict
from gptpar.model.pipeline import model_parameter_count, partition_layers, stage_parameter_counts
from gptpar.model.sharding import load_full_state_dict
from gptpar.testing import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB = 100


def _written_out_slopes(n):
    """ANCHORS.md's rule: 2^(-8(i+1)/n) for n a power of two; else the closest lower power's slopes followed by
    every other slope of the next power."""
    def power_of_two(m):
        return [2.0 ** (-8.0 * (i + 1) / m) for i in range(m)]
    closest = 1 << (n.bit_length() - 1)
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][:n - closest]


def test_alibi_slopes_match_bloom_and_split_by_tp_rank():
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    for n in list(range(1, 40)) + [48, 64, 96, 112, 128]:
        assert alibi_slopes(n) == pytest.approx(_written_out_slopes(n), rel=1e-12), n
        assert_close(torch.tensor(alibi_slopes(n), dtype=torch.float32), _get_alibi_slopes(n, "cpu"), rtol=1e-6,
                     atol=0, msg=f"{n} heads")
    for n, tp in [(6, 2), (6, 3), (12, 4), (112, 4)]:
        ranks = [rank_alibi_slopes(n, r, tp) for r in range(tp)]
        assert torch.equal(torch.cat(ranks), torch.tensor(alibi_slopes(n), dtype=torch.float32))


def _reference_attention(q, k, v, slopes, allowed):
    """softmax(q k^T / sqrt(d) + slope * (key position - query position), masked) v, queries at the last
    positions of the keys."""
    sq, sk = q.shape[-2], k.shape[-2]
    distance = torch.arange(sk)[None, :] - torch.arange(sk - sq, sk)[:, None]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + slopes[:, None, None] * distance
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def test_alibi_attention_matches_the_formula_with_every_mask():
    """Causal, prefix-LM (an explicit mask that lets the prefix see ahead), and queries that are only the last
    positions of the keys (a KV cache's decoding step), for the heads of tp rank 1 of 2."""
    from gptpar.data.masks import build_masks

    config = GPTConfig(num_layers=1, hidden_size=48, num_attention_heads=6, seq_length=12,
                       position_embedding_type="alibi")
    layer = TransformerLayer(config, 0).eval()
    layer.alibi_slopes = rank_alibi_slopes(6, 1, 2)  # rank 1's 3 heads, as at tp = 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g) for _ in range(3))
    slopes = torch.tensor(alibi_slopes(6)[3:])
    causal = torch.ones(12, 12).tril().bool()
    with torch.no_grad():
        full = layer.core_attention(q, k, v, None)
        assert_close(full, _reference_attention(q, k, v, slopes, causal), rtol=1e-5, atol=1e-6)
        prefix, _, _ = build_masks(torch.zeros(2, 12, dtype=torch.long), eod=-1, prefix_lengths=torch.tensor([4, 7]))
        assert_close(layer.core_attention(q, k, v, prefix), _reference_attention(q, k, v, slopes, prefix),
                     rtol=1e-5, atol=1e-6)
        assert (layer.core_attention(q, k, v, prefix) - full).abs().max() > 1e-3  # the prefix saw ahead
        last = layer.core_attention(q[:, :, -3:], k, v, None)
        assert_close(last, _reference_attention(q[:, :, -3:], k, v, slopes, causal[-3:]), rtol=1e-5, atol=1e-6)
        assert_close(last, full[:, :, -3:], rtol=1e-5, atol=1e-6)


def _hf_bloom(seed=0):
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6, layer_norm_epsilon=1e-5,
                                   bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.BloomForCausalLM(cfg).eval()
    with torch.no_grad():  # HF zero-initialises biases and sets LayerNorms to 1/0: make every tensor matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _compare_with_hf_bloom(hf_state, config, x, hf_logits, hf_loss, tp_group=None):
    """gptpar's logits (gathered over tp) and loss against BloomForCausalLM's, to 1e-5."""
    model = GPTModel(config, tp_group=tp_group).eval()
    load_full_state_dict(model, from_hf_state_dict(hf_state, config), tp_group)
    with torch.no_grad():
        logits = model(x)  # (b, s, V_padded / tp)
        if tp_group is not None:
            parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(tp_group))]
            torch.distributed.all_gather(parts, logits, group=tp_group)
            logits = torch.cat(parts, dim=-1)
        assert_close(logits[..., :VOCAB], hf_logits, rtol=1e-5, atol=1e-5)
        assert_close(model(x[:, :-1], labels=x[:, 1:]), hf_loss, rtol=1e-5, atol=1e-6)
    return True


# Weights large enough for attention to matter beside the unit-scale residual the embedding LayerNorm makes.
PIPE_CFG = dict(num_layers=2, hidden_size=48, num_attention_heads=6, seq_length=16, vocab_size=64,
                init_method_std=0.3, position_embedding_type="alibi", embed_layernorm=True)


def _prefix_lm_batches():
    from gptpar.data.masks import build_masks

    batches = []
    for i in range(2):
        x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(20 + i))
        mask, loss_mask, positions = build_masks(x[:, :-1], eod=63, prefix_lengths=torch.tensor([5, 9]),
                                                 loss_on_targets_only=True)
        batches.append(dict(input_ids=x[:, :-1], labels=x[:, 1:], attention_mask=mask, loss_mask=loss_mask,
                            position_ids=positions))
    return batches


def _on_two_ranks(*hf_args):
    """One launch, two checks: the imported BLOOM at tp = 2, then a prefix-LM step through a pp = 2 pipeline."""
    from gptpar.model.pipeline import build_pipeline_model
    from gptpar.parallel import init_parallel
    from gptpar.training.engine import build_engine

    _compare_with_hf_bloom(*hf_args, tp_group=init_parallel(tp=2).tp_group)
    st = init_parallel(tp=1, pp=2)
    model, _ = build_pipeline_model(GPTConfig(**PIPE_CFG), st, seed=11)
    ds_config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                 "steps_per_print": 10 ** 9}
    engine = build_engine(model, st, ds_config, lr=0.0, has_attention_mask=True)
    return engine.train_step(_prefix_lm_batches())


def test_bloom_imported_at_tp1_and_tp2_and_prefix_lm_through_the_pipeline():
    hf = _hf_bloom()
    config = config_from_hf(hf.config, seq_length=16)
    assert (config.position_embedding_type, config.embed_layernorm, config.activation) == ("alibi", True, "gelu_tanh")
    back = to_hf_state_dict(from_hf_state_dict(hf.state_dict(), config), config)
    assert set(back) == set(hf.state_dict())
    for name, t in hf.state_dict().items():
        assert torch.equal(back[name], t), name
    x = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(x, labels=x)  # HF shifts the labels inside
    args = ({k: v.clone() for k, v in hf.state_dict().items()}, config, x, out.logits, out.loss)
    _compare_with_hf_bloom(*args)
    pipeline_loss = run_distributed(_on_two_ranks, 2, args=args, timeout=300)[1]  # the last stage's

    serial = GPTModel(GPTConfig(**PIPE_CFG), seed=11)
    batches = _prefix_lm_batches()
    with torch.no_grad():
        expected = torch.stack([serial(**mb) for mb in batches]).mean()
        causal = torch.stack([serial(mb["input_ids"], labels=mb["labels"], loss_mask=mb["loss_mask"])
                              for mb in batches]).mean()
    assert_close(torch.tensor(pipeline_loss), expected, rtol=1e-5, atol=0)
    assert abs(pipeline_loss - causal.item()) > 1e-4  # the prefix mask really changed the result


@pytest.mark.parametrize("alibi,embed_ln", [(True, True), (True, False), (False, True)])
def test_parameter_formulas_know_alibi_and_the_embedding_layernorm(alibi, embed_ln):
    kind = dict(position_embedding_type="alibi" if alibi else "learned", embed_layernorm=embed_ln)
    config = GPTConfig(num_layers=10, hidden_size=96, num_attention_heads=6, seq_length=64, vocab_size=1000, **kind)
    kw = dict(num_layers=10, hidden_size=96, vocab_size=1000, seq_length=64, tp_size=2, **kind)
    assert model_parameter_count(config, 2) == exact_model_params(**kw)
    assert sum(p.numel() for p in GPTModel(config, device="meta").parameters()) == \
        exact_model_params(**dict(kw, tp_size=1))
    plan = partition_layers(10, 4, "balanced")
    rows = stage_parameter_counts(config, plan, 2)
    stage_kw = dict(kw, pp_size=4, partition_method="balanced")
    assert [r["params"] for r in rows] == params_per_stage(**stage_kw)
    assert [r["params_per_tp_rank"] for r in rows] == params_per_stage(per_tp_rank=True, **stage_kw)


def test_176b_bloom_dry_run_prints_bloom_parameter_count(capsys):
    from gptpar.training.pretrain import main as pretrain_main

    assert pretrain_main(["--config", "configs/176b_bloom.json", "--dry-run"]) == 0
    out = capsys.readouterr().out
    h, V = 14336, 250880  # BLOOM's width and padded vocabulary: 70 (12h^2 + 13h) + V h + 4h, no position table
    published = 70 * (12 * h * h + 13 * h) + V * h + 4 * h
    assert published == 176_247_271_424
    assert f"real model on the meta device: {published:,} (matches the formula {published:,})" in out
    assert "padded_vocab_size=250880" in out and "world_size=384 (tp 4 x pp 12 x dp 8)" in out


def test_bad_architecture_options_are_clear_errors(tmp_path):
    from gptpar.checkpoint.exceptions import ConversionError
    from gptpar.checkpoint.huggingface import load_hf, save_hf
    from gptpar.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="model.position_embedding_type must be one of"):
        config_from_dict({"model": {"position_embedding_type": "rope"}, "data": {"synthetic": True}})
    with pytest.raises(ConversionError, match="no Hugging Face architecture matches.*embed_layernorm=true"):
        save_hf({}, GPTConfig(position_embedding_type="alibi"), str(tmp_path / "out"))
    transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                             intermediate_size=32).save_pretrained(tmp_path / "llama")
    with pytest.raises(ConversionError, match="model_type 'llama' is not supported"):
        load_hf(str(tmp_path / "llama"))


def test_resume_refuses_another_position_embedding_type():
    """A checkpoint written before the two options existed counts as learned / no embedding LayerNorm."""
    from gptpar.checkpoint.checkpointer import CheckpointError, check_shape

    def shape(**model):
        return {"model": dict(num_layers=2, **model), "parallel": {"tensor_model_parallel_size": 1}}

    older = shape()
    check_shape(older, shape(position_embedding_type="learned", embed_layernorm=False), "older")
    with pytest.raises(CheckpointError, match="model.position_embedding_type: checkpoint 'learned', config 'alibi'"):
        check_shape(older, shape(position_embedding_type="alibi", embed_layernorm=False), "older")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")
def test_cuda_alibi_matches_hugging_face_bloom_and_cpu():
    """On a GPU (SDPA's CUDA kernels with ALiBi's additive mask): logits equal BloomForCausalLM's on the same GPU,
    gradients equal the CPU model's, and bf16 autocast gives the fp32 loss within 2%."""
    _check_alibi_on(torch.device("cuda"))


def _check_alibi_on(device):
    hf = _hf_bloom().to(device)
    config = config_from_hf(hf.config, seq_length=64)
    state = from_hf_state_dict({k: v.cpu() for k, v in hf.state_dict().items()}, config)
    models = {}
    for where in ("cpu", device):
        models[str(where)] = model = GPTModel(config, device=where)
        load_full_state_dict(model, state)
    on_device = models[str(device)]
    x = torch.randint(0, VOCAB, (2, 65), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        assert_close(on_device.eval()(x[:, :-1])[..., :VOCAB], hf(x[:, :-1]).logits, rtol=1e-4, atol=1e-4)
    losses = {}
    for where, model in models.items():
        xs = x.to(where)
        losses[where] = model.train()(xs[:, :-1], labels=xs[:, 1:])
        losses[where].backward()
    assert_close(losses[str(device)].cpu(), losses["cpu"], rtol=1e-5, atol=1e-6)
    for (name, p_cpu), p_dev in zip(models["cpu"].named_parameters(), on_device.parameters()):
        assert_close(p_dev.grad.cpu(), p_cpu.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        bf16 = on_device(x[:, :-1], labels=x[:, 1:])
    assert abs(bf16.item() - losses["cpu"].item()) < 2e-2 * losses["cpu"].item()


def test_memory_estimate_counts_the_alibi_bias():
    """Without recompute every layer of every micro batch in flight keeps its ALiBi bias, 2 a s^2 / tp bytes;
    selective recompute rebuilds it with the attention core (one at a time); full recompute keeps none."""
    from gptpar.estimate.memory import activation_bytes

    kw = dict(seq_length=128, micro_batch_size=2, hidden_size=64, num_attention_heads=8, layers_on_stage=3,
              tp_size=2, pp_size=4, num_micro_batches=8)
    bias = 2 * 8 * 128 * 128 / 2
    for mode, kept in (("none", 4 * 3), ("selective", 1), ("full", 1)):
        extra = (activation_bytes(activation_checkpointing=mode, alibi=True, **kw)
                 - activation_bytes(activation_checkpointing=mode, **kw))
        assert extra == pytest.approx(kept * bias), mode
