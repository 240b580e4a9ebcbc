"""Gradient-accumulation fusion (gptpar.tensor_parallel.grad_accumulation, training.gradient_accumulation_fusion):
a linear layer whose weight has an fp32 `main_grad` adds its weight gradient there in its backward instead of
returning it to autograd.

References: the unfused layers' own autograd gradients, summed in fp32 per micro-batch as DeepSpeed's
BF16_Optimizer does; the trainer's unfused run (its losses, grad norms, the gradients the optimizer steps on and
the weights after the steps); on a GPU, fp32 arithmetic.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gptpar.testing import run_distributed
from gptpar.testing.runs import ENGINE_MODEL

MICRO_BATCHES = 3


class _Pair(nn.Module):
    """A column- then a row-parallel linear (tp 1), bf16, as in a transformer MLP."""

    def __init__(self):
        super().__init__()
        from gptpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        torch.manual_seed(0)
        self.fc1 = ColumnParallelLinear(32, 64, dtype=torch.bfloat16)
        self.fc2 = RowParallelLinear(64, 32, dtype=torch.bfloat16)
        with torch.no_grad():
            self.fc1.bias.normal_()
            self.fc2.bias.normal_()

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _micro_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 8, 32, generator=g).to(torch.bfloat16),
             torch.randn(2, 8, 32, generator=g).to(torch.bfloat16)) for _ in range(MICRO_BATCHES)]


def _run(fused: bool, compiled: bool, x_requires_grad: bool = True):
    """fp32 sums of the weight gradients over the micro-batches, the other gradients, and whether autograd saw a
    weight gradient. All forwards run before the backwards (in reverse order), as a pipeline keeps micro-batches
    in flight: a fused backward must not invalidate what autograd saved for the others."""
    model = _Pair()
    weights = [model.fc1.weight, model.fc2.weight]
    sums = [torch.zeros(w.shape) for w in weights]
    if fused:
        for w, s in zip(weights, sums):
            w.main_grad = s
    if compiled:
        model.compile(backend="inductor")
    inputs, outs = [], []
    for x, _ in _micro_batches():
        x = x.clone().requires_grad_(x_requires_grad)
        inputs.append(x)
        outs.append(model(x))
    saw_weight_grad = False
    for out, x, (_, g) in reversed(list(zip(outs, inputs, _micro_batches()))):
        out.backward(g)
        for w, s in zip(weights, sums):  # DeepSpeed's unfused path: each bf16 gradient added in fp32
            if w.grad is not None:
                saw_weight_grad = True
                s.add_(w.grad)
                w.grad = None
    others = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    input_grads = [x.grad for x in inputs]
    return sums, others, input_grads, saw_weight_grad


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to a bf16 rounding of a summand (a GEMM kernel may round differently for another layout):
    a missing or doubled micro-batch is a third of the sum or more."""
    return bool((a.float() - b.float()).abs().max() <= 2 ** -7 * b.float().abs().max())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_backward_accumulates_every_micro_batch_once(compiled):
    ref_sums, ref_others, ref_input_grads, ref_saw = _run(fused=False, compiled=compiled)
    sums, others, input_grads, saw = _run(fused=True, compiled=compiled)
    assert ref_saw and not saw  # fused: autograd never held a weight gradient
    for fused_sum, ref in zip(sums, ref_sums):
        assert fused_sum.abs().sum() > 0 and _close(fused_sum, ref)
    assert others.keys() == ref_others.keys() == {"fc1.bias", "fc2.bias"}
    for name in others:
        assert torch.equal(others[name], ref_others[name])
    for mine, ref in zip(input_grads, ref_input_grads):
        assert torch.equal(mine, ref)


def test_an_input_without_gradient_falls_back_to_autograd():
    """The fused op returns the input gradient (a compiled graph keeps it for that); with no input gradient to
    return, the layer hands autograd its weight gradient, which DeepSpeed adds into the same buffer."""
    ref_sums, _, _, _ = _run(fused=False, compiled=False, x_requires_grad=False)
    sums, _, _, saw = _run(fused=True, compiled=False, x_requires_grad=False)
    assert saw
    for fused_sum, ref in zip(sums, ref_sums):
        assert torch.equal(fused_sum, ref)


# -- the word embedding: its lookup and the tied output layer (fused loss and plain logits) -------------------

VOCAB, REAL_VOCAB, HIDDEN = 256, 250, 32  # the table padded past the real vocabulary, as a model's is


def _tied_run(fused: bool, group=None):
    """The fp32 sum of a bf16 word embedding's gradients over micro-batches in flight, and whether autograd saw
    one: each micro-batch looks its ids up (repeated ids among them), and the table is also the output layer of
    the fused loss (`linear_cross_entropy`) and of plain logits (`lm_logits`'s `linear_with_grad_all_reduce`)."""
    from gptpar.tensor_parallel import VocabParallelEmbedding
    from gptpar.tensor_parallel.comm import group_size
    from gptpar.tensor_parallel.cross_entropy import linear_cross_entropy
    from gptpar.tensor_parallel.layers import linear_with_grad_all_reduce

    torch.manual_seed(0)
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, group=group, dtype=torch.bfloat16)
    total = torch.zeros(emb.weight.shape)
    if fused:
        emb.weight.main_grad = total
    g = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(0, REAL_VOCAB, (2, 24), generator=g) for _ in range(2))
               for _ in range(MICRO_BATCHES)]  # (ids, labels)
    losses = []
    for ids, labels in batches:
        hidden = torch.tanh(emb(ids) * 20)  # a nonlinearity: the output layer's input depends on the lookup
        main_grad = getattr(emb.weight, "main_grad", None)
        logits = linear_with_grad_all_reduce(hidden, emb.weight, None, group, main_grad)
        ce = linear_cross_entropy(hidden, emb.weight, labels, group=group, vocab_size=REAL_VOCAB)
        losses.append(ce.mean() + logits.float().pow(2).mean() * group_size(group))
    saw_weight_grad = False
    for loss in reversed(losses):
        loss.backward()
        if emb.weight.grad is not None:  # DeepSpeed's unfused path: each bf16 gradient added in fp32
            saw_weight_grad = True
            total.add_(emb.weight.grad)
            emb.weight.grad = None
    return total, saw_weight_grad


def _assert_tied_fused_equals_unfused(group=None):
    ref, ref_saw = _tied_run(fused=False, group=group)
    fused, saw = _tied_run(fused=True, group=group)
    assert ref_saw and not saw
    assert fused.abs().sum() > 0 and _close(fused, ref), float((fused - ref).abs().max())


def test_tied_embedding_accumulates_lookup_and_output_layer_gradients():
    _assert_tied_fused_equals_unfused()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_embedding_lookup_adds_repeated_ids_in_fp32(device):
    """The fused lookup's gradient is the fp32 sum of every position's bf16 gradient, however often an id repeats
    (a CPU's own bf16 embedding backward sums them in bf16), and the same bits when run again (CUDA's accumulating
    index_put_ sorts the ids; a CPU's index_add_ adds them in order; a CPU's accumulating index_put_ does not).
    How far off each of those is: bench/results/HISTORY.md (gradient-accumulation fusion, the word embedding)."""
    from gptpar.tensor_parallel.grad_accumulation import embedding_into_main_grad

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(4, HIDDEN, generator=g).to(torch.bfloat16).to(device).requires_grad_()
    ids = torch.zeros(2000, dtype=torch.long)
    ids[::3] = 1
    ids[::7] = 3
    grad = torch.randn(2000, HIDDEN, generator=g).to(torch.bfloat16)
    ids, grad = ids.to(device), grad.to(device)
    sums = []
    for _ in range(2):
        main_grad = torch.ones(4, HIDDEN, device=device)
        out = embedding_into_main_grad(ids, weight, main_grad)
        assert torch.equal(out, F.embedding(ids, weight))
        out.backward(grad)
        assert weight.grad is None
        sums.append(main_grad)
    exact = torch.ones(4, HIDDEN, dtype=torch.float64, device=device).index_add_(0, ids, grad.double())
    assert float((sums[0].double() - exact).norm() / exact.norm()) < 1e-6
    assert torch.equal(sums[0], sums[1])


def _tied_tp2():
    from gptpar.parallel import init_parallel

    _assert_tied_fused_equals_unfused(init_parallel(2, 1, 1).tp_group)


def test_tied_embedding_accumulates_at_tp2():
    """Each rank's rows: ids of the other rank's rows looked up as zeros (no gradient), the loss's softmax over
    both ranks, the last rank's padding rows outside the loss's GEMM on a CPU."""
    run_distributed(_tied_tp2, 2, timeout=120)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_fused_gemm_accumulates_in_fp32_cuda(device):
    """On a GPU the weight-gradient GEMM adds into the fp32 buffer itself: closer to fp32 arithmetic than the
    bf16 gradient added afterwards, and available in the torch the GPU image has."""
    from gptpar.tensor_parallel.grad_accumulation import accumulate_weight_grad_, fused_accumulation_unavailable

    assert fused_accumulation_unavailable(torch.device(device)) is None
    g = torch.Generator(device=device).manual_seed(0)
    fused = torch.zeros(256, 512, device=device)
    unfused = torch.zeros_like(fused)
    exact = torch.zeros_like(fused, dtype=torch.float64)
    for _ in range(MICRO_BATCHES):
        grad = torch.randn(4096, 256, device=device, generator=g).to(torch.bfloat16)
        x = torch.randn(4096, 512, device=device, generator=g).to(torch.bfloat16)
        accumulate_weight_grad_(fused, grad, x)
        unfused.add_(grad.t().mm(x))
        exact += grad.double().t() @ x.double()
    fused_error = (fused.double() - exact).norm() / exact.norm()
    unfused_error = (unfused.double() - exact).norm() / exact.norm()
    # fp32 sums of exact bf16 products: ~1e-6 relative; one bf16 rounding per micro-batch's product: ~1e-3
    assert fused_error < 1e-4 and fused_error < unfused_error / 4, (fused_error, unfused_error)


# -- the trainer's engine: fused and unfused runs take the same steps ------------------------------------------

TINY = dict(ENGINE_MODEL, hidden_dropout=0.0, attention_dropout=0.0)


def _steps(pstate, fusion):
    """Three bf16 steps of 4 micro-batches with `training.gradient_accumulation_fusion = fusion`: the losses, grad
    norms, the fp32 gradient the optimizer steps on at each step, the weights after, and what the engine says."""
    from gptpar.training.batches import SyntheticDataset, rank_micro_batches
    from gptpar.training.assembly import build_model, seed_everything
    from gptpar.config import config_from_dict
    from gptpar.training.engine import build_engine, deepspeed_config

    tp, pp = pstate.tp_size, pstate.pp_size
    cfg = config_from_dict({"model": dict(TINY), "parallel": {"tensor_model_parallel_size": tp,
                                                              "pipeline_model_parallel_size": pp,
                                                              "sequence_parallel": tp > 1},
                            "training": {"micro_batch_size": 1, "global_batch_size": 4, "train_iters": 3,
                                         "precision": "bf16", "zero_stage": 1, "lr": 1e-2, "clip_grad": 0.5,
                                         "gradient_accumulation_fusion": fusion},
                            "data": {"synthetic": True}})
    t = cfg.training
    model = build_model(cfg, pstate, seed_everything(t.seed, pstate))
    engine = build_engine(model, pstate, deepspeed_config(cfg, pstate.dp_size), lr=t.lr, weight_decay=0.1,
                          gradient_accumulation_fusion=fusion)
    stepped = []
    inner = engine.ds.optimizer.optimizer
    inner.register_step_pre_hook(lambda opt, args, kwargs: stepped.append(
        torch.cat([p.grad.detach().reshape(-1).clone() for g in opt.param_groups for p in g["params"]])))
    losses, norms = [], []
    data = SyntheticDataset(TINY["vocab_size"], TINY["seq_length"], 7)
    for step in range(3):
        texts = rank_micro_batches(data, step * t.global_batch_size, t.global_batch_size, t.micro_batch_size,
                                   pstate.dp_rank, pstate.dp_size)
        losses.append(engine.train_step([{"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()}
                                         for x in texts]))
        norms.append(engine.grad_norm)
    gemm = [n for n, p in engine.named_parameters() if hasattr(p, "main_grad")]
    grads_seen = [n for n, p in engine.named_parameters() if p.grad is not None]
    weights = torch.cat([p.detach().float().reshape(-1) for p in engine.parameters()])
    return losses, norms, stepped, weights, gemm, grads_seen, engine.precision_plan()


def _fused_and_unfused(tp, pp):
    from gptpar.parallel import init_parallel

    pstate = init_parallel(tp, pp, 1)
    return {fusion: _steps(pstate, fusion) for fusion in (True, False)}


def test_fused_training_takes_the_unfused_steps():
    """tp 2 with sequence parallelism x pp 2 (1F1B keeps two micro-batches in flight on the first stage, the
    tied embedding's gradient is all-reduced between the stages), clipping active: every rank's losses, grad
    norms (DeepSpeed's norm over the flagged fp32 gradients: a fused weight left out would change them) and
    stepped gradients equal the unfused run's up to bf16 roundings, and so do the weights after three steps.
    Fused: the four GEMM weights of each stage's layer and the word embedding on both stages (the lookup on the
    first, the tied output layer on the last)."""
    for rank, runs in enumerate(run_distributed(_fused_and_unfused, 4, (2, 2), timeout=400)):
        losses, norms, stepped, weights, gemm, grads_seen, plan = runs[True]
        ref_losses, ref_norms, ref_stepped, ref_weights, ref_gemm, _, ref_plan = runs[False]
        # each stage holds one layer: qkv, dense, fc1, fc2 weights fused; and the word embedding, looked up on
        # the first stage, the output layer on the last (its tied copy); nothing else
        assert sorted(n.rsplit(".", 2)[-2] for n in gemm) == ["dense", "dense_4h_to_h", "dense_h_to_4h",
                                                               "query_key_value", "word_embeddings"], gemm
        assert not ref_gemm and "gradient-accumulation fusion: 4 GEMM weights and the word embedding" in plan
        assert "fusion" not in ref_plan
        assert not set(gemm) & set(grads_seen)
        assert losses == pytest.approx(ref_losses, rel=1e-4)
        assert min(ref_norms) > 0.5  # the clip (0.5) is active: the norm decides the step
        # Step 1 equals the unfused step up to the unfused run's own bf16 roundings: on a CPU the embedding's
        # backward sums a repeated id's gradients in bf16 (the rows that differ: tp rank 1's row 0, where the
        # other rank's ids are looked up as masked zeros, ~4e-4 of the step's gradient), the fused lookup in fp32. Those roundings move a few fp32
        # weights (Adam turns a near-zero gradient's sign into a full step), the bf16 copies round differently,
        # and from step 2 the runs differ at bf16 level; a missing, doubled or stale micro-batch moves a step's
        # gradient by a quarter or more.
        assert norms[0] == pytest.approx(ref_norms[0], rel=1e-4) and norms == pytest.approx(ref_norms, rel=2e-3)
        errors = [float((mine - ref).norm() / ref.norm()) for mine, ref in zip(stepped, ref_stepped)]
        assert errors[0] < 1e-3 and max(errors) < 2e-2, (rank, errors)
        assert float((weights - ref_weights).norm() / ref_weights.norm()) < 1e-2
