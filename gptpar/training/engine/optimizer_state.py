"""What DeepSpeed's optimizer holds, read and written through its public helpers: one parameter's full state
(fp32 master weight, Adam moments, step) for universal checkpoints, the precision plan line, and the bytes held.

`ds` is DeepSpeed's engine; its `.optimizer` is DeepSpeed's wrapper (DeepSpeedZeroOptimizer, BF16_Optimizer,
FP16_Optimizer) around the client optimizer, or the client optimizer itself (fp32 without ZeRO).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

import gptpar.training.engine.deepspeed_api as deepspeed_api
from gptpar.tensor_parallel.float8 import float8_summary


def optimizers(ds):
    """(DeepSpeed's optimizer wrapper, the client optimizer inside it); the same object twice without one."""
    wrapper = ds.optimizer
    return wrapper, getattr(wrapper, "optimizer", wrapper)


@torch.no_grad()
def set_full_state(ds, param: torch.Tensor, fp32: torch.Tensor, moments: Dict[str, torch.Tensor],
                   step: float) -> None:
    """Give `param` (this rank's tp slice, whole over dp) its fp32 master weight, Adam moments and step.

    The model weight becomes the master weight in the model's dtype (what the optimizers copy back after
    a step); DeepSpeed's `safe_set_full_fp32_param` / `safe_set_full_optimizer_state` write the part of
    this dp rank's partition that the parameter's `_hp_mapping` covers (ZeRO-1, BF16_Optimizer). Without
    a partitioned optimizer (fp32 at ZeRO-0) the client AdamW's own state of `param` is set."""
    param.copy_(fp32.to(param.dtype))
    _init_optimizer_state(ds, step)
    if hasattr(param, "_hp_mapping"):
        deepspeed_api.set_full_fp32_param(param, fp32)
        for key, value in moments.items():
            deepspeed_api.set_full_optimizer_state(param, value, key)
    else:
        state = optimizers(ds)[1].state[param]
        for key, value in moments.items():
            state[key].copy_(value)


def full_state(ds, param: torch.Tensor) -> dict:
    """{"fp32", each Adam moment, "step"} of `param` (this rank's tp slice, gathered over dp: a collective
    over the dp group under ZeRO-1 / BF16_Optimizer), read back through DeepSpeed."""
    inner = optimizers(ds)[1]
    if not hasattr(param, "_hp_mapping"):
        state = inner.state[param]
        return dict({k: v.clone() for k, v in state.items() if k != "step"}, fp32=param.detach().float().clone(),
                    step=float(state["step"]))
    _link_optimizer_state(ds)
    keys = [k for k, v in next(iter(inner.state.values())).items() if k != "step" and torch.is_tensor(v)]
    out = {key: deepspeed_api.get_full_optimizer_state(param, key).clone() for key in keys}
    out["fp32"] = deepspeed_api.get_full_fp32_param(param).clone()
    group = inner.param_groups[0]
    out["step"] = float(group["step"] if "step" in group else next(iter(inner.state.values()))["step"])
    return out


def _init_optimizer_state(ds, step: float) -> None:
    """Adam's state for every tensor the client AdamW steps on (DeepSpeed's flat fp32 partitions, or the
    parameters themselves), as torch's AdamW creates it at its first step, with `step` as its count; then
    DeepSpeed links each parameter's fragment of it (`_lazy_init_hp_params_optimizer_state`, which its
    optimizers otherwise run after their first step)."""
    inner = optimizers(ds)[1]
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state[p]
            if not state:
                state.update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                             exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"].fill_(step)
        if "step" in group:  # apex FusedAdam counts steps per group
            group["step"] = int(step)
    _link_optimizer_state(ds)


def _link_optimizer_state(ds) -> None:
    """Let each parameter's `_hp_mapping` address its fragment of the Adam state (DeepSpeed does it lazily,
    after its first step)."""
    wrapper = ds.optimizer
    if hasattr(wrapper, "_lazy_init_hp_params_optimizer_state"):
        wrapper._lazy_init_hp_params_optimizer_state()


def partitioned(ds) -> bool:
    """Whether DeepSpeed's optimizer keeps the master weights as flat fp32 partitions over dp (ZeRO-1,
    BF16_Optimizer: every parameter then has an `_hp_mapping`, None where none of it is on this dp rank)
    rather than stepping on the parameters themselves (fp32 without ZeRO)."""
    return optimizers(ds)[0] is not optimizers(ds)[1]


def master_fragment(param: torch.Tensor) -> torch.Tensor:
    """This dp rank's share of `param`'s master weight, flat: under a partitioned optimizer its fragment of
    the fp32 partition (`_hp_mapping.hp_fragment`, empty when none of it lives here), else the parameter."""
    if not hasattr(param, "_hp_mapping"):
        return param.detach().reshape(-1)
    mapping = param._hp_mapping
    return mapping.hp_fragment if mapping is not None else param.detach().new_empty(0, dtype=torch.float32)


def grad_fragment_of(flat: torch.Tensor, param: torch.Tensor) -> Optional[torch.Tensor]:
    """The part of `flat.grad` (a flat fp32 partition the client optimizer steps on) that is `param`'s gradient
    on this dp rank, or None when `param` has none of `flat`: located by where `param`'s master fragment sits
    in `flat`'s storage (`_hp_mapping.hp_fragment` is a narrow view of it)."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None or flat.grad is None:
        return None
    fragment = mapping.hp_fragment
    if fragment.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
        return None
    return flat.grad.reshape(-1).narrow(0, fragment.storage_offset() - flat.storage_offset(), fragment.numel())


def precision_plan(ds, dp_size: int) -> str:
    """One line: parameter, gradient-accumulation, dp-reduction and master-weight dtypes and the optimizer wrapper
    DeepSpeed chose, read off the engine's real objects."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    params = [p for p in ds.module.parameters() if p.requires_grad]
    wrapper, inner = optimizers(ds)
    master = [p for g in inner.param_groups for p in g["params"]]
    own = {id(p) for p in params}
    if all(id(p) in own for p in master):
        where = "the parameters themselves"
    else:
        share = sum(p.numel() for p in master) / sum(p.numel() for p in params)
        where = f"a {names[master[0].dtype]} copy" + (
            f" of {share:.3g} of the parameters (partitioned over dp {dp_size})" if share < 0.99
            else " of every parameter")
    chain = type(inner).__name__ if wrapper is inner else f"{type(wrapper).__name__} around {type(inner).__name__}"
    float8 = float8_summary(ds.module)  # precision fp8: the layers' float8 GEMMs
    return (f"precision plan: parameters {names[params[0].dtype]}, gradient accumulation "
            f"{names[ds.get_data_types()[1]]}, dp reduction {names[ds.communication_data_type]}, master weights "
            f"{where}; optimizer {chain}"
            + (f"; {float8}" if float8 else ""))


def held_state_bytes(ds) -> dict:
    """Bytes this rank holds for parameters, gradients and the optimizer wrapper's buffers and state (each
    storage counted once, under the first of those it is found in): what gptpar.estimate.memory estimates."""
    seen, out = set(), {}
    params = list(ds.module.parameters())
    out["parameters"] = _storage_bytes(params, seen)
    out["gradients"] = _storage_bytes([p.grad for p in params], seen)
    wrapper, inner = optimizers(ds)
    held = [list(vars(opt).values()) + [p.grad for g in opt.param_groups for p in g["params"]]
            for opt in {id(wrapper): wrapper, id(inner): inner}.values()]
    out["optimizer"] = _storage_bytes(held + [list(inner.state.values())], seen)
    out["total"] = sum(out.values())
    return out


def optimizer_state_bytes(ds) -> int:
    """Bytes of the client optimizer's own state on this rank: Adam's two moments (for adamw8bit their uint8
    codes, block scales and quantisation maps), without the master weights a DeepSpeed wrapper keeps."""
    return _storage_bytes(list(optimizers(ds)[1].state.values()), set())


def _storage_bytes(obj, seen: set, depth: int = 0) -> int:
    """Bytes of the tensors in `obj` (nested lists, tuples and dicts: the optimizers keep theirs in attributes
    of those kinds), each storage counted once across calls sharing `seen`; meta tensors hold nothing."""
    if torch.is_tensor(obj):
        storage = obj.untyped_storage() if obj.device.type != "meta" else None
        if storage is None or storage.data_ptr() in seen or not storage.nbytes():
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if depth < 5 and isinstance(obj, (list, tuple, dict)):
        items = obj.values() if isinstance(obj, dict) else obj
        return sum(_storage_bytes(item, seen, depth + 1) for item in items)
    return 0
