"""Which GEMMs of a transformer layer run in float8 under `training.precision = fp8`: as they are, padded, or kept in
bf16, and the bytes their casts take - arithmetic on shapes, without torch. The layers decide by `plan_float8_gemm`
(gptpar.tensor_parallel.float8 runs the GEMMs, says why these rules, and re-exports these names); the estimate
(planner, memory, `--dry-run`) imports them from here, so the planning tools stay light: this module and
gptpar/tensor_parallel/__init__.py import no torch.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

FLOAT8_MULTIPLE = 16          # torch._scaled_mm: both dimensions of every weight slice
MAX_PADDING = 0.125           # pad while it adds at most this share of the GEMM's FLOPs, else keep it in bf16
GEMM_NAMES = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")  # TransformerLayer's, in order


def _round_up(n: int) -> int:
    return -(-n // FLOAT8_MULTIPLE) * FLOAT8_MULTIPLE


@dataclasses.dataclass(frozen=True)
class Float8Gemm:
    """How one linear's weight slice (out_features, in_features) on one tp rank runs under precision fp8:
    `mode` "fp8" (as it is), "padded" (to padded_out x padded_in inside the layer) or "bf16" (kept)."""

    name: str
    out_features: int
    in_features: int
    mode: str
    padded_out: int
    padded_in: int

    @property
    def extra_flops(self) -> float:
        """The share of FLOPs (and of the weight slice's bytes) that padding adds: 0 unless padded."""
        if self.mode != "padded":
            return 0.0
        return self.padded_out * self.padded_in / (self.out_features * self.in_features) - 1.0

    def describe(self, name: Optional[str] = None) -> str:
        """e.g. `dense 14400x1800 fp8 padded to 14400x1808 (+0.44% FLOPs)`, under `name` if given."""
        shape = f"{name or self.name} {self.out_features}x{self.in_features}"
        if self.mode == "padded":
            return f"{shape} fp8 padded to {self.padded_out}x{self.padded_in} (+{100 * self.extra_flops:.2f}% FLOPs)"
        if self.mode == "bf16":
            return f"{shape} kept in bf16 (padding to {self.padded_out}x{self.padded_in} would add " \
                   f"{100 * (self.padded_out * self.padded_in / (self.out_features * self.in_features) - 1):.0f}%)"
        return f"{shape} fp8"


def plan_float8_gemm(out_features: int, in_features: int, name: str = "linear") -> Float8Gemm:
    """The fp8 decision for a weight slice of (out_features, in_features): see the module docstring."""
    out_p, in_p = _round_up(out_features), _round_up(in_features)
    if (out_p, in_p) == (out_features, in_features):
        mode = "fp8"
    elif out_p * in_p <= (1 + MAX_PADDING) * out_features * in_features:
        mode = "padded"
    else:
        mode = "bf16"
    return Float8Gemm(name, out_features, in_features, mode, out_p, in_p)


def layer_float8_gemms(hidden_size: int, ffn_hidden_size: int, tp_size: int) -> List[Float8Gemm]:
    """The four GEMMs of one transformer layer on one tp rank, as TransformerLayer builds them (weights
    (out, in): query_key_value (3h/tp, h), dense (h, h/tp), dense_h_to_4h (f/tp, h), dense_4h_to_h (h, f/tp))."""
    h, f, t = hidden_size, ffn_hidden_size, tp_size
    shapes = ((3 * h // t, h), (h, h // t), (f // t, h), (h, f // t))
    return [plan_float8_gemm(out, inp, name) for name, (out, inp) in zip(GEMM_NAMES, shapes)]


def float8_cast_bytes(gemms: List[Float8Gemm], tokens: int, weights_cached: bool = False) -> int:
    """Peak bytes of float8 casts and padding copies one GEMM of `gemms` holds at a time beyond what its bf16
    GEMM would (the largest over them), with `tokens` = micro batch x seq_length rows: its backward holds the
    output gradient cast twice (for the input- and the weight-gradient GEMMs) and the input cast once (1 byte
    each), the padded bf16 gradients of a padded GEMM (2 bytes), and - unless `weights_cached` (tensorwise: the
    cast comes from the per-step cache, counted by float8_weight_cache_bytes) - the weight's cast (1 byte) and for
    a padded GEMM its rebuilt bf16 weight copy (2 bytes). Transient: freed when the GEMM's backward returns; no
    float8 tensor is kept between forward and backward."""
    peak = 0
    for g in gemms:
        if g.mode == "bf16":
            continue
        o, i, m = g.padded_out, g.padded_in, tokens
        held = 2 * m * o + m * i + (0 if weights_cached else o * i)
        if g.mode == "padded":
            held += ((0 if weights_cached else 2 * o * i) + (2 * m * o if o != g.out_features else 0)
                     + (2 * m * i if i != g.in_features else 0))
        peak = max(peak, held)
    return peak


def float8_weight_cache_bytes(gemms: List[Float8Gemm]) -> int:
    """Bytes one transformer layer's cached weight casts hold on this rank (tensorwise; `refresh_float8_weights`):
    1 per element of each float8 GEMM's weight slice as padded, and a 4-byte scale; kept from a step's start to its
    end (TrainEngine), i.e. all of training."""
    return sum(g.padded_out * g.padded_in + 4 for g in gemms if g.mode != "bf16")


def describe_float8_gemms(gemms: List[Float8Gemm], tp_size: int) -> str:
    """One line: what each GEMM of a transformer layer does under fp8 at this tp."""
    return (f"fp8 GEMMs per transformer layer at tp {tp_size} (weight slice out x in): "
            + "; ".join(g.describe() for g in gemms) + "; output layer (tied embedding) bf16")


def float8_flags(gemms: List[Float8Gemm]) -> List[str]:
    """Short flags for the planner's table: which GEMMs are padded or kept in bf16 (none: all fp8)."""
    flags = []
    for mode in ("padded", "bf16"):
        names = [g.name for g in gemms if g.mode == mode]
        if names:
            flags.append(f"fp8 {'pads' if mode == 'padded' else 'keeps bf16:'} {','.join(names)}")
    return flags
