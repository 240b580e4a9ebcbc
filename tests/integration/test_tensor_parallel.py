"""Tensor-parallel layers against their serial counterparts (same seed, sliced by the documented rule).

One spawn per tp size runs every case; each case builds the serial module (group=None) and the sharded
one from the same seed and compares forward outputs, input gradients and this rank's parameter gradients.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

from gptpar.parallel import init_parallel
from gptpar.tensor_parallel.cross_entropy import LogitsWorkspace, linear_cross_entropy
from gptpar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                    model_parallel_seed, vocab_parallel_cross_entropy)
from gptpar.testing import run_distributed

S, B, H = 8, 3, 12  # sequence, batch, hidden: small, divisible by tp in {1, 2, 4}


def _block(t, rank, world, dim):
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n)


def _pair(cls, *args, group, seed=1, **kw):
    torch.manual_seed(seed)
    ref = cls(*args, **{k: v for k, v in kw.items() if k in ("bias", "init_method")})
    torch.manual_seed(seed)
    return ref, cls(*args, group=group, **kw)


def _check_column(st, gather_output):
    g, r, w = st.tp_group, st.tp_rank, st.tp_size
    ref, tp = _pair(ColumnParallelLinear, H, 2 * H, group=g, gather_output=gather_output)
    assert_close(tp.weight, _block(ref.weight, r, w, 0))
    assert tp.weight.tensor_model_parallel and tp.weight.partition_dim == 0 and tp.weight.partition_stride == 1
    torch.manual_seed(2)
    x = torch.randn(S, B, H, requires_grad=True)
    dy = torch.randn(S, B, 2 * H)
    ref(x).backward(dy)
    x2 = x.detach().clone().requires_grad_()
    y = tp(x2)
    if gather_output:
        assert_close(y, ref(x))
        y.backward(dy)
    else:
        assert_close(y, _block(ref(x), r, w, -1))
        y.backward(_block(dy, r, w, -1))
    assert_close(x2.grad, x.grad)
    assert_close(tp.weight.grad, _block(ref.weight.grad, r, w, 0))
    assert_close(tp.bias.grad, _block(ref.bias.grad, r, w, 0))


def _check_row(st, input_is_parallel):
    g, r, w = st.tp_group, st.tp_rank, st.tp_size
    ref, tp = _pair(RowParallelLinear, 2 * H, H, group=g, input_is_parallel=input_is_parallel)
    assert_close(tp.weight, _block(ref.weight, r, w, 1))
    assert tp.weight.partition_dim == 1 and not hasattr(tp.bias, "tensor_model_parallel")
    torch.manual_seed(3)
    x = torch.randn(S, B, 2 * H, requires_grad=True)
    dy = torch.randn(S, B, H)
    ref(x).backward(dy)
    x2 = (_block(x, r, w, -1) if input_is_parallel else x).detach().clone().requires_grad_()
    y = tp(x2)
    assert_close(y, ref(x))
    y.backward(dy)
    assert_close(x2.grad, _block(x.grad, r, w, -1) if input_is_parallel else x.grad)
    assert_close(tp.weight.grad, _block(ref.weight.grad, r, w, 1))
    assert_close(tp.bias.grad, ref.bias.grad)


def _check_mlp(st, sequence_parallel):
    """Column -> GELU -> Row, with or without sequence parallelism, against the serial block."""
    g, r, w = st.tp_group, st.tp_rank, st.tp_size
    torch.manual_seed(4)
    ref1, ref2 = ColumnParallelLinear(H, 4 * H), RowParallelLinear(4 * H, H)
    torch.manual_seed(4)
    tp1 = ColumnParallelLinear(H, 4 * H, group=g, sequence_parallel=sequence_parallel)
    tp2 = RowParallelLinear(4 * H, H, group=g, sequence_parallel=sequence_parallel)
    torch.manual_seed(5)
    x = torch.randn(S, B, H, requires_grad=True)
    dy = torch.randn(S, B, H)
    y_ref = ref2(F.gelu(ref1(x)))
    y_ref.backward(dy)
    x2 = (_block(x, r, w, 0) if sequence_parallel else x).detach().clone().requires_grad_()
    y = tp2(F.gelu(tp1(x2)))
    assert_close(y, _block(y_ref, r, w, 0) if sequence_parallel else y_ref)
    y.backward(_block(dy, r, w, 0) if sequence_parallel else dy)
    if sequence_parallel:
        assert tp2.bias.sequence_parallel
    assert_close(x2.grad, _block(x.grad, r, w, 0) if sequence_parallel else x.grad)
    assert_close(tp1.weight.grad, _block(ref1.weight.grad, r, w, 0))
    assert_close(tp1.bias.grad, _block(ref1.bias.grad, r, w, 0))
    assert_close(tp2.weight.grad, _block(ref2.weight.grad, r, w, 1))
    assert_close(tp2.bias.grad, ref2.bias.grad)


def _check_embedding(st):
    g, r, w = st.tp_group, st.tp_rank, st.tp_size
    V = 16
    ref, tp = _pair(VocabParallelEmbedding, V, H, group=g)
    assert_close(tp.weight, _block(ref.weight, r, w, 0))
    assert (tp.vocab_start, tp.vocab_end) == (r * V // w, (r + 1) * V // w)
    ids = torch.tensor([[0, 15, 3, 8], [7, 4, 12, 0]])  # ids in every shard, one repeated
    dy = torch.randn(2, 4, H)
    ref(ids).backward(dy)
    y = tp(ids)
    assert_close(y, ref(ids))
    assert_close(y, F.embedding(ids, ref.weight))
    y.backward(dy)
    assert_close(tp.weight.grad, _block(ref.weight.grad, r, w, 0))


def _check_cross_entropy(st, label_smoothing, vocab_size):
    g, r, w = st.tp_group, st.tp_rank, st.tp_size
    V = 32
    torch.manual_seed(6)
    logits = (3 * torch.randn(10, 4, V)).requires_grad_()
    real = vocab_size or V
    target = torch.randint(0, real, (10, 4))
    target[0, 0] = target[5, 3] = -100
    ref = F.cross_entropy(logits[..., :real].reshape(-1, real), target.reshape(-1), reduction="none",
                          ignore_index=-100, label_smoothing=label_smoothing).view(10, 4)
    dloss = torch.rand(10, 4)
    ref.backward(dloss)
    shard = _block(logits, r, w, -1).detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, group=g, label_smoothing=label_smoothing,
                                        vocab_size=vocab_size)
    assert loss.shape == target.shape and loss[0, 0] == 0 and loss[5, 3] == 0
    assert_close(loss, ref)
    loss.backward(dloss)
    assert_close(shard.grad, _block(logits.grad, r, w, -1))


def _check_rng(st):
    """Outside tp regions every tp rank draws the same mask; inside the tracker's stream they differ."""
    g = st.tp_group
    tracker = model_parallel_seed(1234, tp_rank=st.tp_rank)
    shared = F.dropout(torch.ones(64), p=0.5)
    with tracker.fork():
        private = F.dropout(torch.ones(64), p=0.5)
    after_fork = torch.rand(8)
    torch.manual_seed(1234)  # the default stream must continue as if the fork had not happened
    F.dropout(torch.ones(64), p=0.5)
    assert_close(after_fork, torch.rand(8))
    gathered_shared = [torch.empty(64) for _ in range(st.tp_size)]
    gathered_private = [torch.empty(64) for _ in range(st.tp_size)]
    dist.all_gather(gathered_shared, shared, group=g)
    dist.all_gather(gathered_private, private, group=g)
    for other in gathered_shared[1:]:
        assert torch.equal(other, gathered_shared[0])
    for i in range(st.tp_size):
        for j in range(i + 1, st.tp_size):
            assert not torch.equal(gathered_private[i], gathered_private[j])


def _check_errors(st):
    if st.tp_size == 1:
        return
    with pytest.raises(ValueError, match="out_features 3"):
        ColumnParallelLinear(4, 3, group=st.tp_group)
    with pytest.raises(ValueError, match="in_features 5"):
        RowParallelLinear(5, 4, group=st.tp_group)
    with pytest.raises(ValueError, match="num_embeddings 7"):
        VocabParallelEmbedding(7, 4, group=st.tp_group)
    with pytest.raises(ValueError, match="world size"):
        init_parallel(tp=3)


def _all_cases(tp):
    st = init_parallel(tp=tp)
    assert st.tp_size == tp and st.pp_size == 1 and st.dp_size == 1
    for gather_output in (False, True):
        _check_column(st, gather_output)
    for input_is_parallel in (True, False):
        _check_row(st, input_is_parallel)
    for sequence_parallel in (False, True):
        _check_mlp(st, sequence_parallel)
    _check_embedding(st)
    for label_smoothing in (0.0, 0.1):
        for vocab_size in (None, 29):
            _check_cross_entropy(st, label_smoothing, vocab_size)
    if tp > 1:
        _check_rng(st)
    _check_errors(st)
    return "ok"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layers_match_serial(tp):
    assert run_distributed(_all_cases, tp, args=(tp,), timeout=240) == ["ok"] * tp


def test_group_none_is_plain_pytorch():
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(6, 10), RowParallelLinear(10, 6, bias=False)
    emb = VocabParallelEmbedding(20, 6)
    lin = nn.Linear(6, 10)
    with torch.no_grad():
        lin.weight.copy_(col.weight)
        lin.bias.copy_(col.bias)
    x = torch.randn(4, 6)
    assert_close(col(x), lin(x))
    assert_close(row(col(x)), F.linear(lin(x), row.weight))
    ids = torch.randint(0, 20, (3, 5))
    assert_close(emb(ids), F.embedding(ids, emb.weight))
    # Default init as Megatron: normal(0, 0.02) weights, zero biases.
    big = ColumnParallelLinear(256, 512)
    assert abs(big.weight.std().item() - 0.02) < 0.001 and big.bias.abs().sum() == 0


def test_init_is_independent_of_padding_rows():
    """A weight with extra rows at the end (a padded vocab) has the same leading rows."""
    torch.manual_seed(7)
    a = VocabParallelEmbedding(100, 8)
    torch.manual_seed(7)
    b = VocabParallelEmbedding(128, 8)
    assert_close(a.weight, b.weight[:100])


def test_meta_device_allocates_nothing():
    layer = ColumnParallelLinear(50_000, 200_000, device="meta")
    assert layer.weight.is_meta and layer.weight.shape == (200_000, 50_000)


def _linear_ce_reference(hidden, weight, target, vocab):
    return F.cross_entropy(F.linear(hidden, weight[:vocab]), target, reduction="none", ignore_index=-100)


def test_linear_cross_entropy_matches_torch():
    """The fused tp=1 output layer + loss against F.linear + F.cross_entropy: losses, both gradients (the
    padded rows' gradient is zero), ignore_index, per-token upstream gradients, rows not a multiple of the
    block size, and a workspace reused across steps."""
    torch.manual_seed(0)
    vocab, padded, h = 70, 80, 16
    weight = torch.randn(padded, h, requires_grad=True)
    workspace = LogitsWorkspace()
    for step in range(3):
        hidden = torch.randn(5, 9, h, requires_grad=True)  # 45 rows: one full block of 32 and a partial one
        target = torch.randint(0, vocab, (5, 9))
        target[1, 2] = -100
        upstream = torch.rand(5, 9)
        ref = _linear_ce_reference(hidden.reshape(-1, h), weight, target.reshape(-1), vocab).view(5, 9)
        ref_grads = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
        out = linear_cross_entropy(hidden, weight, target, vocab_size=vocab, workspace=workspace)
        grads = torch.autograd.grad((out * upstream).sum(), (hidden, weight))
        assert_close(out, ref)
        assert out[1, 2] == 0 and grads[0][1, 2].abs().max() == 0
        for got, want in zip(grads, ref_grads):
            assert_close(got, want)
        assert grads[1][vocab:].abs().max() == 0


def test_linear_cross_entropy_workspace_never_aliases_live_graphs():
    """Two forwards before their backwards (and a graph dropped unused) must not share a logits buffer."""
    torch.manual_seed(1)
    weight = torch.randn(40, 8, requires_grad=True)
    workspace = LogitsWorkspace()
    h1, h2 = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    t1, t2 = torch.randint(0, 40, (6,)), torch.randint(0, 40, (6,))
    linear_cross_entropy(h1, weight, t1, workspace=workspace).sum().backward()  # the workspace holds a buffer
    linear_cross_entropy(h1, weight, t1, workspace=workspace)  # dropped without backward
    linear_cross_entropy(h1, weight, t1, workspace=workspace).sum().backward()
    l1 = linear_cross_entropy(h1, weight, t1, workspace=workspace).sum()
    l2 = linear_cross_entropy(h2, weight, t2, workspace=workspace).sum()
    g2 = torch.autograd.grad(l2, h2)[0]  # backward in the other order
    g1 = torch.autograd.grad(l1, h1)[0]
    assert_close(g1, torch.autograd.grad(_linear_ce_reference(h1, weight, t1, 40).sum(), h1)[0])
    assert_close(g2, torch.autograd.grad(_linear_ce_reference(h2, weight, t2, 40).sum(), h2)[0])
