"""Activation recompute (none / selective / full): the same training run bit for bit, dropout included.

The reference is the same model without recompute. Recompute only changes *when* activations are computed
(again, in backward), so with the dropout masks replayed the losses, gradients and weights must be
identical, not merely close. Each test also checks that the recompute really happened (the attention core
runs twice per layer and step under selective), so that a silently disabled recompute cannot pass.
"""
import pytest
import torch

from gptpar.model.config import GPTConfig, recompute_mode
from gptpar.model.gpt import GPTModel, TransformerLayer
from gptpar.tensor_parallel.random import model_parallel_seed
from gptpar.testing import run_distributed
from gptpar.config import ConfigError, TrainingConfig, config_from_dict

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
           hidden_dropout=0.2, attention_dropout=0.2)
STEPS = 3


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, CFG["vocab_size"], (2, CFG["seq_length"] + 1), generator=g)


def _count_core_calls(layers):
    """Wrap each layer's attention core to count its calls (an instance attribute shadows the method)."""
    calls = [0]
    for layer in layers:
        def counted(*args, _inner=layer.core_attention):
            calls[0] += 1
            return _inner(*args)
        layer.core_attention = counted
    return calls


def _train(mode, tp_group=None, tp_rank=0):
    """STEPS AdamW steps with dropout on; per step the loss and every gradient, and the core's call count."""
    tracker = model_parallel_seed(7, tp_rank=tp_rank)
    model = GPTModel(GPTConfig(**CFG), tp_group=tp_group, rng_tracker=tracker, activation_checkpointing=mode,
                     seed=3).train()
    calls = _count_core_calls(model.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        x = _batch(step)
        loss = model(x[:, :-1], labels=x[:, 1:])
        opt.zero_grad()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads, calls[0]


def _assert_identical(run, reference):
    for step, (a, b) in enumerate(zip(run[0], reference[0])):
        assert torch.equal(a, b), f"step {step}: loss {a.item()!r} != {b.item()!r}"
    for step, (ga, gb) in enumerate(zip(run[1], reference[1])):
        for i, (a, b) in enumerate(zip(ga, gb)):
            assert torch.equal(a, b), f"step {step}, parameter {i}: max diff {(a - b).abs().max().item()}"


def test_recompute_modes_train_bit_for_bit_like_no_recompute():
    reference = _train("none")
    for mode in ("selective", "full"):
        _assert_identical(_train(mode), reference)
    # The core runs once per layer and step without recompute, twice with selective (forward, then in
    # backward); full recomputes whole layers, so the core runs twice there too.
    layers = CFG["num_layers"]
    assert reference[2] == layers * STEPS
    assert _train("selective")[2] == _train("full")[2] == 2 * layers * STEPS
    # Dropout is in play (otherwise replaying its masks would be untested): the eval-mode loss differs.
    model = GPTModel(GPTConfig(**CFG), rng_tracker=model_parallel_seed(7), seed=3).eval()
    x = _batch(0)
    with torch.no_grad():
        assert not torch.equal(model(x[:, :-1], labels=x[:, 1:]), reference[0][0])


def _tp2_runs():
    from gptpar.parallel import init_parallel

    st = init_parallel(tp=2)
    out = {}
    for mode in ("none", "selective", "full"):
        losses, grads, calls = _train(mode, st.tp_group, st.tp_rank)
        out[mode] = (losses, grads, calls)
    return out


def test_recompute_modes_bit_for_bit_at_tp2():
    """Attention dropout draws from the per-tp-rank stream: selective must replay that stream too."""
    for rank_out in run_distributed(_tp2_runs, 2, timeout=240):
        _assert_identical(rank_out["selective"], rank_out["none"])
        _assert_identical(rank_out["full"], rank_out["none"])
        assert rank_out["selective"][2] == 2 * rank_out["none"][2]


def _pipeline_runs():
    """pp = 2 through DeepSpeed's pipeline engine, dropout on: per mode the losses and grad norms of 3 steps."""
    from gptpar.model.pipeline import build_pipeline_model
    from gptpar.parallel import init_parallel
    from gptpar.training.engine import build_engine

    st = init_parallel(pp=2)
    ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "gradient_clipping": 1.0, "steps_per_print": 10 ** 9}
    out = {}
    for mode in ("none", "selective", "full"):
        tracker = model_parallel_seed(7, pp_rank=st.pp_rank)
        model, _ = build_pipeline_model(GPTConfig(**CFG), st, partition_method="transformer", seed=3,
                                        rng_tracker=tracker, activation_checkpointing=mode)
        engine = build_engine(model, st, ds, lr=1e-2)
        calls = _count_core_calls([m for m in model.modules() if isinstance(m, TransformerLayer)])
        losses, norms = [], []
        for step in range(STEPS):
            tokens = torch.cat([_batch(step), _batch(step + 50)])
            losses.append(engine.train_step([{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens.split(2)]))
            norms.append(engine.grad_norm)
        out[mode] = (losses, norms, calls[0])
    return out


def test_recompute_modes_bit_for_bit_through_the_pipeline_engine():
    pytest.importorskip("deepspeed")
    for rank_out in run_distributed(_pipeline_runs, 2, timeout=300):
        none, selective, full = (rank_out[m] for m in ("none", "selective", "full"))
        assert selective[:2] == none[:2] and full[:2] == none[:2]
        # one layer per stage, 2 micro-batches per step: the core runs twice as often under recompute
        assert none[2] == 2 * STEPS and selective[2] == full[2] == 2 * none[2]


def test_pipeline_specs_carry_selective_recompute():
    pytest.importorskip("deepspeed")
    from gptpar.model.pipeline import layer_specs

    for flag in (False, True):
        specs = layer_specs(GPTConfig(**CFG), recompute_core_attention=flag)
        layers = [s for s in specs if s.typename is TransformerLayer]
        assert len(layers) == CFG["num_layers"]
        assert all(s.module_kwargs["recompute_core_attention"] is flag for s in layers)


def test_config_accepts_modes_and_booleans():
    base = dict(train_iters=1)
    assert [TrainingConfig(**base, activation_checkpointing=v).activation_checkpointing
            for v in (True, False, "none", "selective", "full")] == ["full", "none", "none", "selective", "full"]
    assert TrainingConfig(**base).activation_checkpointing == "none"
    with pytest.raises(ConfigError, match="activation_checkpointing.*selective"):
        TrainingConfig(**base, activation_checkpointing="partial")
    cfg = config_from_dict({"training": base, "data": {"synthetic": True}},
                           ["training.activation_checkpointing=selective"])
    assert cfg.training.activation_checkpointing == "selective"
    cfg = config_from_dict({"training": base, "data": {"synthetic": True}}, ["training.activation_checkpointing=true"])
    assert cfg.training.activation_checkpointing == "full"
    with pytest.raises(ValueError, match="selective"):
        recompute_mode("on")


# ---------------------------------------------------------------------------------------------
# The formulas: FLOPs and activation memory per mode
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_flops_count_the_recomputed_work(seed):
    import random

    from gptpar.estimate.flops import model_flops_per_iteration

    rng = random.Random(seed)
    a = rng.choice([4, 8, 16])
    h, s, b, L = a * rng.choice([32, 64, 128]), rng.choice([256, 2048]), rng.randint(1, 64), rng.randint(1, 48)
    v = 50304
    kw = dict(num_layers=L, hidden_size=h, vocab_size=v, seq_length=s, global_batch_size=b)
    none, selective, full = (model_flops_per_iteration(recompute=m, **kw) for m in ("none", "selective", "full"))
    assert model_flops_per_iteration(recompute=False, **kw) == none
    assert model_flops_per_iteration(recompute=True, **kw) == full
    # Selective redoes QK^T and (probabilities) @ V: two batched matmuls over b * a heads of (s, d) x (d, s)
    # and (s, s) x (s, d), d = h / a, 2 FLOPs per multiply-add, in each of the L layers.
    d = h // a
    core_forward = 2 * (b * a) * s * d * s + 2 * (b * a) * s * s * d
    assert selective - none == L * core_forward
    # Full redoes each layer's whole forward: its four weight GEMMs over the b*s tokens and the core.
    gemms = 2 * b * s * (3 * h * h + h * h + h * 4 * h + 4 * h * h)
    assert full - none == L * (gemms + core_forward)


@pytest.mark.parametrize("seed", range(5))
def test_selective_activation_memory_drops_the_attention_core(seed):
    import random

    from gptpar.estimate.memory import activation_bytes

    rng = random.Random(70 + seed)
    t = rng.choice([1, 2, 4, 8])
    a = t * rng.randint(1, 8)
    h, s, b = a * rng.randint(8, 64), rng.choice([256, 2048]), rng.randint(1, 8)
    layers, pp, m = rng.randint(1, 12), rng.randint(1, 16), rng.randint(1, 64)
    kw = dict(seq_length=s, micro_batch_size=b, hidden_size=h, num_attention_heads=a, layers_on_stage=layers,
              tp_size=t, pp_size=pp, num_micro_batches=m)
    in_flight = min(pp, m)
    # Korthikanti et al. 2022 (no sequence parallelism): a layer keeps sbh(10 + 24/t) bytes besides the
    # attention core's softmax output (2as^2b/t), dropout mask (as^2b/t) and dropout output (2as^2b/t).
    core = (2 + 1 + 2) * a * s * s * b / t
    kept = s * b * h * (10 + 24 / t)
    assert activation_bytes(activation_checkpointing="none", **kw) == pytest.approx(in_flight * layers * (kept + core))
    # Selective: every layer in flight keeps the rest; one core is rebuilt at a time in backward.
    assert activation_bytes(activation_checkpointing="selective", **kw) == pytest.approx(
        in_flight * layers * kept + core)
    assert activation_bytes(activation_checkpointing=True, **kw) == activation_bytes(
        activation_checkpointing="full", **kw)
