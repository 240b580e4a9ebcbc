"""Kernel choices, made in one place: apex's fused kernels when apex imports on a GPU, torch's otherwise.

apex is optional and never installed by gptpar (the PyPI package named `apex` is unrelated).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn

logger = logging.getLogger("gptpar")


@functools.lru_cache(maxsize=None)
def _apex():
    try:
        from apex.normalization import FusedLayerNorm  # noqa: F401
        from apex.optimizers import FusedAdam  # noqa: F401
        return True
    except Exception:  # ImportError, or a broken build without its CUDA extensions
        return False


def use_apex() -> bool:
    return torch.cuda.is_available() and _apex()


def make_layer_norm(hidden_size: int, eps: float, device=None, dtype=None) -> nn.Module:
    if use_apex() and (device is None or torch.device(device).type == "cuda"):
        from apex.normalization import FusedLayerNorm
        return FusedLayerNorm(hidden_size, eps=eps).to(device=device, dtype=dtype)
    return nn.LayerNorm(hidden_size, eps=eps, device=device, dtype=dtype)


def make_adamw(params, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
               device: torch.device = torch.device("cpu")) -> torch.optim.Optimizer:
    """apex FusedAdam (adam_w_mode) on GPU when present; else torch's fused AdamW (CUDA and CPU).

    On CPU the fused kernel updates each parameter in one vectorised pass; foreach makes ~10 passes over
    parameters and states (docs/benchmarks.md has the step times)."""
    if device.type == "cuda" and use_apex():
        from apex.optimizers import FusedAdam
        return FusedAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)


def describe_kernels(device: torch.device, optimizer: str = "adamw", compiled: bool = False) -> str:
    """One line for the start-up log: which kernels this run uses (`optimizer`: training.optimizer; `compiled`:
    training.compile, the transformer layers through torch.compile's inductor)."""
    if device.type == "cuda":
        ln = "apex FusedLayerNorm" if use_apex() else "torch LayerNorm"
        opt = "apex FusedAdam" if use_apex() else "torch AdamW (fused)"
        attn = "SDPA (flash / memory-efficient when eligible)"
    else:
        ln, opt, attn = "torch LayerNorm", "torch AdamW (fused)", "SDPA (CPU flash kernel)"
    if optimizer == "adamw8bit":
        opt = "bitsandbytes AdamW8bit"
    layers = "torch.compile (inductor, one graph for every layer)" if compiled else "eager"
    return f"kernels: layernorm={ln} | optimizer={opt} | attention={attn} | transformer layers={layers}"
