"""Precision through DeepSpeed on CPU/gloo: which optimizer each precision gets, the bytes it really
holds (against gptpar.estimate.memory), bf16's fp32 gradient accumulation and what it buys over bf16 accumulation.

fp16 needs an accelerator with fp16 support: the ranks patch DeepSpeed's CPU accelerator to say yes
(gptpar.training.engine.allow_fp16_on_cpu), so these tests do not depend on the CPU they run on.
"""
import logging
import math

import pytest
import torch

from gptpar.testing import run_distributed
from gptpar.testing.runs import engine_config, engine_for, synthetic_batches

# -- which optimizer, and what it holds -----------------------------------------------------------

# (precision, ZeRO stage, training.optimizer); mixed precision runs at ZeRO-1 only. bitsandbytes' 8-bit AdamW is
# measured where it steps on flat partitions (ZeRO-1), so every moment is 8-bit (without ZeRO it keeps fp32
# moments for tensors under 4096 elements, a large share of this tiny model: tests/integration/test_optimizer8bit.py).
CASES = [("fp32", 0, "adamw"), ("fp32", 1, "adamw"), ("bf16", 1, "adamw"), ("fp16", 1, "adamw"),
         ("fp32", 1, "adamw8bit"), ("bf16", 1, "adamw8bit")]


def _held_at_step(dp):
    """Per case: (precision plan, bytes per parameter held at the optimizer step, optimizer-state bytes per
    parameter after it)."""
    from gptpar.parallel import init_parallel
    from gptpar.training.engine import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    pstate = init_parallel(1, 1, dp)
    out = {}
    for precision, zero, optimizer in CASES:
        cfg = engine_config(precision, zero, dp=dp, optimizer=optimizer)
        engine = engine_for(cfg, pstate)
        inner = getattr(engine.ds.optimizer, "optimizer", engine.ds.optimizer)
        peak = {}

        def at_step(optimizer, args, kwargs, engine=engine, peak=peak):
            held = engine.held_state_bytes()
            if held["total"] > peak.get("total", 0):
                peak.update(held)

        handle = inner.register_step_pre_hook(at_step)
        for k in range(2):
            engine.train_step(synthetic_batches(cfg, pstate, consumed=k * cfg.training.global_batch_size))
        handle.remove()
        n = sum(p.numel() for p in engine.ds.module.parameters())
        # The optimizer's own state: the tensors the client AdamW steps on (fp32 master partitions, or the
        # parameters themselves) and their exp_avg / exp_avg_sq.
        master = [p for g in inner.param_groups for p in g["params"]]
        adam = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t) and t.dim()]
        own = {id(p) for p in engine.ds.module.parameters()}
        state = sum(t.numel() * t.element_size() for t in adam + [p for p in master if id(p) not in own])
        out[precision, zero, optimizer] = (engine.precision_plan(), peak["total"] / n, state / n)
    return out


@pytest.fixture(scope="module")
def held():
    return {1: run_distributed(_held_at_step, 1, (1,), timeout=300)[0],
            2: run_distributed(_held_at_step, 2, (2,), timeout=300)}


@pytest.mark.parametrize("precision, zero, optimizer", CASES)
def test_state_bytes_match_the_memory_estimate(held, precision, zero, optimizer):
    """gptpar.estimate.memory's bytes per parameter are what DeepSpeed's optimizers really hold at the step. bf16
    (BF16_Optimizer) is exact up to the flat buffers' alignment padding; ZeRO's gradient buckets free part of
    the full gradients before the step at dp > 1, so the others are upper bounds within 15%."""
    from gptpar.estimate.memory import state_bytes_per_param

    for dp in (1, 2):
        ranks = [held[1]] if dp == 1 else held[2]
        for per_rank in ranks:
            plan, measured, _ = per_rank[precision, zero, optimizer]
            estimate = state_bytes_per_param(precision, zero, dp, optimizer)
            tolerance = 0.01 if precision == "bf16" else 0.15
            assert measured <= estimate * (1 + 0.01) and measured >= estimate * (1 - tolerance), \
                (precision, zero, optimizer, dp, measured, estimate, plan)


@pytest.mark.parametrize("precision, zero, optimizer", CASES)
def test_zero1_shards_the_optimizer_state(held, precision, zero, optimizer):
    """ZeRO-1 semantics: each of 2 dp ranks holds half of the optimizer state (fp32 master copy + Adam's two
    moments, 12 bytes per parameter, 6.03 with 8-bit moments; 8 where fp32 at ZeRO-0 steps on the parameters
    themselves), bf16 too."""
    from gptpar.estimate.memory import MOMENT_BYTES

    one = held[1][precision, zero, optimizer][2]
    master = 0 if (precision, zero) == ("fp32", 0) else 4
    # 8-bit: bitsandbytes keeps fp32 moments for the no-decay group's partition (biases and LayerNorms, 1792
    # elements here, under its 4096 threshold), +0.1 bytes per parameter in this tiny model
    assert one == pytest.approx(master + MOMENT_BYTES[optimizer], rel=0.01 if optimizer == "adamw" else 0.03)
    for rank in held[2]:
        assert rank[precision, zero, optimizer][2] == pytest.approx(one / 2 if zero == 1 else one, rel=0.02), rank


def test_precision_plans_name_the_real_optimizers(held):
    plans = {case: held[2][0][case][0] for case in CASES}
    assert plans["bf16", 1, "adamw"] == ("precision plan: parameters bf16, gradient accumulation fp32, dp reduction "
                                         "fp32, master weights a fp32 copy of 0.5 of the parameters (partitioned "
                                         "over dp 2); optimizer "
                                         "BF16_Optimizer around AdamW; gradient-accumulation fusion: 8 GEMM weights "
                                         "and the word embedding (lookup and tied output layer) add their gradients "
                                         "into the fp32 buffers after each GEMM (a CPU has no fp32-output one)")
    assert "parameters fp32, gradient accumulation fp32, dp reduction fp32, master weights the parameters " \
           "themselves; optimizer AdamW" in plans["fp32", 0, "adamw"]
    assert "optimizer DeepSpeedZeroOptimizer around AdamW" in plans["fp32", 1, "adamw"]
    assert "parameters fp16, gradient accumulation fp16, dp reduction fp16, master weights a fp32 copy of 0.5 " \
           "of the parameters (partitioned over dp 2); optimizer DeepSpeedZeroOptimizer" in plans["fp16", 1, "adamw"]
    assert plans["fp32", 1, "adamw8bit"].endswith("optimizer DeepSpeedZeroOptimizer around AdamW8bit")
    assert "optimizer BF16_Optimizer around AdamW8bit; gradient-accumulation fusion: 8" in plans["bf16", 1, "adamw8bit"]
    assert not any("fusion" in plan for (precision, _, _), plan in plans.items() if precision != "bf16")


# -- why fp16 never runs at ZeRO-0: DeepSpeed does not scale the loss there ---------------------------

def _fp16_stage0_gradient_over_plain_gradient():
    """engine.backward's gradient / the module's own unscaled gradient, at DeepSpeed's fp16 ZeRO-0, with a
    loss scale of 1024 in force (one micro-batch: no accumulation division)."""
    from gptpar.parallel import init_parallel
    from gptpar.training.engine import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    pstate = init_parallel(1, 1, 1)
    cfg = engine_config("fp16", 1, micro_batches=1, initial_loss_scale=1024, clip_grad=0.0)
    engine = engine_for(cfg, pstate, ds_edit=lambda ds: ds.update(zero_optimization={"stage": 0}))
    assert type(engine.ds.optimizer).__name__ == "FP16_UnfusedOptimizer" and engine.loss_scale == 1024
    (mb,) = synthetic_batches(cfg, pstate)
    params = list(engine.ds.module.parameters())
    engine.ds.backward(engine.ds(**mb))
    through_engine = torch.cat([p.grad.float().reshape(-1) for p in params])
    for p in params:
        p.grad = None
    engine.ds.module(**mb).backward()
    plain = torch.cat([p.grad.float().reshape(-1) for p in params])
    return float(through_engine.norm() / plain.norm())


def test_deepspeed_fp16_stage0_does_not_scale_the_loss():
    """Pins the DeepSpeed defect behind TrainingConfig's fp16 promotion to ZeRO-1: at stage 0 the loss
    is not multiplied by the scale (ratio 1, not 1024), yet FP16_UnfusedOptimizer.step divides the gradients by
    it. If an upgrade fixes it (ratio 1024), fp16 may run at ZeRO-0 again."""
    ratio = run_distributed(_fp16_stage0_gradient_over_plain_gradient, 1, timeout=300)[0]
    assert ratio == pytest.approx(1.0, rel=1e-3)


# -- bf16: BF16_Optimizer at pp = 1 and pp = 2, no "not safe numerically" warning ------------------

def _bf16_optimizer_of(pp, dp):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from gptpar.parallel import init_parallel

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("DeepSpeed").addHandler(handler)
    pstate = init_parallel(1, pp, dp)
    cfg = engine_config("bf16", 0, pp=pp, dp=dp, micro_batches=4 // dp)  # stage 0 asked: promoted to 1; gbs 4
    engine = engine_for(cfg, pstate)
    opt = engine.ds.optimizer
    losses, norms = [], []
    for k in range(2):
        losses.append(engine.train_step(synthetic_batches(cfg, pstate, consumed=k * cfg.training.global_batch_size)))
        norms.append(engine.grad_norm)
    return {"optimizer": type(opt).__name__, "is_bf16_optimizer": isinstance(opt, BF16_Optimizer),
            "accumulation": [str(b.dtype) for b in opt.fp32_groups_gradients_flat],
            "master": [str(p.dtype) for p in opt.fp32_groups_flat_partition],
            "params": {str(p.dtype) for p in engine.ds.module.parameters()},
            "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
            "losses": losses, "grad_norms": norms}


@pytest.mark.slow  # too slow for make test's budget: in make test-slow
def test_bf16_accumulates_in_fp32_through_bf16_optimizer():
    """pp = 1 and pp = 2 at dp = 2: BF16_Optimizer with fp32 buffers, no warning, and the same global batches'
    losses and (dp-reduced, global) grad norms as one rank, to bf16 accuracy."""
    runs = {(pp, dp): run_distributed(_bf16_optimizer_of, pp * dp, (pp, dp), timeout=300)
            for pp, dp in ((1, 1), (1, 2), (2, 2))}
    ref = runs[1, 1][0]
    for (pp, dp), ranks in runs.items():
        for rank in ranks:
            assert rank["is_bf16_optimizer"], rank["optimizer"]
            assert set(rank["accumulation"]) == {"torch.float32"} and set(rank["master"]) == {"torch.float32"}
            assert rank["params"] == {"torch.bfloat16"}
            assert not any("not safe" in w for w in rank["warnings"]), rank["warnings"]
            assert rank["losses"] == pytest.approx(ref["losses"], rel=5e-3), (pp, dp)
            assert rank["grad_norms"] == pytest.approx(ref["grad_norms"], rel=2e-2), (pp, dp)


# -- the numerics: 64 micro-batches summed in fp32 vs in bf16 --------------------------------------

MICRO_BATCHES = 128


def _first_step_gradients(precision, accumulation):
    """The gradient the optimizer steps on after 64 micro-batches (no clipping), as fp32 (n,), and its norm.

    The fp32 reference starts from the bf16 run's weights (rounded to bf16), so only the arithmetic differs."""
    from gptpar.parallel import init_parallel

    pstate = init_parallel(1, 1, 1)
    cfg = engine_config(precision, 1, micro_batches=MICRO_BATCHES, clip_grad=0.0)

    def edit(ds):
        if accumulation == "bf16":  # DeepSpeed's default before gptpar asked for fp32: ZeRO-1 sums in bf16
            ds.pop("data_types")

    if precision == "fp32":
        engine = engine_for(cfg, pstate)
        with torch.no_grad():
            for p in engine.ds.module.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    else:
        engine = engine_for(cfg, pstate, edit)
    parts = []
    # The optimizer's groups are gptpar's two (decay: matrices, no decay: the rest); DeepSpeed's flat buffers
    # hold each group's parameters in order, then alignment padding. ZeRO steps the inner optimizer once per
    # group (showing it only that group), the others once with both.
    params = [p for p in engine.ds.module.parameters() if p.requires_grad]
    sizes = [sum(p.numel() for p in params if p.dim() >= 2), sum(p.numel() for p in params if p.dim() < 2)]

    def grab(optimizer, args, kwargs):
        for g in optimizer.param_groups:
            size = sizes[len(parts)]
            parts.append(torch.cat([p.grad.detach().float().reshape(-1) for p in g["params"]])[:size])

    inner = getattr(engine.ds.optimizer, "optimizer", engine.ds.optimizer)
    inner.register_step_pre_hook(grab)
    engine.train_step(synthetic_batches(cfg, pstate))
    assert len(parts) == 2
    from gptpar.training.engine.deepspeed_api import FusedGradAccumulation

    name = type(engine.ds.optimizer).__name__
    if name == "BF16_Optimizer":  # its gradients were summed by gptpar's fused accumulation
        assert isinstance(engine.ds.optimizer._update_hp_grad, FusedGradAccumulation)
    return torch.cat(parts), engine.grad_norm, name


@pytest.fixture(scope="module")
def numerics():
    return {name: run_distributed(_first_step_gradients, 1, args, timeout=300)[0]
            for name, args in (("fp32", ("fp32", "fp32")), ("bf16", ("bf16", "fp32")),
                               ("bf16_accum", ("bf16", "bf16")))}


# Relative errors of the bf16 runs' first-step gradient against fp32 arithmetic on the same weights (measured
# docs/benchmarks.md with the measured values): fp32 accumulation stays within these bounds, bf16 accumulation
# is at least twice as far off.
GRAD_NORM_BOUND, GRAD_VECTOR_BOUND = 0.01, 0.02


def test_bf16_first_step_gradient_is_close_to_fp32(numerics):
    ref, ref_norm, _ = numerics["fp32"]
    grad, norm, name = numerics["bf16"]
    assert name == "BF16_Optimizer"
    assert ref_norm == pytest.approx(float(ref.norm()), rel=1e-5)  # the log line's grad norm is this one
    assert abs(norm - ref_norm) / ref_norm < GRAD_NORM_BOUND
    assert float((grad - ref).norm() / ref.norm()) < GRAD_VECTOR_BOUND


def test_bf16_accumulation_is_measurably_worse(numerics):
    ref, ref_norm, _ = numerics["fp32"]
    good, _, _ = numerics["bf16"]
    bad, bad_norm, name = numerics["bf16_accum"]
    assert name == "DeepSpeedZeroOptimizer"  # the old path
    good_error = float((good - ref).norm() / ref.norm())
    bad_error = float((bad - ref).norm() / ref.norm())
    print(f"first-step gradient vs fp32 after {MICRO_BATCHES} micro-batches: relative error {good_error:.5f} "
          f"(fp32 accumulation) vs {bad_error:.5f} (bf16 accumulation); grad norm {numerics['bf16'][1]:.6f} / "
          f"{bad_norm:.6f} vs fp32 {ref_norm:.6f}")
    assert bad_error > 2 * good_error


def test_fused_fp32_grad_accumulation_equals_deepspeeds():
    """gptpar's replacement of BF16_Optimizer._update_hp_grad (one mixed-dtype add, no fp32 temporary) leaves the
    fp32 buffers, the flags and `_hp_grad` exactly as DeepSpeed's own method does, over several micro-batches."""
    from types import SimpleNamespace

    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from gptpar.training.engine.deepspeed_api import FusedGradAccumulation

    g = torch.Generator().manual_seed(0)
    lps = [torch.zeros(5, 7, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)]

    def optimizer():
        return SimpleNamespace(autoep_folding_tp_group=None, fp32_groups_has_gradients=[[False, False]],
                               fp32_groups_gradients=[[torch.zeros(35), torch.zeros(3)]])

    ours, theirs = optimizer(), optimizer()
    fused = FusedGradAccumulation(ours, torch.device("cpu"))
    for _ in range(4):  # micro-batches: bf16 gradients of mixed magnitudes, summed in fp32
        grads = [(torch.randn(lp.shape, generator=g) * 10.0 ** torch.randint(-3, 3, (), generator=g).item())
                 .to(torch.bfloat16) for lp in lps]
        for j, (lp, grad) in enumerate(zip(lps, grads)):
            lp.grad = grad.clone()
            fused(lp, 0, j, False)
            mine = lp._hp_grad
            lp.grad = grad.clone()
            BF16_Optimizer._update_hp_grad(theirs, lp, 0, j, False)
            assert mine is ours.fp32_groups_gradients[0][j] and lp._hp_grad is theirs.fp32_groups_gradients[0][j]
    for a, b in zip(ours.fp32_groups_gradients[0], theirs.fp32_groups_gradients[0]):
        assert a.dtype == torch.float32 and torch.equal(a, b) and a.abs().sum() > 0
    assert ours.fp32_groups_has_gradients == theirs.fp32_groups_has_gradients == [[True, True]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_fused_accumulation_adds_small_gradients_together_at_the_end_of_backward(device):
    """Called from post-accumulate-grad hooks inside backward (as DeepSpeed's `immediate_grad_update` hooks call
    it, dropping the bf16 gradient after), FusedGradAccumulation adds a gradient of BATCHED_NUMEL elements at
    once and keeps smaller ones until the backward pass ends, then adds them together (on a GPU on its side
    stream, joined at the end of the pass); after every pass (four micro-batches) the fp32 buffers equal
    DeepSpeed's own `_update_hp_grad` sums bit for bit."""
    from types import SimpleNamespace

    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from gptpar.training.engine.deepspeed_api import FusedGradAccumulation

    shapes = [(5, 7), (FusedGradAccumulation.BATCHED_NUMEL,), (3,), (2, 4)]

    def optimizer():
        return SimpleNamespace(autoep_folding_tp_group=None, fp32_groups_has_gradients=[[False] * len(shapes)],
                               fp32_groups_gradients=[[torch.zeros(math.prod(s), device=device) for s in shapes]])

    ours, theirs = optimizer(), optimizer()
    fused = FusedGradAccumulation(ours, torch.device(device))
    leaves = [torch.zeros(s, dtype=torch.bfloat16, device=device, requires_grad=True) for s in shapes]
    seen = {}

    def hook(j):
        def call(leaf):
            fused(leaf, 0, j, False)
            if device == "cuda":
                torch.cuda.synchronize()  # the side stream's adds queued so far are done
            seen[j] = ours.fp32_groups_gradients[0][j].clone()  # right after the call, still inside backward
            leaf.grad = None
        return call

    for j, leaf in enumerate(leaves):
        leaf.register_post_accumulate_grad_hook(hook(j))
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        weights = [(torch.randn(s, generator=g) * 10.0 ** torch.randint(-3, 3, (), generator=g).item()).to(device)
                   for s in shapes]
        before = [b.clone() for b in ours.fp32_groups_gradients[0]]
        sum((leaf.float() * w).sum() for leaf, w in zip(leaves, weights)).backward()
        for j, w in enumerate(weights):  # DeepSpeed's add of the same bf16 gradient
            lp = torch.zeros(shapes[j], dtype=torch.bfloat16, device=device)
            lp.grad = w.to(torch.bfloat16)
            BF16_Optimizer._update_hp_grad(theirs, lp, 0, j, False)
            batched = shapes[j][0] < FusedGradAccumulation.BATCHED_NUMEL
            assert torch.equal(seen[j], before[j]) == batched  # small: not yet added when its hook returned
        for a, b in zip(ours.fp32_groups_gradients[0], theirs.fp32_groups_gradients[0]):
            assert torch.equal(a, b)
    assert all(b.abs().sum() > 0 for b in ours.fp32_groups_gradients[0])
    assert ours.fp32_groups_has_gradients == [[True] * len(shapes)] and fused.batched == []


# -- the optimizer step's norm and clip --------------------------------------------------------------

def test_foreach_norm_and_clip_equal_deepspeeds():
    """gptpar's stand-ins for DeepSpeed's `get_global_norm_of_tensors` and `clip_tensors_by_global_norm` (one
    multi-tensor norm, one multi-tensor multiply, no host sync) give DeepSpeed's norm and clipped tensors bit for
    bit on a CPU, whether the coefficient clips or not, and -1 for a NaN or Inf norm."""
    from deepspeed.runtime.utils import clip_tensors_by_global_norm, get_global_norm_of_tensors

    from gptpar.training.engine.deepspeed_api import clip_by_global_norm, global_grad_norm

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=g) * 10.0 ** k for k, shape in
               zip((-3, 0, 2, -1, 1), ((64, 32), (7,), (3, 5, 2), (1,), (100,)))]
    norm = global_grad_norm(tensors)
    assert torch.equal(norm, get_global_norm_of_tensors(tensors)) and norm > 0
    for max_norm in (float(norm) / 3, float(norm) * 3):  # clips, does not clip
        ours, theirs = [t.clone() for t in tensors], [t.clone() for t in tensors]
        assert clip_by_global_norm(ours, max_norm, global_norm=norm) is norm
        clip_tensors_by_global_norm(theirs, max_norm, global_norm=norm)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
        assert all(torch.equal(a, t) for a, t in zip(ours, tensors)) == (max_norm > float(norm))
    for bad in (float("inf"), float("nan")):
        broken = tensors + [torch.tensor([1.0, bad])]
        assert float(global_grad_norm(broken)) == float(get_global_norm_of_tensors(broken)) == -1.0


def _bf16_steps_with_and_without_gptpars_step(tp, poisoned=None):
    """Three bf16 iterations at tp (a clip that engages: clip_grad 0.05) with gptpar's foreach norm and clip and
    its single gradient clear per step, and the same from the same seed with DeepSpeed's own `step` and
    `_take_model_step` (the instances' wrappers removed); how often each step zeroed the fp32 gradients (calls of
    BF16_Optimizer.clear_hp_grads, counted at the class). `poisoned`: the iteration whose summed fp32 gradients
    get a NaN before the step."""
    from deepspeed.runtime import bf16_optimizer

    from gptpar.parallel import init_parallel

    clears = []
    clear_hp_grads = bf16_optimizer.BF16_Optimizer.clear_hp_grads
    bf16_optimizer.BF16_Optimizer.clear_hp_grads = lambda self: clears.append(1) or clear_hp_grads(self)
    pstate = init_parallel(tp, 1, 1)
    runs = {}
    for name in ("gptpar", "deepspeed"):
        cfg = engine_config("bf16", 1, micro_batches=2, clip_grad=0.05)
        engine = engine_for(cfg, pstate)
        opt = engine.ds.optimizer
        installed = "step" in vars(opt) and "_take_model_step" in vars(engine.ds)
        if name == "deepspeed":
            del opt.step, engine.ds._take_model_step
        losses, norms, carried, cleared, applied, moved = [], [], [], [], [], []
        for k in range(3):
            clears.clear()
            before = [p.detach().clone() for p in opt.fp32_groups_flat_partition]
            poison = (lambda: opt.fp32_groups_gradients[0][0].view(-1)[0].fill_(float("nan"))) if k == poisoned else None
            losses.append(engine.train_step(synthetic_batches(cfg, pstate, consumed=k * cfg.training.global_batch_size),
                                            prepare_next=poison))
            cleared.append(len(clears))
            applied.append(engine.step_applied)
            moved.append(any(not torch.equal(a, p) for a, p in zip(before, opt.fp32_groups_flat_partition)))
            norms.append(engine.grad_norm)
            carried.append(getattr(engine.ds.get_global_grad_norm(), "host_scalar", None) is not None)
        restored = tuple(getattr(bf16_optimizer, f).__module__ for f in (
            "get_global_norm_of_tensors", "clip_tensors_by_global_norm", "is_invalid_grad_norm"))
        zero = all(not g.any() for g in opt.fp32_groups_gradients_flat)
        runs[name] = {"installed": installed, "losses": losses, "grad_norms": norms, "restored": restored,
                      "master": [p.detach().clone() for p in opt.fp32_groups_flat_partition], "carried": carried,
                      "cleared": cleared, "zero_after_step": zero, "applied": applied, "moved": moved}
    return runs


def test_bf16_training_with_gptpars_step_equals_deepspeeds():
    """The trainer's bf16 engine (BF16_Optimizer) steps with the foreach norm and clip installed and zeroes the
    fp32 gradients once per step (DeepSpeed: twice, at the end of its step and in the zero_grad right after), and
    trains exactly as with DeepSpeed's own: losses, grad norms (summed over tp 2) and the fp32 master weights
    after three clipped steps, bit for bit on a CPU, the gradients zero after each step; DeepSpeed's functions are
    back in their module after each step. The norm the log line reads is gptpar's own tensor, the one carrying
    its copy for the host (read without waiting for the optimizer step queued after it, `HostScalar`), and its
    value equals DeepSpeed's norm's."""
    for rank in run_distributed(_bf16_steps_with_and_without_gptpars_step, 2, (2,), timeout=300):
        ours, theirs = rank["gptpar"], rank["deepspeed"]
        assert ours["installed"] and theirs["installed"]
        assert ours["cleared"] == [1] * 3 and theirs["cleared"] == [2] * 3
        assert ours["zero_after_step"] and theirs["zero_after_step"]
        assert ours["carried"] == [True] * 3 and theirs["carried"] == [False] * 3
        assert ours["grad_norms"] == theirs["grad_norms"] and min(ours["grad_norms"]) > 0.05  # clipped
        assert ours["losses"] == theirs["losses"]
        assert all(torch.equal(a, b) for a, b in zip(ours["master"], theirs["master"]))
        assert ours["restored"] == theirs["restored"] == ("deepspeed.runtime.utils",) * 3


def test_nonfinite_gradient_skips_gptpars_bf16_step():
    """A NaN in the summed gradients skips the step with gptpar's step as with DeepSpeed's (gptpar queues the
    clip before the step reads the norm, so it multiplies gradients the skip then clears): the master weights
    stay, the step is reported not applied, the gradients are zero after it, and the next step trains as
    DeepSpeed's own does, bit for bit."""
    for rank in run_distributed(_bf16_steps_with_and_without_gptpars_step, 1, (1, 1), timeout=300):
        ours, theirs = rank["gptpar"], rank["deepspeed"]
        for run in (ours, theirs):
            assert run["applied"] == [True, False, True] and run["moved"] == [True, False, True]
            assert run["zero_after_step"]
        assert ours["losses"] == theirs["losses"] and ours["grad_norms"] == theirs["grad_norms"]
        assert all(torch.equal(a, b) for a, b in zip(ours["master"], theirs["master"]))


# Iterations whose gradient gets a non-finite value on one rank, and what: the first step (no optimizer state yet:
# DeepSpeed's host read decides it), then two the device decides.
POISONS = {0: float("nan"), 2: float("nan"), 4: float("inf")}
ITERATIONS = 6


def _nonfinite_steps_three_ways(tp, dp):
    """ITERATIONS bf16 steps (clip 0.05, weight decay 0.1) where rank 1 alone writes POISONS into one fp32 gradient
    before the backward passes add into it (and DeepSpeed all-reduces it over dp): with the trainer's engine (the
    skip decided on the device), with the same engine deciding on the host (`skip_on_device=False`, the previous
    code) and with DeepSpeed's own step (its `step` and `_take_model_step`, the instances' wrappers removed). After
    each step: the loss, whether the device decided the skip (a decision pending for the host), the step applied,
    the skipped steps, the grad norm, and the fp32 master weights, Adam's state and the bf16 weights, copied."""
    from gptpar.parallel import init_parallel

    pstate = init_parallel(tp, 1, dp)
    runs = {}
    for name in ("device", "host", "deepspeed"):
        cfg = engine_config("bf16", 1, dp=dp, micro_batches=2, clip_grad=0.05)
        engine = engine_for(cfg, pstate, skip_on_device=name == "device")
        engine.ds.optimizer.optimizer.param_groups[0]["weight_decay"] = 0.1  # decoupled decay: skipped too
        opt = engine.ds.optimizer
        if name == "deepspeed":
            del opt.step, engine.ds._take_model_step
        steps = []
        for k in range(ITERATIONS):
            if pstate.rank == 1 and k in POISONS:  # the buffer the backward passes add into (zero here)
                opt.fp32_groups_gradients[0][0].view(-1)[0].fill_(POISONS[k])
            loss = engine.train_step(synthetic_batches(cfg, pstate, consumed=k * cfg.training.global_batch_size))
            on_device = engine.skip is not None and engine.skip.pending is not None
            steps.append({"loss": loss, "on_device": on_device, "applied": engine.step_applied,
                          "skipped": engine.skipped_steps, "grad_norm": engine.grad_norm,
                          "master": [p.detach().clone() for p in opt.fp32_groups_flat_partition],
                          "adam": [{key: v.clone() for key, v in opt.optimizer.state.get(p, {}).items()}
                                   for group in opt.optimizer.param_groups for p in group["params"]],
                          "bf16": [p.detach().clone() for p in engine.parameters()]})
        runs[name] = {"installed": engine.skip is not None, "steps": steps}
    return runs


def _same(a, b) -> bool:
    """Equal bit for bit: numbers (NaN equal to NaN), tensors, and lists and dicts of them."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b) or bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(),
                                                                                          b.nan_to_num()))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


@pytest.mark.parametrize("tp, dp", [pytest.param(2, 1, marks=pytest.mark.slow), (1, 2)])  # tp 2: in make test-slow
def test_nonfinite_gradient_skip_decided_on_the_device_equals_deepspeeds(tp, dp):
    """A NaN or Inf in one rank's gradient, at tp 2 (a shard only that rank holds) and at dp 2 (before the gradient
    all-reduce): with the skip decided on the device, every rank skips the same iterations as with DeepSpeed's own
    step (the host reading the norm) and as with the previous code, the log line's skipped steps count the same,
    and after every iteration the fp32 master weights, Adam's moments and step count, the bf16 weights, the
    losses and grad norms are bit for bit DeepSpeed's; the finite steps around the skips too. The first step,
    whose skip must not create Adam's state, is decided on the host; every later one on the device."""
    expected = [k not in POISONS for k in range(ITERATIONS)]
    for rank in run_distributed(_nonfinite_steps_three_ways, 2, (tp, dp), timeout=600):
        device, host, deepspeed = rank["device"], rank["host"], rank["deepspeed"]
        assert device["installed"] and not host["installed"] and not deepspeed["installed"]
        assert [s["on_device"] for s in device["steps"]] == [False, False] + [True] * (ITERATIONS - 2)
        for run in (device, host, deepspeed):
            assert [s["applied"] for s in run["steps"]] == expected
            assert [s["skipped"] for s in run["steps"]] == [1, 1, 2, 2, 3, 3]
            moved = [not _same(a["master"], b["master"]) for a, b in zip(run["steps"], run["steps"][1:])]
            assert moved == expected[1:]
        assert not deepspeed["steps"][0]["adam"][0] and device["steps"][1]["adam"][0]  # made by the first applied step
        for k, ours in enumerate(device["steps"]):
            for other in (deepspeed["steps"][k], host["steps"][k]):
                differ = [key for key in ours if key != "on_device" and not _same(ours[key], other[key])]
                assert not differ, (k, differ)


def _gradients_summed_and_stepped_on(comm):
    """bf16, dp 1, no clipping: the fp32 gradient buffers once the last micro-batch's backward is done (the
    engine's `prepare_next` moment, before DeepSpeed's reduction) and the gradients the client optimizer steps
    on, with the generated config or with `communication_data_type` overridden."""
    from gptpar.parallel import init_parallel

    pstate = init_parallel(1, 1, 1)
    cfg = engine_config("bf16", 1, micro_batches=4, clip_grad=0.0)
    engine = engine_for(cfg, pstate, ds_edit=(lambda ds: ds.update(communication_data_type=comm)) if comm else None)
    opt = engine.ds.optimizer
    summed, stepped = [], []
    opt.optimizer.register_step_pre_hook(lambda o, args, kwargs: stepped.extend(
        p.grad.detach().clone() for group in o.param_groups for p in group["params"]))
    engine.train_step(synthetic_batches(cfg, pstate),
                      prepare_next=lambda: summed.extend(b.detach().clone() for b in opt.fp32_groups_gradients_flat))
    return str(engine.ds.communication_data_type), torch.cat(summed), torch.cat(stepped)


def test_bf16_steps_on_the_fp32_sums_not_their_bf16_rounding():
    """The generated config reduces gradients over dp in fp32 under bf16 (Megatron-LM's choice): the optimizer
    steps on the fp32 sums exactly. DeepSpeed's own default for a bf16 engine (what `communication_data_type =
    bf16` restores) casts them to bf16 for the all-reduce and back, even at dp 1."""
    runs = {comm: run_distributed(_gradients_summed_and_stepped_on, 1, (comm,), timeout=300)[0]
            for comm in (None, "bf16")}
    dtype, summed, stepped = runs[None]
    assert dtype == "torch.float32" and torch.equal(stepped, summed)
    assert not torch.equal(summed, summed.bfloat16().float())  # the sums are not bf16 numbers already
    dtype, summed, stepped = runs["bf16"]
    assert dtype == "torch.bfloat16" and torch.equal(stepped, summed.bfloat16().float())
