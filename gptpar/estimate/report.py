"""The dry-run report: what a config means before any GPU is touched.

`render_dry_run(config, dp_size)` is pure formulas (gptpar.estimate.flops / memory / planner): first the plan
(GPUs, the heaviest stage's memory against each GPU kind's, predicted seconds per iteration and the days and
GPU-hours to train the config's samples), then the details: the pipeline partition, parameters per stage and per
tp rank, memory per GPU, the TFLOPs that given seconds per iteration (or measured runs of the same shape) would
mean, and the resolved config. The trainer's `--dry-run` prints it, adding the exact counts of the real model
built on the meta device.
"""
from __future__ import annotations

import json
from typing import List, Optional, Sequence, Tuple

from gptpar.estimate.flops import (exact_model_params, model_size_formula, params_per_stage, resolve_partition_method,
                                   stage_layer_ranges, tflops_per_gpu)
from gptpar.estimate.memory import GIB
from gptpar.estimate.kinds import DEFAULT_KIND, Assumptions, describe, kind_names
from gptpar.estimate.planner import GpuKind, gpu_kind, predict_layout, training_time
from gptpar.estimate.validation import error_band
from gptpar.estimate.settings import embedding_kind, memory_of, settings_of
from gptpar.model.config import pad_vocab_size
from gptpar.tensor_parallel.float8_shapes import describe_float8_gemms, layer_float8_gemms
from gptpar.config import Config


def _fmt(n: float) -> str:
    return f"{n:,.0f}"


def _billions(count: float) -> str:
    """A parameter count as people say it: 176.2B, 1.3B, or 2.6M below a billion (never 0.0B)."""
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def render_dry_run(config: Config, dp_size: int, sec_per_iter: Optional[float] = None,
                   meta_param_count: Optional[int] = None, measured: Sequence[Tuple] = (),
                   kinds: Optional[Sequence[GpuKind]] = None, meta_stage_params: Optional[Sequence[int]] = None,
                   assume: Assumptions = Assumptions()) -> str:
    """The report for `config` on dp_size data-parallel ranks; meta_param_count (the real model's unique
    parameters on the meta device) and meta_stage_params (each stage's) are compared with the formulas.
    `measured`: rows (where, layers, hidden, tp, pp, dp, mbs, gbs, sec/it, printed TFLOPs, formula) of runs whose
    TFLOPs to recompute when their shape is this model's (tests/data/seed_runs.json: the reference A100/V100 runs).
    `kinds`: the GPU kinds to predict for, the first ranks; None = plan_kinds (every shipped kind, none for an
    fp32 config: it plans for the CPU). `assume`: the what-ifs the time model applies."""
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
    exact = exact_model_params(**{k: shape[k] for k in ("num_layers", "hidden_size", "vocab_size", "seq_length",
                                                           "tp_size", "ffn_hidden_size", "max_position_embeddings",
                                                           "make_vocab_size_divisible_by",
                                                           "position_embedding_type", "embed_layernorm")})
    mem = memory_of(s)
    kinds = plan_kinds(s) if kinds is None else list(kinds)
    if not kinds:   # a CPU plan: no GPU's CUDA context, no caching allocator's reserve in the memory
        def cpu(m):
            return dict(m, total=m["peak_allocated"], cuda_context=0, allocator_reserve=0)
        mem = {"max": cpu(mem["max"]), "stages": [cpu(m) for m in mem["stages"]]}
    lines = render_plan(s, exact, mem["max"], kinds, sec_per_iter, assume)
    world = tp * pp * dp
    lines += ["", f"derived: world_size={world} (tp {tp} x pp {pp} x dp {dp}), padded_vocab_size={v_pad}, "
                  f"micro_batches={gbs // (mbs * dp) if gbs else '?'} per step, "
                  f"ffn_hidden_size={s['ffn_hidden_size']}"]

    ranges = stage_layer_ranges(L, pp, s["partition_method"], s["embedding_weight"])
    method = resolve_partition_method(s["partition_method"], L, pp, s["embedding_weight"])
    unique = params_per_stage(**shape)
    per_rank = params_per_stage(**shape, per_tp_rank=True)
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
    tied = v_pad * h if pp > 1 else 0
    lines += [f"sum over stages: {_fmt(sum(unique))} = model {_fmt(exact)} + tied output-embedding copy {_fmt(tied)}",
              "model size formula L(12h²+13h) + Vh + sh + 2h (unpadded vocab): "
              f"{_fmt(model_size_formula(L, h, v, seq))} "
              f"({_billions(model_size_formula(L, h, v, seq))})"]
    if meta_param_count is not None:
        lines.append(f"real model on the meta device: {_fmt(meta_param_count)} "
                     f"({'matches' if meta_param_count == exact else 'DIFFERS FROM'} the formula {_fmt(exact)})")
    if meta_stage_params is not None:
        differ = [f"stage {i}: {_fmt(m)} vs {_fmt(u)}" for i, (m, u) in enumerate(zip(meta_stage_params, unique))
                  if m != u]
        lines.append("real model's stages on the meta device: " + (
            "each matches its row of the table" if not differ else "DIFFER FROM the table: " + "; ".join(differ)))

    worst = mem["max"]
    lines += ["", f"== memory per GPU ({s['precision']}, {s['optimizer']}, ZeRO-{s['zero_stage']} over dp={dp}, "
                  f"micro batch {mbs}, "
                  f"recompute {s['activation_checkpointing']}) ==",
              f"heaviest stage {worst['stage']}: weights {worst['weights'] / GIB:.1f} + grads "
              f"{worst['gradients'] / GIB:.1f} + optimizer {worst['optimizer'] / GIB:.1f} + "
              + _transient(worst)
              + (f" + float8 casts {worst['float8_casts'] / GIB:.2f}" if worst["float8_casts"] else "")
              + f" = peak allocated {worst['peak_allocated'] / GIB:.1f}"
              + (f"; + allocator reserve {worst['allocator_reserve'] / GIB:.1f} + CUDA context "
                 f"{worst['cuda_context'] / GIB:.1f} = {worst['total'] / GIB:.1f}" if worst["cuda_context"] else "")
              + " GiB"]
    if s["precision"] == "fp8":
        lines += ["", f"== float8 GEMMs (training.precision fp8, fp8_recipe {s['fp8_recipe']}; "
                      "gptpar.tensor_parallel.float8_shapes.plan_float8_gemm) ==",
                  describe_float8_gemms(layer_float8_gemms(h, s["ffn_hidden_size"], tp), tp),
                  "model FLOPs and TFLOPs unchanged (padding adds hardware FLOPs the count leaves out); weights, "
                  "optimizer state and checkpoints as bf16's"]

    lines += ["", "== TFLOPs per GPU that measured seconds/iteration imply (recompute on; padded vocab) =="]
    runs = [tuple(r) for r in measured if (r[1], r[2]) == (L, h)]
    if sec_per_iter:
        runs.insert(0, ("given --sec-per-iter", L, h, tp, pp, dp, mbs, gbs, sec_per_iter, None, ""))
    if not runs:
        lines.append("no measured run of this shape given (pass --sec-per-iter S)")
    for where, _, _, rtp, rpp, rdp, rmbs, rgbs, sec, printed, how in runs:
        kw = dict(num_layers=L, hidden_size=h, seq_length=seq, global_batch_size=rgbs, sec_per_iter=sec,
                  num_gpus=rtp * rpp * rdp, tp_size=rtp, ffn_hidden_size=s["ffn_hidden_size"])
        vr = pad_vocab_size(v, rtp, s["make_vocab_size_divisible_by"])   # padded for that run's tp
        imp = tflops_per_gpu(vocab_size=vr, **kw)
        leg = tflops_per_gpu(vocab_size=vr, formula="legacy", **kw)
        logged = f"its log printed {printed} ({how})" if printed is not None else ""
        lines.append(f"{where}: tp{rtp} pp{rpp} dp{rdp} mbs{rmbs} gbs{rgbs} {sec} s/it -> improved {imp:.2f}, "
                     f"legacy {leg:.2f} TFLOPs; {logged}")
    lines += ["", "== resolved config =="]
    for section in ("model", "parallel", "training", "data", "checkpoint", "logging", "deepspeed"):
        if cfg.get(section):
            lines.append(f"{section}: {json.dumps(cfg[section], sort_keys=True)}")
    return "\n".join(lines) + "\n"


def is_cpu_config(s: dict) -> bool:
    """An fp32 config: gptpar's CPU configs are fp32, a GPU run would use bf16, fp16 or fp8."""
    return s["precision"] == "fp32"


def plan_kinds(s: dict, gpu: Optional[str] = None) -> List[GpuKind]:
    """The GPU kinds a plan predicts for, the one it ranks by first: `gpu`, then the other shipped kinds; with no
    `gpu`, a100-80gb first, and none for an fp32 (CPU) config."""
    if gpu is None and is_cpu_config(s):
        return []
    first = gpu or DEFAULT_KIND
    return [gpu_kind(first)] + [gpu_kind(k) for k in kind_names() if k != first]


def nodes_phrase(world: int, gpus_per_node: int) -> str:
    """`40 nodes x 8 GPUs per node`, or what the world is when it is not whole nodes."""
    if world < gpus_per_node:
        return f"1 node x {world} GPU{'s' if world > 1 else ''}"
    if world % gpus_per_node:
        return f"{world / gpus_per_node:.2f} nodes of {gpus_per_node} GPUs (not whole nodes)"
    nodes = world // gpus_per_node
    return f"{nodes} node{'s' if nodes > 1 else ''} x {gpus_per_node} GPUs per node"


def sig3(x: float) -> str:
    """Three significant digits, never in exponent form for the sizes a plan prints (0.000412, 1.23, 208)."""
    if x == 0:
        return "0"
    from math import floor, log10
    digits = max(0, 2 - int(floor(log10(abs(x)))))
    return f"{x:.{digits}f}"


def assumptions_line(assume: Assumptions) -> str:
    """What the time model assumed: gptpar's own behaviour, or each what-if by name."""
    if not assume.names():
        return ("assumes:  what gptpar runs (1F1B schedule; tp communication exposed; gradient all-reduce then ZeRO-1 "
                "all-gather after the last backward, not overlapped); what-ifs: --assume")
    return "assumes:  " + "; ".join(f"{flag} ({meaning})" for flag, meaning in describe(assume))


def render_plan(s: dict, params: int, heaviest: dict, kinds: Sequence[GpuKind],
                sec_per_iter: Optional[float] = None, assume: Assumptions = Assumptions()) -> List[str]:
    """The answer first: GPUs, the heaviest stage's memory against each kind's, predicted seconds per iteration and
    the days and GPU-hours to train the config's samples, each with the time model's error band on published runs of
    that kind (and the same for a measured --sec-per-iter). The first kind is the one the plan is for."""
    tp, pp, dp, gbs, samples = s["tp_size"], s["pp_size"], s["dp_size"], s["global_batch_size"], s["train_samples"]
    world, per_node = tp * pp * dp, kinds[0].hardware.gpus_per_node if kinds else 8
    need = heaviest["total"] / GIB
    where = f"for {kinds[0].name}" if kinds else "per process (an fp32 config: planned for the CPU, no GPU kind)"
    lines = ["== plan ==",
             f"GPUs:     {world:,} = {nodes_phrase(world, per_node)} (tp {tp} x pp {pp} x dp {dp})",
             f"model:    {_billions(params)} parameters, {s['num_layers']} layers x hidden {s['hidden_size']}, seq "
             f"{s['seq_length']}, {s['precision']}, recompute {s['activation_checkpointing']}",
             f"training: {samples:,} samples = {samples / gbs:,.0f} global batches of {gbs:,}",
             f"memory:   {need:.1f} GiB {'per GPU ' if kinds else ''}on the heaviest stage (stage {heaviest['stage']}"
             + (f"; with the allocator's reserve {heaviest['allocator_reserve'] / GIB:.1f} and the CUDA context "
                f"{heaviest['cuda_context'] / GIB:.1f})" if kinds else ")")]
    if not kinds:
        lines.append("GPU kinds: none for an fp32 config; pass --gpu KIND (a100-80gb, h100-80gb, h200) for a GPU plan")
    else:
        lines += [assumptions_line(assume), f"plan for {kinds[0].name}, then the other kinds; error band = the time "
                  "model on published measured runs of that kind ((all) = of every kind: none of its own yet)",
                  f"  {'GPU kind':<26} {'GPU memory':<22} {'s/iter':>8} {'days':>8} {'GPU-hours':>12}  "
                  f"{'error band':<24}  source"]
    for kind in kinds:
        t = predict_layout(s, kind.hardware, assume)
        fits = "fits" if need <= kind.hardware.gpu_mem_gib else "DOES NOT FIT"
        b = error_band(kind.hardware.name)
        band = (f"±{100 * b['median']:.0f}% med, ±{100 * b['worst']:.0f}% max"
                + (" (all)" if b["kind"] == "all" else ""))
        lines.append(_time_row(kind.name, f"{kind.hardware.gpu_mem_gib:.1f} GiB: {fits}", t["sec_per_iter"], s,
                               band, kind.source + (f"; measured at another shape ({', '.join(kind.notes)}), the "
                                                    "rate carried over" if kind.notes else "")))
    if sec_per_iter:
        rate = tflops_per_gpu(num_layers=s["num_layers"], hidden_size=s["hidden_size"],
                              vocab_size=s["padded_vocab_size"], seq_length=s["seq_length"], global_batch_size=gbs,
                              sec_per_iter=sec_per_iter, num_gpus=world, tp_size=tp,
                              recompute=s["activation_checkpointing"], ffn_hidden_size=s["ffn_hidden_size"])
        lines.append(_time_row("measured (--sec-per-iter)", "", sec_per_iter, s, "measured",
                               f"= {rate:.2f} TFLOPs per GPU (improved formula)"))
    return lines


def _time_row(kind: str, memory: str, sec: float, s: dict, band: str, source: str) -> str:
    world = s["tp_size"] * s["pp_size"] * s["dp_size"]
    cost = training_time(s["train_samples"], s["global_batch_size"], sec, world)
    return (f"  {kind[:26]:<26} {memory:<22} {sig3(sec):>8} {sig3(cost['days']):>8} {cost['gpu_hours']:>12,.0f}  "
            f"{band:<24}  {source}")



def _transient(st: dict) -> str:
    """The heaviest phase on top of the model states (gptpar.estimate.memory.memory_per_gpu's peak)."""
    fwd_bwd = st["activations"] + st["pipe_buffers"] + st["half_gradients"]
    if st["reduce_bucket"] > fwd_bwd:
        return f"dp-reduction bucket {st['reduce_bucket'] / GIB:.1f}"
    return (f"activations {st['activations'] / GIB:.1f}"
            + (f" + pipeline buffers {st['pipe_buffers'] / GIB:.1f}" if st["pipe_buffers"] else "")
            + (f" + bf16 gradients {st['half_gradients'] / GIB:.1f}" if st["half_gradients"] else ""))


def plan_json(config: Config, dp_size: int, kinds: Sequence[GpuKind], gpu: Optional[str],
              assume: Assumptions = Assumptions(), sec_per_iter: Optional[float] = None) -> str:
    """`pretrain_gpt.py --dry-run --json`: one JSON object, the plan for the first kind (gpu, gpus, sec_per_iter,
    tflops_per_gpu, memory_gib of the heaviest stage, fits, days, gpu_hours, assumptions, error_band, parts) and the
    same for every kind under `kinds`; gpu and the figures are null for an fp32 config planned without --gpu."""
    s = settings_of(config, dp_size)
    world = s["tp_size"] * s["pp_size"] * s["dp_size"]
    rows = []
    for kind in kinds:
        t = predict_layout(s, kind.hardware, assume)
        cost = training_time(s["train_samples"], s["global_batch_size"], t["sec_per_iter"], world)
        rows.append({"gpu": kind.name, "gpu_kind": kind.hardware.name, "source": kind.source,
                     "sec_per_iter": t["sec_per_iter"], "tflops_per_gpu": t["tflops_per_gpu"],
                     "memory_gib": t["mem_gib"], "gpu_mem_gib": kind.hardware.gpu_mem_gib, "fits": t["fits"],
                     "days": cost["days"], "gpu_hours": cost["gpu_hours"],
                     "error_band": error_band(kind.hardware.name),
                     "parts": {k: v for k, v in t.items() if k.endswith("_s")}})
    out = {"gpus": world, "tp": s["tp_size"], "pp": s["pp_size"], "dp": s["dp_size"],
           "micro_batch_size": s["micro_batch_size"], "global_batch_size": s["global_batch_size"],
           "train_samples": s["train_samples"], "precision": s["precision"],
           "recompute": s["activation_checkpointing"], "assumptions": assume.names()}
    if rows:
        out.update(rows[0])
    else:
        mem = memory_of(s)["max"]
        out.update(gpu=None, sec_per_iter=None, tflops_per_gpu=None, days=None, gpu_hours=None, fits=None,
                   memory_gib=(mem["total"] - mem["cuda_context"]) / GIB, error_band=None,
                   note="an fp32 config plans for the CPU: pass --gpu KIND for a GPU plan")
    out["kinds"] = rows
    if sec_per_iter:
        out["measured_sec_per_iter"] = sec_per_iter
    return json.dumps(out)


__all__ = ["render_dry_run", "render_plan", "plan_kinds", "plan_json", "is_cpu_config", "nodes_phrase", "sig3",
           "assumptions_line"]
