"""The dry-run report: what a config means before any GPU is touched.

`render_dry_run(config, dp_size)` is pure formulas (gptpar.estimate.flops / memory): the resolved config,
the pipeline partition, parameters per stage and per tp rank, memory per GPU, and the TFLOPs that given
seconds per iteration (or measured runs of the same shape) would mean. The trainer's `--dry-run` prints it,
adding the exact count of the real model built on the meta device.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence, Tuple

from gptpar.estimate.flops import (exact_model_params, model_size_formula, params_per_stage, resolve_partition_method,
                                   stage_layer_ranges, tflops_per_gpu)
from gptpar.estimate.memory import GIB
from gptpar.estimate.settings import embedding_kind, memory_of, settings_of
from gptpar.model.config import pad_vocab_size
from gptpar.estimate.float8_gemms import describe_float8_gemms, layer_float8_gemms
from gptpar.config import Config


def _fmt(n: float) -> str:
    return f"{n:,.0f}"


def render_dry_run(config: Config, dp_size: int, sec_per_iter: Optional[float] = None,
                   meta_param_count: Optional[int] = None, measured: Sequence[Tuple] = ()) -> str:
    """The report for `config` on dp_size data-parallel ranks; meta_param_count (the real model's unique
    parameters on the meta device) is compared. `measured`: rows (where, layers, hidden, tp, pp, dp, mbs, gbs,
    sec/it, printed TFLOPs, formula) of runs whose TFLOPs to recompute when their shape is this model's
    (tests/data/seed_runs.json holds the seeds' runs)."""
    s = settings_of(config, dp_size)
    cfg = config.to_dict()
    cfg["parallel"]["data_parallel_size"] = dp_size
    L, h, tp, pp, dp = s["num_layers"], s["hidden_size"], s["tp_size"], s["pp_size"], s["dp_size"]
    v, v_pad, seq = s["vocab_size"], s["padded_vocab_size"], s["seq_length"]
    mbs, gbs = s["micro_batch_size"], s["global_batch_size"]
    shape = dict(num_layers=L, hidden_size=h, vocab_size=v, seq_length=seq, pp_size=pp, tp_size=tp,
                 partition_method=s["partition_method"], embedding_weight=s["embedding_weight"],
                 ffn_hidden_size=s["ffn_hidden_size"],
                 max_position_embeddings=s["max_position_embeddings"],
                 make_vocab_size_divisible_by=s["make_vocab_size_divisible_by"], **embedding_kind(s))
    lines = ["== resolved config =="]
    for section in ("model", "parallel", "training", "data", "checkpoint", "logging", "deepspeed"):
        if cfg.get(section):
            lines.append(f"{section}: {json.dumps(cfg[section], sort_keys=True)}")
    world = tp * pp * dp
    lines.append(f"derived: world_size={world} (tp {tp} x pp {pp} x dp {dp}), padded_vocab_size={v_pad}, "
                 f"micro_batches={gbs // (mbs * dp) if gbs else '?'} per step, ffn_hidden_size={s['ffn_hidden_size']}")

    ranges = stage_layer_ranges(L, pp, s["partition_method"], s["embedding_weight"])
    method = resolve_partition_method(s["partition_method"], L, pp, s["embedding_weight"])
    unique = params_per_stage(**shape)
    per_rank = params_per_stage(**shape, per_tp_rank=True)
    mem = memory_of(s)
    lines += ["", f"== pipeline partition ({method}, from {s['partition_method']!r}) and parameters ==",
              f"{'stage':>5} {'blocks':>11} {'extra':<28} {'params':>17} {'per tp rank':>15} {'mem/GPU GiB':>11}"]
    for i, ((a, b), u, r, m) in enumerate(zip(ranges, unique, per_rank, mem["stages"])):
        extra = []
        if i == 0:
            extra.append("embedding" + (" + positions" if s["position_embedding_type"] == "learned" else "")
                         + (" + LN" if s["embed_layernorm"] else ""))
        if i == pp - 1:
            extra.append("tied embedding + final LN" if pp > 1 else "final LN")
        lines.append(f"{i:>5} {f'[{a}, {b})':>11} {', '.join(extra):<28} {_fmt(u):>17} {_fmt(r):>15} "
                     f"{m['total'] / GIB:>11.1f}")
    exact = exact_model_params(**{k: shape[k] for k in ("num_layers", "hidden_size", "vocab_size", "seq_length",
                                                           "tp_size", "ffn_hidden_size", "max_position_embeddings",
                                                           "make_vocab_size_divisible_by",
                                                           "position_embedding_type", "embed_layernorm")})
    tied = v_pad * h if pp > 1 else 0
    lines += [f"sum over stages: {_fmt(sum(unique))} = model {_fmt(exact)} + tied output-embedding copy {_fmt(tied)}",
              f"model size formula (seed 000, unpadded vocab): {_fmt(model_size_formula(L, h, v, seq))} "
              f"({model_size_formula(L, h, v, seq) / 1e9:.1f}B)"]
    if meta_param_count is not None:
        lines.append(f"real model on the meta device: {_fmt(meta_param_count)} "
                     f"({'matches' if meta_param_count == exact else 'DIFFERS FROM'} the formula {_fmt(exact)})")

    worst = mem["max"]
    lines += ["", f"== memory per GPU ({s['precision']}, {s['optimizer']}, ZeRO-{s['zero_stage']} over dp={dp}, "
                  f"micro batch {mbs}, "
                  f"recompute {s['activation_checkpointing']}) ==",
              f"heaviest stage {worst['stage']}: weights {worst['weights'] / GIB:.1f} + grads "
              f"{worst['gradients'] / GIB:.1f} + optimizer {worst['optimizer'] / GIB:.1f} + activations "
              f"{worst['activations'] / GIB:.1f}"
              + (f" + float8 casts {worst['float8_casts'] / GIB:.2f}" if worst["float8_casts"] else "")
              + f" + CUDA context {worst['cuda_context'] / GIB:.1f} = {worst['total'] / GIB:.1f} GiB"]
    if s["precision"] == "fp8":
        lines += ["", f"== float8 GEMMs (training.precision fp8, fp8_recipe {s['fp8_recipe']}; "
                      "gptpar.estimate.float8_gemms.plan_float8_gemm) ==",
                  describe_float8_gemms(layer_float8_gemms(h, s["ffn_hidden_size"], tp), tp),
                  "model FLOPs and TFLOPs unchanged (padding adds hardware FLOPs the count leaves out); weights, "
                  "optimizer state and checkpoints as bf16's"]

    lines += ["", "== TFLOPs per GPU that measured seconds/iteration imply (recompute on; padded vocab) =="]
    runs = [tuple(r) for r in measured if (r[1], r[2]) == (L, h)]
    if sec_per_iter:
        runs.insert(0, ("given --sec-per-iter", L, h, tp, pp, dp, mbs, gbs, sec_per_iter, None, ""))
    if not runs:
        lines.append("no measured run of this shape given (pass sec_per_iter)")
    for where, _, _, rtp, rpp, rdp, rmbs, rgbs, sec, printed, how in runs:
        kw = dict(num_layers=L, hidden_size=h, seq_length=seq, global_batch_size=rgbs, sec_per_iter=sec,
                  num_gpus=rtp * rpp * rdp, tp_size=rtp, ffn_hidden_size=s["ffn_hidden_size"])
        vr = pad_vocab_size(v, rtp, s["make_vocab_size_divisible_by"])   # padded for that run's tp
        imp = tflops_per_gpu(vocab_size=vr, **kw)
        leg = tflops_per_gpu(vocab_size=vr, formula="legacy", **kw)
        seed = f"seed printed {printed} ({how})" if printed is not None else ""
        lines.append(f"{where}: tp{rtp} pp{rpp} dp{rdp} mbs{rmbs} gbs{rgbs} {sec} s/it -> improved {imp:.2f}, "
                     f"legacy {leg:.2f} TFLOPs; {seed}")
    return "\n".join(lines) + "\n"


__all__ = ["render_dry_run"]
