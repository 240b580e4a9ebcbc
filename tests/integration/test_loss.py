"""The cheaper loss: vocab-parallel cross-entropy read in fp32 blocks, and the output layer fused with it.

References, each computed independently of gptpar's loss code:
  - F.cross_entropy on the gathered (full) logits, in fp32 - the serial model's loss;
  - the previous algorithm written out in autograd ops: the whole shard copied to fp32, max all-reduced, exp summed
    and all-reduced, the target logit all-reduced (all-reduces whose backward is the identity, Megatron's g).
Losses and gradients (logits, hidden, weight) must agree to fp32 accuracy (1e-6) at tp 1 and 2, with padding
(including a rank whose slice is all padding), ignore_index, label smoothing, rows spanning several blocks, and
bf16 logits (whose loss must equal the fp32 loss of the same bf16 values). Memory is counted, not timed: no fp32
tensor of the logits' size is created any more (`LiveTensorBytes`).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from gptpar.tensor_parallel import cross_entropy
from gptpar.tensor_parallel.cross_entropy import linear_cross_entropy, vocab_parallel_cross_entropy
from gptpar.testing import LiveTensorBytes, run_distributed

TOL = dict(rtol=1e-6, atol=1e-6)
V, H = 32, 8  # padded vocab (all ranks together), hidden size


def _shard(t, rank, world):
    return t.chunk(world, dim=-1)[rank] if t.dim() == 3 else t.chunk(world, dim=0)[rank]


def _previous_algorithm(shard, target, group, vocab_size, label_smoothing):
    """Megatron's vocab-parallel cross-entropy as gptpar computed it before: on a full fp32 copy of the shard."""
    rank, local = dist.get_rank(group), shard.shape[-1]
    start = rank * local
    x = shard.float()
    padded = torch.arange(start, start + local) >= vocab_size
    x = x.masked_fill(padded, float("-inf"))
    top = x.max(dim=-1).values.detach()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    x = x - top.unsqueeze(-1)
    here = (target >= start) & (target < start + local)
    local_t = (target - start).masked_fill(~here, 0)
    picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
    sums = [picked, x.exp().sum(-1), x.masked_fill(padded, 0.0).sum(-1)]
    sums = [s + (_all_reduced(s.detach(), group) - s.detach()) for s in sums]  # sum forward, identity backward
    lse = sums[1].log()
    loss = (1 - label_smoothing) * (lse - sums[0]) + label_smoothing * (lse - sums[2] / vocab_size)
    return loss.masked_fill(target == -100, 0.0)


def _all_reduced(t, group):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _case(seed, rows=11, cols=3):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, cols, V, generator=g)
    hidden = torch.randn(rows, cols, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H ** 0.5
    upstream = torch.rand(rows, cols, generator=g)
    return logits, hidden, weight, upstream


def _targets(seed, vocab_size, rows=11, cols=3):
    target = torch.randint(0, vocab_size, (rows, cols), generator=torch.Generator().manual_seed(seed))
    target[0, 0] = target[7, 2] = -100
    return target


def _check_logits_loss(group, vocab_size, label_smoothing, dtype, compiled=False):
    """vocab_parallel_cross_entropy on this rank's shard against both references: losses and logits' gradients."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    logits, _, _, upstream = _case(1)
    logits = logits.to(dtype).float()  # the values a bf16 model would hand the loss, exactly representable
    target = _targets(2, vocab_size)
    full = logits.clone().requires_grad_()
    serial = F.cross_entropy(full[..., :vocab_size].reshape(-1, vocab_size), target.reshape(-1), reduction="none",
                             label_smoothing=label_smoothing).view(target.shape)
    serial.backward(upstream)
    ref_shard = _shard(logits, rank, tp).clone().requires_grad_()
    previous = _previous_algorithm(ref_shard, target, group, vocab_size, label_smoothing)
    previous.backward(upstream)
    for inplace in (False, True):
        shard = _shard(logits, rank, tp).to(dtype).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, target, group=group, vocab_size=vocab_size,
                                            label_smoothing=label_smoothing, inplace_backward=inplace,
                                            compiled=compiled)
        assert loss.dtype == torch.float32 and loss[0, 0] == 0 and loss[7, 2] == 0
        assert_close(loss, serial.detach(), **TOL)
        assert_close(loss, previous.detach(), **TOL)
        loss.backward(upstream)
        assert shard.grad.dtype == dtype
        tol = TOL if dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-6)  # bf16: fp32's, rounded once
        assert_close(shard.grad.float(), _shard(full.grad, rank, tp), **tol)
        assert_close(shard.grad.float(), ref_shard.grad, **tol)
        assert shard.grad[0, 0].abs().max() == 0  # ignored token: no gradient


def _check_linear_loss(group, vocab_size, label_smoothing, compiled=False):
    """linear_cross_entropy (hidden replicated, this rank's weight rows) against F.linear + F.cross_entropy on the
    full weight: losses, the hidden's gradient (summed over tp inside) and this rank's weight rows' gradient."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    _, hidden, weight, upstream = _case(3)
    target = _targets(4, vocab_size)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    serial = F.cross_entropy(F.linear(h_ref, w_ref[:vocab_size]).reshape(-1, vocab_size), target.reshape(-1),
                             reduction="none", label_smoothing=label_smoothing).view(target.shape)
    serial.backward(upstream)
    h, w = hidden.clone().requires_grad_(), _shard(weight, rank, tp).clone().requires_grad_()
    loss = linear_cross_entropy(h, w, target, group=group, vocab_size=vocab_size, label_smoothing=label_smoothing,
                                compiled=compiled)
    assert_close(loss, serial.detach(), **TOL)
    loss.backward(upstream)
    assert_close(h.grad, h_ref.grad, **TOL)
    assert_close(w.grad, _shard(w_ref.grad, rank, tp), **TOL)
    real = min(V // tp, max(0, vocab_size - rank * (V // tp)))  # this rank's rows below vocab_size
    assert not w.grad[real:].any()  # padding rows: exactly zero


def _all_checks(block_elements):
    """Every case on this rank's tp group (the whole world), with blocks of `block_elements` elements."""
    group = dist.group.WORLD
    cross_entropy._BLOCK_ELEMENTS["cpu"] = block_elements  # this spawned process only
    # vocab 15 at tp 2: rank 1's 16 columns are all padding; 29: a partial last slice; 32: no padding.
    for vocab_size in (32, 29, 15):
        for label_smoothing in (0.0, 0.1):
            _check_logits_loss(group, vocab_size, label_smoothing, torch.float32)
            _check_linear_loss(group, vocab_size, label_smoothing)
        _check_logits_loss(group, vocab_size, 0.0, torch.bfloat16)
    return "ok"


def _compiled_checks():
    """The compiled kernels (training.compile) on the same cases: a partial last slice (and at tp 2 a rank of
    padding only, which keeps the loop's -inf), label smoothing, bf16 logits; and they did compile."""
    from torch._dynamo.utils import counters

    group = dist.group.WORLD
    for vocab_size in (29, 15):
        for label_smoothing in (0.0, 0.1):
            _check_logits_loss(group, vocab_size, label_smoothing, torch.float32, compiled=True)
            _check_linear_loss(group, vocab_size, label_smoothing, compiled=True)
    _check_logits_loss(group, 29, 0.0, torch.bfloat16, compiled=True)
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])  # forward and backward kernels
    return "ok"


@pytest.mark.parametrize("tp", [1, 2])
def test_compiled_loss_kernels_match_serial_and_previous_algorithm(tp):
    assert run_distributed(_compiled_checks, tp, timeout=400) == ["ok"] * tp


def _post_grad_graphs(cases):
    """Inductor's post-grad graph (as text) of each compiled `fn(*args)` in `cases` {name: (fn, args)}, as on a
    GPU: the online-softmax pattern's CUDA-only check is lifted (in this spawned process only, before any compile
    registers the patterns), the graph recorded and the compile stopped there (the CPU's C++ backend has no
    online-softmax kernel)."""
    import torch._inductor.config as inductor_config
    import torch._inductor.fx_passes.post_grad as post_grad
    from torch._inductor.custom_graph_pass import CustomGraphPass

    post_grad.prepare_softmax_extra_check = lambda match: True

    class Recorded(Exception):
        pass

    class Record(CustomGraphPass):
        def __call__(self, graph):
            raise Recorded(str(graph))

        def uuid(self):
            return None

    inductor_config.post_grad_custom_post_pass = Record()
    inductor_config.fx_graph_cache = False
    graphs = {}
    for name, (fn, args) in cases.items():
        torch._dynamo.reset()
        try:
            torch.compile(fn)(*args)
        except Exception as error:  # noqa: BLE001 - Recorded, wrapped by inductor
            cause = error
            while cause is not None and not isinstance(cause, Recorded):
                cause = cause.__cause__ or cause.__context__
            assert cause is not None, error
            graphs[name] = cause.args[0]
    return graphs


def _row_kernel_cases():
    """The compiled row kernels on bf16 logits 40 wide whose last 3 columns are padding (37 real)."""
    logits = torch.randn(6, 40).bfloat16()
    target = torch.tensor([0, 3, 36, 7, 1, 2])
    here, lse, g = torch.ones(6, dtype=torch.bool), torch.randn(6), torch.rand(6)
    return {"forward": (lambda x: cross_entropy._rows_forward(x, target, here, 37, False)[0], (logits,)),
            "backward": (lambda x: cross_entropy._rows_backward_(x, lse, target, here, g, 37, 0.0, 37), (logits,)),
            "torch.logsumexp": (lambda x: torch.logsumexp(x[:, :37].float(), dim=-1), (logits,))}


def _online_softmax_matched():
    cases = _row_kernel_cases()
    graphs = _post_grad_graphs({name: cases[name] for name in ("forward", "torch.logsumexp")})
    return {name: "prepare_softmax_online" in graph for name, graph in graphs.items()}


def test_compiled_loss_forward_is_one_online_softmax_pass_on_a_gpu():
    """The compiled loss's log-sum-exp is in the form inductor turns into one pass over the logits on a GPU
    (online softmax); torch.logsumexp, which it replaced, is not (two passes: ~2x the bytes of an 8192 x 50304
    bf16 logits tensor per micro-batch at 1.3B)."""
    assert run_distributed(_online_softmax_matched, 1, timeout=300)[0] == {"forward": True, "torch.logsumexp": False}


def _column_slices():
    cases = _row_kernel_cases()
    graphs = _post_grad_graphs({name: cases[name] for name in ("forward", "backward", "torch.logsumexp")})
    return {name: [op for op in ("aten.slice", "aten.constant_pad_nd") if op in graph]
            for name, graph in graphs.items()}


def test_compiled_loss_kernels_read_whole_rows():
    """The compiled kernels read and write the logits' whole rows, padding columns included, and mask those in
    registers: no column slice (logits[:, :real]) nor pad in their graphs. On a GPU such a slice of an odd width
    (50257 of 50304) becomes a load mask that keeps Triton from vectorizing: 2-byte loads instead of 16-byte ones
    in the generated sm_90 code (gptpar/tensor_parallel/cross_entropy.py, `_real_mask`). The slicing form is
    checked to show up (torch.logsumexp on the slice), so the check can fail."""
    assert run_distributed(_column_slices, 1, timeout=300)[0] == {"forward": [], "backward": [],
                                                                  "torch.logsumexp": ["aten.slice"]}


@pytest.mark.parametrize("tp", [1, 2])
def test_loss_matches_serial_and_previous_algorithm(tp):
    # 40 elements a block: 2 or 1 rows of 16-32 columns, so 33 rows span many blocks and end on a partial one.
    assert run_distributed(_all_checks, tp, args=(40,), timeout=240) == ["ok"] * tp


def test_no_fp32_copy_of_the_logits(monkeypatch):
    """bf16 logits (N, V): the loss's forward and backward create no tensor as large as the logits in fp32 (the
    previous code made three), and with inplace_backward none as large as the logits at all; the peak of what they
    create is a few blocks. The fused path creates the logits once and nothing that large besides."""
    monkeypatch.setitem(cross_entropy._BLOCK_ELEMENTS, "cpu", 1 << 20)  # blocks a quarter of the logits
    n, v, h = 4096, 1000, 16
    rows = cross_entropy._block_rows(v, torch.device("cpu"))
    assert rows < n  # several blocks
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, v, (n,), generator=g)
    logits_bytes = n * v * 2
    for inplace in (False, True):
        logits = torch.randn(n, v, generator=g).to(torch.bfloat16).requires_grad_()
        with LiveTensorBytes() as m:
            vocab_parallel_cross_entropy(logits, target, inplace_backward=inplace).sum().backward()
        assert m.largest < (logits_bytes if inplace else logits_bytes + 1)  # the gradient copy, when not in place
        assert m.peak <= (0 if inplace else logits_bytes) + 3 * rows * v * 4 + 64 * n
    hidden = torch.randn(n, h, generator=g).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(torch.bfloat16).requires_grad_()
    with LiveTensorBytes() as m:
        linear_cross_entropy(hidden, weight, target).sum().backward()
    assert sorted(b for b, _ in m.created)[-2] < logits_bytes  # only the logits buffer is that large
    assert m.peak <= logits_bytes + 3 * rows * v * 4 + 64 * n + 2 * weight.numel() * 2 + hidden.numel() * 2


def test_linear_loss_under_autocast_runs_the_gemm_in_bf16():
    """fp32 parameters under bf16 autocast (bench/bench_single_rank.py's bf16 mode): the GEMM in bf16, the loss in
    fp32 from those bf16 logits, gradients back in fp32."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(64, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    target = torch.randint(0, 30, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, target, vocab_size=30)
    logits = F.linear(hidden.bfloat16(), weight.bfloat16()[:30]).float()
    assert loss.dtype == torch.float32
    assert_close(loss, F.cross_entropy(logits, target, reduction="none"), **TOL)
    loss.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32 and weight.grad[30:].abs().max() == 0
