"""Float8 GEMMs for the tensor-parallel layers (`training.precision = fp8`) through torchao's float8 training.

What runs in float8: the four GEMMs of every transformer layer (query_key_value and dense_h_to_4h, column-parallel;
dense and dense_4h_to_h, row-parallel), forward and both backward GEMMs, each through the autograd function inside
torchao's `Float8Linear`: the input and the weight are cast to float8 e4m3 and the output gradient to e5m2
(`tensorwise`) or all three to e4m3 with power-of-2 row scales (`rowwise`), each with a dynamic scale computed from
the tensor itself, then multiplied by `torch._scaled_mm` on a CUDA GPU (compute capability 8.9+), or emulated
without one (exact float8 rounding, fp32 matmuls: for tests and the CPU demo, not for speed). Everything else runs
as precision bf16 does: bf16 weights and activations, DeepSpeed's BF16_Optimizer with fp32 gradient accumulation and
fp32 master weights (to DeepSpeed fp8 is bf16: `gptpar.config.deepspeed_precision`), so checkpoints hold
what a bf16 run's hold. The output layer (tied to the word embedding) stays bf16, as torchtitan's filter leaves it:
its (V/tp, h) weight is the embedding table, and its logits feed the loss directly.

Scales are per tp shard: each rank computes its scales from the tensor it holds, with no reduction over the tp group.
What must agree across tp ranks is the quantisation of every *replicated* tensor - the column-parallel layer's
input (the gathered sequence under sequence parallelism) and the row-parallel layer's output gradient - so that the
replicated computations around them (LayerNorms, biases, the residual stream) stay identical: those tensors are bit
for bit the same on every tp rank (the all-reduce and all-gather that produce them return the same bits everywhere)
and an amax is deterministic, so their scales agree without any communication. The sharded tensors (the weight
slices, the row-parallel input, the column-parallel output gradient) get one scale per shard: blockwise scaling
with tp blocks, never coarser than one scale for the whole tensor (a shard's amax is at most the tensor's), and no
rank's GEMM needs another rank's scale because gptpar communicates activations in bf16 and only after the GEMM's
output is de-scaled (the row-parallel partial sums are reduced in bf16). Megatron (Transformer Engine) and
torchtitan reduce amaxes over the tp group because they *communicate in float8*: TE and torchtitan cast the
sequence-parallel input before its all-gather (a float8 all-gather needs one scale on every rank), torchtitan's
DTensors give each sharded tensor its global amax "to keep single device semantics", and TE's delayed scaling keeps
amax histories that are reduced over tp x dp. Reducing here would cost a latency-bound all-reduce of one scalar per
cast of a sharded tensor, about a dozen per layer and micro-batch (six in forward: the four weight slices and the two
row-parallel inputs; as many in backward), and buy no accuracy; what it would buy is tp-invariance: at tp 2 a GEMM
quantises its weight with two scales where tp 1 uses one, so fp8 losses differ across tp by float8 rounding, as
bf16's differ across tp by summation order.

Shapes: `torch._scaled_mm(a (M, K), b (K, N))` needs K and N divisible by 16. A linear's three GEMMs put the
weight slice's `in` and `out` in those places (forward K = in, N = out; grad-input K = out, N = in; grad-weight
K = tokens, N = in), so both dimensions of every weight slice must divide by 16; torchao pads only inner
dimensions (`pad_inner_dim`: used here only when micro batch x seq_length does not divide by 16, since torchao then
copies every operand of every GEMM, aligned or not; no shipped config needs it). `plan_float8_gemm` decides per
GEMM, a pure function used by the layers, the start-up log, `--dry-run` (gptpar.estimate.report) and the planner:
`fp8` when both divide; `padded` (zeros appended to the weight slice and to the input inside the layer, the output
cut back; invisible to checkpoints, whose weights keep their shapes; the zeros change no scale, so the result is the
unpadded GEMM's) while padding adds at most 1/8 to the GEMM's FLOPs; else `bf16` (only dimensions under ~128 reach
that: GEMMs too small for float8's casts to pay off). In eager mode the padded weight copy is not kept for backward
(it is rebuilt there from the parameter), only the padded activation is, as the unpadded one would be; under
torch.compile the compiler's partitioner makes that choice (and fuses the pads into the casts).

Weight casts are cached per optimizer step (recipe tensorwise): weights change only at the optimizer step, yet
torchao casts the weight (its amax, then the e4m3 copy) in forward and again in backward for the grad-input GEMM,
every micro-batch - about 10 bytes of memory traffic per parameter per micro-batch, and a real run has hundreds of
micro-batches per step. `refresh_float8_weights(module)` casts each weight once into the linear's
`Float8WeightCache` (1 byte per element of the weight slice as padded, plus its scale, held all step:
`float8_weight_cache_bytes`) and the GEMMs take the cast from there (torchao's function accepts a weight already in
float8; `_CachedWeight` hands it in and passes the weight gradient through to the bf16 parameter), bit for bit the
uncached result. Validity is explicit, as Transformer Engine's `is_first_microbatch` and torchao's
`precompute_float8_dynamic_scale_for_fsdp` are: DeepSpeed writes the new weights into a flat buffer the parameters
view, which changes neither their version counters nor their addresses, so no forward can see the update; TrainEngine
refreshes at the start of train_step / eval_step and invalidates when they end (see `refresh_float8_weights`). rowwise
recasts every micro-batch: its forward and grad-input GEMMs need the weight scaled along different axes, and torchao's
function takes one weight operand for both.

Eager float8 is slow: each cast is several kernels, so eager fp8 runs slower than bf16; compile the layers
(`training.compile`), which fuses the casts (the timings: docs/precision.md).

torchao 0.18.0 internals relied on (not public API; `make test` breaks when one changes):
    `torchao.float8.float8_linear.matmul_with_hp_or_float8_args`     tests/integration/test_float8.py::test_parallel_layers_equal_torchaos_float8_linear,
      `.apply(input, weight.t(), LinearMMConfig, Float8LinearConfig)`   ::test_padded_gemm_equals_the_unpadded_one
      (the autograd function inside Float8Linear; torchtitan's TP path)
    `torchao.float8.float8_training_tensor.LinearMMConfig` /          tests/integration/test_float8.py::test_parallel_layers_equal_torchaos_float8_linear
      `ScaledMMConfig(emulate, use_fast_accum, fp8_output, pad_inner_dim)` (built as Float8Linear.__init__ builds them)
    `Float8LinearConfig.from_recipe_name` and its `emulate`,          tests/integration/test_float8.py (every recipe)
      `pad_inner_dim`, `gemm_config_*.use_fast_accum` fields
    the "Failed to load ..." warnings of torchao's import on the       tests/integration/test_float8.py::test_import_is_quiet_and_says_why
      `torchao` logger (its C++ extensions, unused by float8 training)
    that function's output is a view it owns (copied before the        tests/integration/test_float8.py::test_a_compiled_layer_traces_fp8_in_one_graph
      row-parallel in-place all-reduce) and it is allow_in_graph
    the non-emulated path (torch._scaled_mm, torchao's padding of      tests/integration/test_float8.py::test_cuda_float8_gemms_match_the_emulation
      the token dimension)                                              (on a GPU only)
"""
from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional

import torch
import torch.nn.functional as F

from gptpar.tensor_parallel.float8_shapes import (  # noqa: F401 (the shape rules, re-exported: see __all__)
    FLOAT8_MULTIPLE, GEMM_NAMES, MAX_PADDING, Float8Gemm, describe_float8_gemms, float8_cast_bytes, float8_flags,
    float8_weight_cache_bytes, layer_float8_gemms, plan_float8_gemm)

TORCHAO_VERSION = "0.18.0"    # the version whose internals this module was written against (setup.py's fp8 extra)


# ---------------------------------------------------------------------------------------------
# The float8 GEMM at run time (imports torchao; only a run with precision fp8 builds one)
# ---------------------------------------------------------------------------------------------

def import_torchao():
    """torchao's float8 pieces, imported with its import-time noise caught: torchao 0.18.0 logs one "Failed to load
    ..." warning per C++ extension that does not load with this torch build (its MX and CUTLASS kernels, which float8
    training does not use: its GEMM is torch's own `_scaled_mm`, its casts are PyTorch ops), and torch logs that
    torchao registers an enum with a deprecated call. Returns (namespace, a note on the extensions or None)."""
    caught: List[logging.LogRecord] = []

    class _Catch(logging.Handler):
        def emit(self, record):
            caught.append(record)

    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    saved = [(lg.propagate, lg.handlers[:]) for lg in loggers]
    handler = _Catch()
    try:
        for lg in loggers:
            lg.propagate, lg.handlers = False, [handler]
        import torchao
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig, ScaledMMConfig
    finally:
        for lg, (propagate, handlers) in zip(loggers, saved):
            lg.propagate, lg.handlers = propagate, handlers
    failed = [r for r in caught if r.getMessage().startswith("Failed to load")]
    unexpected = [r for r in caught if r not in failed and r.name == "torchao" and r.levelno >= logging.WARNING]
    for record in unexpected:  # anything else torchao says is passed on
        logging.getLogger("torchao").handle(record)
    note = (f"{len(failed)} of torchao's C++ extension files did not load with this torch (unused by float8 "
            "training)") if failed else None
    ns = dict(version=torchao.__version__, Float8LinearConfig=Float8LinearConfig, LinearMMConfig=LinearMMConfig,
              ScaledMMConfig=ScaledMMConfig, matmul=matmul_with_hp_or_float8_args,
              to_float8=hp_tensor_to_float8_dynamic, weight_role=GemmInputRole.WEIGHT)
    return ns, note


class Float8WeightCache:
    """One linear's weight slice cast to float8 ahead of its GEMMs (tensorwise: e4m3 data (out', in'), padded as
    the GEMM is, and one fp32 scale), made and remade in place by `Float8Matmul.cast_weight`; used while `valid`.
    `seen` is the weight's (_version, data_ptr) when it was cast: eager forwards recast when it changed."""

    def __init__(self):
        self.data: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None
        self.valid = False
        self.seen = (None, None)

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.nbytes + self.scale.nbytes


class _CachedWeight(torch.autograd.Function):
    """A cached cast as the float8 weight operand (in', out') of torchao's GEMM function: a fresh
    Float8TrainingTensor around the cached data and scale on every call (torchao's _ToFloat8ConstrFunc with the
    cast done ahead), whose gradient - torchao's weight gradient - passes through to the bf16 parameter, cut back
    to its shape when padded. allow_in_graph (by Float8Matmul.__init__, once torchao has imported dynamo)."""

    @staticmethod
    def forward(ctx, weight, data, scale, mm_config):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
        ctx.shape = weight.shape
        return Float8TrainingTensor(data.t(), scale, weight.dtype, mm_config, GemmInputRole.WEIGHT, None)

    @staticmethod
    def backward(ctx, grad):
        out, inp = ctx.shape
        return grad.t()[:out, :inp], None, None, None


class Float8Matmul:
    """The run's float8 GEMM: torchao's recipe `recipe` (tensorwise | rowwise), emulated unless `emulate` is False.
    Built once per run (gptpar.training.assembly) and handed to every tensor-parallel linear of the transformer layers.

    `linear(x, weight, gemm, cache=None)`: x (..., in) times this rank's weight slice (out, in) transposed, in
    float8, as `plan_float8_gemm` decided for it (`gemm.mode` "fp8" or "padded"; a "bf16" GEMM never reaches here);
    no bias. With a valid `cache` (a Float8WeightCache, `caches_weights` recipes only) the weight's cast is taken
    from it instead of being computed (see `refresh_float8_weights`)."""

    def __init__(self, recipe: str = "tensorwise", emulate: bool = True):
        ns, self.import_note = import_torchao()
        self.recipe, self.emulate, self.version = recipe, emulate, ns["version"]
        self._matmul, self._to_float8, self._weight_role = ns["matmul"], ns["to_float8"], ns["weight_role"]
        torch._dynamo.allow_in_graph(_CachedWeight)  # as torchao's own float8 autograd functions are
        self.config = dataclasses.replace(ns["Float8LinearConfig"].from_recipe_name(recipe), emulate=emulate)
        # One ScaledMMConfig per GEMM (output, grad_input, grad_weight), as Float8Linear.__init__ builds them; with
        # pad_inner_dim for a token count that does not divide by 16 (the grad-weight GEMM's inner dimension).
        scaled, c = ns["ScaledMMConfig"], self.config
        self.mm_configs = {pad: ns["LinearMMConfig"](
            *(scaled(emulate, g.use_fast_accum, False, pad)
              for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)))
            for pad in (False, True)}
        # One cast serves the forward and the grad-input GEMM only when both ask for the same one: tensorwise.
        # rowwise scales the weight per output row for forward and per input column for grad-input, and torchao's
        # GEMM function takes one weight operand for both, so a rowwise weight is cast per micro-batch, twice.
        w = c.cast_config_weight
        self.caches_weights = (w == c.cast_config_weight_for_grad_input and w.scaling_granularity.value == "tensorwise"
                               and w.scaling_type.value == "dynamic")

    def describe(self) -> str:
        how = "emulated: no CUDA device, exact float8 rounding with fp32 matmuls, slow" if self.emulate \
            else "torch._scaled_mm"
        version = self.version if self.version == TORCHAO_VERSION else f"{self.version}, written for {TORCHAO_VERSION}"
        cache = "weight casts cached per optimizer step" if self.caches_weights \
            else "weights cast per micro-batch: rowwise needs two casts"
        return f"GEMMs float8 through torchao {version} ({self.recipe} scales per tp shard; {cache}; {how})"

    def cast_weight(self, weight: torch.Tensor, gemm: Float8Gemm, cache: Float8WeightCache) -> None:
        """Cast `weight` (padded as `gemm` is) into `cache`, in place once it holds one, exactly as torchao's
        forward casts the weight it is given, and mark the cache valid."""
        with torch.no_grad():
            w = weight.detach()
            if gemm.mode == "padded":
                w = F.pad(w, (0, gemm.padded_in - gemm.in_features, 0, gemm.padded_out - gemm.out_features))
            c = self.config.cast_config_weight
            cast = self._to_float8(w.t(), c.target_dtype, self.mm_configs[False], gemm_input_role=self._weight_role,
                                   scaling_granularity=c.scaling_granularity, axiswise_dim=None,
                                   round_scales_to_power_of_2=self.config.round_scales_to_power_of_2)
            data, scale = cast._data.t(), cast._scale  # (out', in') and the scalar scale
            if cache.data is None or cache.data.shape != data.shape or cache.data.device != data.device:
                cache.data, cache.scale = data.contiguous(), scale.clone()
            else:  # in place: the same tensors for every step (a compiled layer reads them as graph inputs)
                cache.data.copy_(data)
                cache.scale.copy_(scale)
        cache.seen, cache.valid = (weight._version, weight.data_ptr()), True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, gemm: Float8Gemm,
               cache: Optional[Float8WeightCache] = None) -> torch.Tensor:
        mm_config = self.mm_configs[(x.numel() // x.shape[-1]) % FLOAT8_MULTIPLE != 0]
        pad_in, pad_out = gemm.padded_in - gemm.in_features, gemm.padded_out - gemm.out_features
        if cache is not None and cache.valid:
            if not torch.compiler.is_compiling() and cache.seen != (weight._version, weight.data_ptr()):
                self.cast_weight(weight, gemm, cache)  # eager: updated through the parameter since the refresh
            x = F.pad(x, (0, pad_in)) if pad_in else x
            y = self._matmul.apply(x, _CachedWeight.apply(weight, cache.data, cache.scale, mm_config), mm_config,
                                   self.config)
            return y[..., :gemm.out_features] if pad_out else y
        if gemm.mode == "fp8":
            return self._matmul.apply(x, weight.t(), mm_config, self.config)
        x = F.pad(x, (0, pad_in)) if pad_in else x  # (..., in') with zero columns: kept for backward
        padded = F.pad(weight, (0, pad_in, 0, pad_out)).contiguous()  # (out', in'): rebuilt in backward, not kept
        if torch.compiler.is_compiling():
            # Compiled, AOTAutograd's partitioner chooses what backward keeps (recomputing the pad from the weight
            # rather than keeping its copy), and the pad fuses with the float8 cast; the hooks' identity test would
            # only break the graph.
            y = self._matmul.apply(x, padded.t(), mm_config, self.config)
        else:
            with torch.autograd.graph.saved_tensors_hooks(*_rebuilt_in_backward(padded, weight,
                                                                                (0, pad_in, 0, pad_out))):
                y = self._matmul.apply(x, padded.t(), mm_config, self.config)  # (..., out')
        return y[..., :gemm.out_features] if pad_out else y


@dataclasses.dataclass(frozen=True)
class _Rebuild:
    size: torch.Size
    stride: tuple
    offset: int


def _rebuilt_in_backward(padded: torch.Tensor, weight: torch.Tensor, pad):
    """saved_tensors_hooks that save, instead of the padded weight copy (or a view of it), a note to rebuild it from
    the parameter in backward: one copy of the weight slice per layer and micro-batch in flight less (156 MB per
    200B layer's query_key_value at tp 8). The hooks hold the copy's address, never the copy itself."""
    address = padded.untyped_storage().data_ptr()  # unique while the copy lives (all of the forward); 0 on meta

    def pack(t):
        if address and t.untyped_storage().data_ptr() == address:  # the copy or a view (torchao saves its transpose)
            return _Rebuild(t.size(), t.stride(), t.storage_offset())
        return t

    def unpack(saved):
        if isinstance(saved, _Rebuild):  # the same view of a new copy, laid out as the first (both contiguous)
            return F.pad(weight, pad).contiguous().as_strided(saved.size, saved.stride, saved.offset)
        return saved

    return pack, unpack


def float8_summary(module: torch.nn.Module) -> Optional[str]:
    """What the precision plan line says of float8, read off the built layers (their `float8_gemm`, decided by
    `plan_float8_gemm`): the recipe, native or emulated, and each GEMM of a transformer layer on this rank once
    (every layer decides alike). None when no layer was built for fp8."""
    first = {}
    for name, m in module.named_modules():
        gemm = getattr(m, "float8_gemm", None)
        if gemm is not None:
            first.setdefault(name.rsplit(".", 1)[-1], (m, gemm))
    if not first:
        return None
    matmul = next((m.float8 for m, _ in first.values() if m.float8 is not None), None)
    head = matmul.describe() if matmul is not None else "GEMMs kept in bf16 (none fits float8)"
    gemms = "; ".join(g.describe(name) for name, (_, g) in first.items())
    note = f" ({matmul.import_note})" if matmul is not None and matmul.import_note else ""
    return f"{head}: {gemms}; output layer (tied embedding) bf16{note}"


def _weight_caches(module: torch.nn.Module):
    for m in module.modules():
        cache = getattr(m, "float8_weight_cache", None)
        if cache is not None:
            yield m, cache


def refresh_float8_weights(module: torch.nn.Module) -> int:
    """Cast the weight of every float8 linear in `module` that caches its weight (recipe tensorwise) into its
    Float8WeightCache and mark the cache valid: from now on their forwards take the weight's float8 cast from the
    cache (1 byte per weight element, kept) instead of computing it, forward and backward, every micro-batch.
    Returns how many weights it cast.

    The contract: whoever changes the weights calls this after the change and before the next forward, or
    `invalidate_float8_weights` (gptpar's TrainEngine refreshes at the start of `train_step` and `eval_step` and
    invalidates when they end, so between its steps the layers compute their casts as without a cache). Writes a
    forward cannot see: under torch.compile no forward checks anything (a check would be a guard, a recompile per
    step), and in eager a forward recasts when the weight's version counter or address changed - an in-place
    update through the parameter (`torch.optim`'s, `with no_grad: w.add_()`) - but writes through `w.data` or to a
    flat buffer the parameter is a view of (DeepSpeed's optimizers) leave both unchanged. A model no one refreshes
    never uses a cache. Refresh between steps only: an autograd graph still awaiting backward would see the new
    cast (as it would see an in-place weight update)."""
    count = 0
    for m, cache in _weight_caches(module):
        m.float8.cast_weight(m.weight, m.float8_gemm, cache)
        count += 1
    return count


def invalidate_float8_weights(module: torch.nn.Module, free: bool = False) -> None:
    """Stop the float8 linears in `module` using their cached weight casts until the next
    `refresh_float8_weights`; with `free` also drop the casts' memory (a refresh then allocates it anew)."""
    for _, cache in _weight_caches(module):
        cache.valid = False
        if free:
            cache.data = cache.scale = None


__all__ = ["FLOAT8_MULTIPLE", "MAX_PADDING", "GEMM_NAMES", "Float8Gemm", "plan_float8_gemm", "layer_float8_gemms",
           "float8_cast_bytes", "float8_weight_cache_bytes", "describe_float8_gemms", "float8_flags", "import_torchao",
           "Float8Matmul", "Float8WeightCache", "float8_summary", "refresh_float8_weights",
           "invalidate_float8_weights"]
