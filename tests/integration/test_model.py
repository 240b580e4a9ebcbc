"""The GPT model against Hugging Face GPT-2, the 200B sizing notes' size formula, DeepSpeed's partitioner, and itself
under activation checkpointing and attention masks."""
import math

import pytest
import torch
from torch.testing import assert_close

from gptpar.estimate.flops import model_size_formula, params_per_stage
from gptpar.model.config import GPTConfig
from gptpar.model.gpt import GPTModel, compile_transformer_layers
from gptpar.model.hf import config_from_hf, from_hf_state_dict, to_hf_state_dict
from gptpar.model.kernels import describe_kernels
from gptpar.model.pipeline import (model_parameter_count, partition_layers, stage_parameter_counts)
from gptpar.model.sharding import gather_full_state_dict, load_full_state_dict
from gptpar.tensor_parallel.random import model_parallel_seed
from gptpar.testing import run_distributed

transformers = pytest.importorskip("transformers")


def _hf_model(activation="gelu_new", vocab=100, seed=0):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=16,
                                  activation_function=activation, resid_pdrop=0.0, attn_pdrop=0.0,
                                  embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # HF zero-initialises biases and sets LayerNorms to 1/0: make every tensor matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _tokens(vocab=100, b=3, s=16, seed=1):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _compare_with_hf(tp_group=None, activation="gelu_new"):
    hf = _hf_model(activation)
    config = config_from_hf(hf.config)
    model = GPTModel(config, tp_group=tp_group).eval()
    load_full_state_dict(model, from_hf_state_dict(hf.state_dict(), config), tp_group)
    x = _tokens()
    with torch.no_grad():
        out = hf(x, labels=x)
        logits = model(x)  # (b, s, V_padded / tp)
        full = logits if tp_group is None else _gather_last(logits, tp_group)
        assert_close(full[..., :config.vocab_size], out.logits, rtol=1e-5, atol=1e-5)
        loss = model(x[:, :-1], labels=x[:, 1:])
        assert_close(loss, out.loss, rtol=1e-5, atol=1e-6)
    return gather_full_state_dict(model, tp_group)


def _gather_last(t, group):
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_matches_hugging_face_gpt2_tp1(activation):
    _compare_with_hf(activation=activation)


def test_hf_round_trip():
    hf = _hf_model()
    config = config_from_hf(hf.config)
    sd = from_hf_state_dict(hf.state_dict(), config)
    back = to_hf_state_dict(sd, config)
    for name, t in hf.state_dict().items():
        assert torch.equal(back[name], t), name


def _hf_tp2():
    from gptpar.parallel import init_parallel

    st = init_parallel(tp=2)
    return _compare_with_hf(st.tp_group)


def test_matches_hugging_face_gpt2_tp2():
    gathered = run_distributed(_hf_tp2, 2, timeout=240)
    # Gathering the shards gives back the tp=1 weights (padding rows are zero).
    hf = _hf_model()
    full = from_hf_state_dict(hf.state_dict(), config_from_hf(hf.config))
    for name, t in full.items():
        assert torch.equal(gathered[0][name][:t.shape[0]], t), name


@pytest.mark.parametrize("shape", [
    dict(num_layers=64, hidden_size=11600, num_attention_heads=80, vocab_size=50257, make_vocab_size_divisible_by=1),
    dict(num_layers=80, hidden_size=14400, num_attention_heads=96, vocab_size=250680),
])
def test_meta_build_matches_seed_size_formula(shape):
    config = GPTConfig(seq_length=2048, **shape)
    model = GPTModel(config, device="meta")
    total = sum(p.numel() for p in model.parameters())
    padded = config.padded_vocab_size(1)
    assert total == model_size_formula(config.num_layers, config.hidden_size, padded, config.seq_length)
    assert total == model_parameter_count(config, tp=1)


@pytest.mark.parametrize("layers,pp,tp,method", [(80, 10, 8, "transformer"), (70, 12, 4, "balanced"),
                                                 (64, 32, 4, "transformer"), (10, 4, 2, "balanced")])
def test_stage_counts_agree_with_planning_formula(layers, pp, tp, method):
    config = GPTConfig(num_layers=layers, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1000)
    plan = partition_layers(layers, pp, method)
    rows = stage_parameter_counts(config, plan, tp)
    kw = dict(num_layers=layers, hidden_size=256, vocab_size=1000, seq_length=128,
              pp_size=pp, tp_size=tp, partition_method=method)
    assert [r["params"] for r in rows] == params_per_stage(**kw)
    assert [r["params_per_tp_rank"] for r in rows] == params_per_stage(per_tp_rank=True, **kw)
    # The stages add up to the model, the tied output embedding counted a second time when pp > 1.
    tied_copy = config.padded_vocab_size(tp) * 256 if pp > 1 else 0
    assert sum(r["params"] for r in rows) == model_parameter_count(config, tp) + tied_copy


def test_partition_70_layers_pp12_balanced():
    plan = partition_layers(70, 12, "balanced")
    assert [s.num_layers for s in plan.stages] == [5] + [6] * 10 + [5]
    assert plan.stages[0].has_input_embedding and plan.stages[-1].has_output_embedding
    assert partition_layers(70, 12, "auto").method == "balanced"
    assert partition_layers(72, 12, "auto").method == "transformer"  # 74 % 12 != 0
    plan2 = partition_layers(76, 10, "balanced", embedding_weight=2)  # (76 + 4) / 10 = 8 units
    assert [s.num_layers for s in plan2.stages] == [6] + [8] * 8 + [6]


@pytest.mark.parametrize("layers,pp,method,match", [
    (2, 4, "balanced", "no transformer layer"),  # stage 0 would hold only the embedding
    (10, 4, "transformer", "must divide by pp"),
    (11, 4, "balanced", r"\(num_layers \+ 2\*1\) % pp"),
    (4, 3, "diagonal", "partition_method must be one of"),
])
def test_partition_rejections(layers, pp, method, match):
    with pytest.raises(ValueError, match=match):
        partition_layers(layers, pp, method)


def test_partition_agrees_with_deepspeed_partitioner():
    from deepspeed.runtime.utils import partition_balanced

    checked = 0
    for layers in range(1, 30):
        for pp in range(1, 7):
            for method in ("balanced", "transformer"):
                for w in (1, 2):
                    try:
                        plan = partition_layers(layers, pp, method, w)
                    except ValueError:
                        continue
                    unit = 1 if method == "balanced" else 0
                    weights = [unit] * w + [1] * layers + [0] + [unit] * w
                    assert list(partition_balanced(weights, pp)) == plan.parts, (layers, pp, method, w)
                    checked += 1
    assert checked > 200


def test_config_errors_name_field_and_fix():
    with pytest.raises(ValueError, match="num_attention_heads"):
        GPTConfig(hidden_size=64, num_attention_heads=5)
    cfg = GPTConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=100)
    with pytest.raises(ValueError, match="num_attention_heads.*tensor_model_parallel_size"):
        cfg.check_parallel(tp_size=8)
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        GPTConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=102).check_parallel(tp_size=4)
    with pytest.raises(ValueError, match="seq_length"):
        GPTConfig(seq_length=128, max_position_embeddings=64)
    assert GPTConfig(vocab_size=250680).padded_vocab_size(8) == 250880


def test_activation_checkpointing_replays_dropout_exactly():
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                       hidden_dropout=0.2, attention_dropout=0.2)
    x = _tokens(64, 2, 17)
    grads = []
    for ckpt in (False, True):
        tracker = model_parallel_seed(7)
        model = GPTModel(config, rng_tracker=tracker, activation_checkpointing=ckpt, seed=3).train()
        loss = model(x[:, :-1], labels=x[:, 1:])
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_prefix_mask_lets_the_prefix_see_ahead():
    """Train to predict, at position 0, the token at position 2. Inside a prefix of length 4 attention is
    bidirectional, so this is learnable; with the causal mask position 0 cannot see position 2."""
    from gptpar.data.masks import build_masks

    vocab, seq = 8, 6
    final = {}
    for prefix in (True, False):
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=seq,
                                   vocab_size=vocab, make_vocab_size_divisible_by=1), seed=5)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for _ in range(150):
            x = torch.randint(0, vocab, (32, seq), generator=g)
            mask, _, _ = build_masks(x, eod=vocab - 1, prefix_lengths=torch.full((32,), 4) if prefix else None)
            labels = torch.full_like(x, -100)
            labels[:, 0] = x[:, 2]
            loss_mask = torch.zeros(x.shape)
            loss_mask[:, 0] = 1
            loss = model(x, attention_mask=mask, labels=labels, loss_mask=loss_mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
        final[prefix] = loss.item()
    assert final[True] < 0.3 * math.log(vocab) < final[False], final


def _masked_step_through_pipeline():
    from gptpar.data.masks import build_masks
    from gptpar.model.pipeline import build_pipeline_model
    from gptpar.parallel import init_parallel
    from gptpar.training.engine import build_engine

    st = init_parallel(tp=1, pp=2)
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
    model, _ = build_pipeline_model(config, st, seed=11)
    ds_config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                 "steps_per_print": 10 ** 9}
    engine = build_engine(model, st, ds_config, lr=0.0, has_attention_mask=True)
    micro_batches = []
    for i in range(2):
        x = _tokens(64, 2, 17, seed=20 + i)
        mask, loss_mask, positions = build_masks(x[:, :-1], eod=63, prefix_lengths=torch.tensor([5, 9]),
                                                 loss_on_targets_only=True)
        micro_batches.append(dict(input_ids=x[:, :-1], labels=x[:, 1:], attention_mask=mask, loss_mask=loss_mask,
                                  position_ids=positions))
    return engine.train_step(micro_batches), micro_batches


def test_attention_mask_through_the_pipeline_matches_serial():
    (loss, micro_batches), _ = run_distributed(_masked_step_through_pipeline, 2, timeout=300)
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
    serial = GPTModel(config, seed=11)
    with torch.no_grad():
        expected = torch.stack([serial(**mb) for mb in micro_batches]).mean()
        causal = torch.stack([serial(mb["input_ids"], labels=mb["labels"], loss_mask=mb["loss_mask"])
                              for mb in micro_batches]).mean()
    assert_close(torch.tensor(loss), expected, rtol=1e-5, atol=0)
    assert abs(loss - causal.item()) > 1e-4  # the mask really changed the result


def test_kernel_choice_is_reported():
    line = describe_kernels(torch.device("cpu"))
    assert "layernorm=torch LayerNorm" in line and "AdamW" in line and "SDPA" in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")
def test_cuda_matches_hugging_face_and_cpu():
    """On a GPU: logits equal HF's on the same GPU, gradients equal the CPU model's, bf16 autocast and
    torch.compile'd layers give the fp32 loss. (The GPU benchmark's correctness, checked where it runs.)"""
    dev = torch.device("cuda")
    hf = _hf_model("gelu").to(dev)
    config = config_from_hf(hf.config)
    state = from_hf_state_dict({k: v.cpu() for k, v in hf.state_dict().items()}, config)
    models = {}
    for name in ("cpu", "cuda"):
        models[name] = GPTModel(config, device=name)
        load_full_state_dict(models[name], state)
    x = _tokens()
    with torch.no_grad():
        out = hf(x.to(dev), labels=x.to(dev))
        assert_close(models["cuda"].eval()(x.to(dev))[..., :config.vocab_size], out.logits, rtol=1e-4, atol=1e-4)
    losses = {}
    for name, model in models.items():
        model.train()
        xs = x.to(name)
        losses[name] = model(xs[:, :-1], labels=xs[:, 1:])
        losses[name].backward()
    assert_close(losses["cuda"].cpu(), losses["cpu"], rtol=1e-5, atol=1e-6)
    for (n, p_cpu), p_gpu in zip(models["cpu"].named_parameters(), models["cuda"].parameters()):
        assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=1e-4, atol=1e-6, msg=n)
    xs = x.to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = models["cuda"](xs[:, :-1], labels=xs[:, 1:])
    assert abs(bf16.item() - losses["cpu"].item()) < 2e-2 * losses["cpu"].item()
    compile_transformer_layers(models["cuda"])
    compiled = models["cuda"](xs[:, :-1], labels=xs[:, 1:])
    assert_close(compiled.cpu(), losses["cpu"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_attention_output_is_a_view_for_the_cuda_kernels(kernel):
    """The (s, b, h) activation layout costs no transpose copy around attention on a GPU: the CUDA kernels'
    shape functions (which torch.compile plans its buffers with) give the output q's layout, and for qkv_heads'
    q that makes attention_output's permute + reshape a view of the kernel's output. Checked on meta tensors."""
    from gptpar.model.gpt import TransformerLayer

    config = GPTConfig(num_layers=1, hidden_size=256, num_attention_heads=2, seq_length=64, vocab_size=100)
    layer = TransformerLayer(config, 0, device="meta", dtype=torch.bfloat16)
    q, k, v = layer.qkv_heads(torch.empty(64, 3, 256, device="meta", dtype=torch.bfloat16))
    if kernel == "cudnn":
        ctx = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.1, True, False)[0]
    else:
        ctx = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.1, True, False)[0]
    seen = []
    layer.dense.forward = lambda x: seen.append(x) or x
    layer.attention_output(ctx)
    assert seen[0].shape == (64, 3, 256)
    assert seen[0]._base is ctx  # a view of the kernel's output, not a copy
