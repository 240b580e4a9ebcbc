"""3D-topology planning: the time model and the search over (tp, pp, dp, micro batch).

The planner enumerates (tp, pp, dp, micro batch) for a model on `nodes x gpus_per_node` GPUs, drops what
cannot run (hard constraints), flags what runs badly or breaks the batch ramp-up (soft constraints),
and ranks the rest by a predicted time per iteration (the time model below, documented in
docs/planning.md). Pure functions; the CLI lives in tools/plan_topology.py.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import List, Optional

from gptpar.estimate.flops import model_flops_per_iteration, params_per_stage, stage_layer_ranges, tflops_per_gpu
from gptpar.estimate.kinds import Assumptions, DEFAULT_KIND, load_kind
from gptpar.estimate.memory import GIB, MOMENT_BYTES
from gptpar.estimate.settings import embedding_kind, memory_of, require
from gptpar.model.config import check_tp_divides, pad_vocab_size, recompute_mode
from gptpar.tensor_parallel.float8_shapes import float8_flags, layer_float8_gemms
from gptpar.schedules import rampup_split_problem


# ---------------------------------------------------------------------------------------------
# The time model
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    """Facts of one GPU kind and its cluster that the time model uses (defaults: the a100-80gb kind; every kind's
    numbers and their sources: gptpar/estimate/calibrations/kinds/)."""

    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    achieved_tflops: float = 202.5      # GEMM-bound model TFLOPs/GPU at a large micro batch, no communication:
                                        # the rate at which this model reproduces the measured A100 runs' best
                                        # 1-node row (6 layers, tp 8, mbs 2, gbs 512: 119.19 s = 157 TFLOPs)
    mbs_half_point: float = 0.25        # efficiency(b) = b / (b + 0.25): small GEMMs and launches at small b
    intra_node_gbps: float = 150.0      # GB/s all-reduce bus bandwidth inside a node (NVLink)
    inter_node_gbps: float = 200.0      # GB/s per node between nodes (DGX A100: 8 x 200 Gb/s, one NIC per GPU)
    tile_penalty: float = 0.80          # hidden % 128 != 0 (measured: 14400 vs 13824, 94 vs 120 TFLOPs)
    softmax_penalty: float = 0.90       # (heads/tp)*mbs % 4 != 0: no fused softmax kernel
    soft_rank_penalty: float = 0.05     # ranking penalty per batch-ramp-up incompatibility
    peak_tflops: float = 312.0          # dense bf16/fp16 Tensor Core peak (datasheet)
    hbm_tb_s: float = 2.039             # HBM bandwidth, TB/s (datasheet): the memory-bound terms
    fp8_layer_speedup: float = 1.0      # a layer's fp8 GEMMs vs bf16 (measured on an H100; 1 = no fp8 units)
    attention_tflops: float = 0.0       # the attention core's (QK^T, softmax, AV) counted FLOP/s; 0 = the GEMM rate
    name: str = "a100-80gb"

    @property
    def inter_node_gbps_per_gpu(self) -> float:
        return self.inter_node_gbps / self.gpus_per_node


@dataclass
class Candidate:
    tp: int
    pp: int
    dp: int
    mbs: int
    nodes: int
    global_batch_size: int
    micro_batches: int
    mem_gib: float
    sec_per_iter: float              # predicted, at global_batch_size
    sec_per_requested_batch: float   # scaled to the requested global batch (ranks configs fairly)
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    score: float
    soft: List[str] = field(default_factory=list)
    days: Optional[float] = None     # to train the settings' train_samples at sec_per_requested_batch
    gpu_hours: Optional[float] = None
    optimizer_s: float = 0.0
    loss_s: float = 0.0
    tflops_per_gpu: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def compute_rate(hw: Hardware, hidden_size: int, num_attention_heads: int, tp: int, mbs: int) -> float:
    """FLOP/s one GPU achieves on the model's compute at this shape: achieved_tflops x efficiency(mbs) x penalties."""
    rate = hw.achieved_tflops * 1e12 * mbs / (mbs + hw.mbs_half_point)
    if hidden_size % 128:
        rate *= hw.tile_penalty
    if (num_attention_heads // tp) * mbs % 4:
        rate *= hw.softmax_penalty
    return rate


def attention_flops(s: dict, gbs: int, mode: str) -> float:
    """The attention core's share of model_flops_per_iteration: 4sh per layer and token forward (QK^T and AV), times
    3 (forward + backward), 4 with full recompute, plus one more forward with selective recompute."""
    times = {"full": 4, "selective": 4, "none": 3}[mode]
    return float(gbs * s["seq_length"]) * s["num_layers"] * 4 * s["seq_length"] * s["hidden_size"] * times


# HBM bytes per attention score of an unfused attention core (Megatron-LM's and Megatron-DeepSpeed's before flash
# attention: the 176B prequel's runs, the published A100 runs), each b x heads/tp x s^2 fp16 tensor counted as its
# kernels read and write it. Forward: QK^T's baddbmm writes the scores (2), the fused scale-mask-softmax reads and
# writes them (4), dropout reads them and writes its output and a 1-byte mask (5), AV's bmm reads them (2). Backward:
# AV's gradient written and the probabilities read for V's (4), dropout's backward (5), softmax's backward reads the
# gradient and its output and writes (6), the baddbmm's backward reads the gradient for Q and for K (4).
SCORES_BYTES_FORWARD = 13
SCORES_BYTES_BACKWARD = 19


def attention_scores_s(hw: Hardware, seq: int, heads: int, tp: int, mbs: int, mode: str) -> float:
    """Seconds one layer's unfused attention core spends moving its scores through HBM per micro batch: the
    mbs x heads/tp x seq^2 score elements x SCORES_BYTES_FORWARD (twice with full or selective recompute, which both
    run the attention forward again) + SCORES_BYTES_BACKWARD, at the kind's HBM bandwidth. Flash attention (gptpar's
    SDPA) keeps the scores on chip: `predict` adds this only for settings with flash_attention False."""
    passes = 1 if mode == "none" else 2
    elements = mbs * (heads // tp) * seq * seq
    return elements * (passes * SCORES_BYTES_FORWARD + SCORES_BYTES_BACKWARD) / (hw.hbm_tb_s * 1e12)


def fp8_factor(s: dict, tp: int, hw: Hardware) -> float:
    """How much faster a layer runs with training.precision fp8: the measured layer speed-up on the share of the
    layer's GEMM FLOPs that run in float8 at this tp (gptpar.tensor_parallel.float8_shapes' plan); 1 for other precisions."""
    if s.get("precision") != "fp8" or hw.fp8_layer_speedup == 1.0:
        return 1.0
    gemms = layer_float8_gemms(s["hidden_size"], s["ffn_hidden_size"] or 4 * s["hidden_size"], tp)
    total = sum(g.in_features * g.out_features for g in gemms)
    fp8 = sum(g.in_features * g.out_features for g in gemms if g.mode != "bf16")
    share = fp8 / total if total else 0.0
    return 1.0 / (1.0 - share + share / hw.fp8_layer_speedup)


def predict(s: dict, tp: int, pp: int, dp: int, mbs: int, gbs: int, hw: Hardware,
            assume: Assumptions = Assumptions()) -> dict:
    """Predicted seconds per iteration, split into its parts (each term's formula: docs/planning.md).

    m = gbs/(dp*mbs) micro batches pass a pp-stage pipeline (1F1B; interleaved with v virtual stages under
    --assume interleaved=v): (m + (pp - 1)/v) slots, each slot one micro batch through one stage: its compute
    (the FLOPs at the kind's rates; with settings flash_attention False, as the published A100 runs ran, also the
    unfused attention core's score traffic through HBM),
    its exposed tensor-parallel communication, its stage-to-stage sends (v of each) and, on the last stage, the
    memory-bound loss. Then what the optimizer step costs outside the pipeline: the data-parallel gradient
    reduction and ZeRO-1's parameter all-gather (as gptpar runs them: after the last backward, not overlapped),
    the tied embedding's gradient all-reduce, and the optimizer's memory-bound update.
    """
    L, h, seq = s["num_layers"], s["hidden_size"], s["seq_length"]
    heads, v = s["num_attention_heads"], pad_vocab_size(s["vocab_size"], tp, s["make_vocab_size_divisible_by"])
    vs = assume.interleaved
    m = gbs // (dp * mbs)
    if vs > 1 and (pp == 1 or L % (pp * vs) or m % pp):
        raise ValueError(f"--assume interleaved={vs} needs pp > 1, num_layers ({L}) divisible by pp x {vs} and the "
                         f"micro batches per step ({m}) by pp ({pp})")
    mode = recompute_mode(s["activation_checkpointing"])
    rate = compute_rate(hw, h, heads, tp, mbs) * fp8_factor(s, tp, hw)
    flops = model_flops_per_iteration(num_layers=L, hidden_size=h, vocab_size=v, seq_length=seq,
                                      global_batch_size=gbs, recompute=mode, ffn_hidden_size=s["ffn_hidden_size"],
                                      glu=str(s.get("activation", "gelu")).endswith("glu"))
    attention = attention_flops(s, gbs, mode)
    attention_rate = hw.attention_tflops * 1e12 if hw.attention_tflops else rate
    slot_compute = ((flops - attention) / rate + attention / attention_rate) / (m * dp * pp * tp)
    if s.get("flash_attention", True) is False:
        slot_compute += L / pp * attention_scores_s(hw, seq, heads, tp, mbs, mode)
    world = tp * pp * dp
    # tensor parallelism: 4 all-reduces per layer and micro batch (2 forward, 2 backward), 6 with full recompute
    # (the recomputed forward's); sequence parallelism turns each into a reduce-scatter + all-gather of the same bytes
    n_ar = 6 if mode == "full" else 4
    act_bytes = mbs * seq * h * 2
    # tp is the fastest rank axis: a tp that does not divide a node's GPUs has groups that straddle two nodes, and
    # every tp collective waits for the slowest group's link
    tp_bw = hw.intra_node_gbps * 1e9 if hw.gpus_per_node % tp == 0 else hw.inter_node_gbps_per_gpu * 1e9
    slot_tp = 0.0 if tp == 1 else (L / pp) * n_ar * act_bytes * 2 * (tp - 1) / tp / tp_bw
    if assume.tp_comm_overlap:   # hidden behind the GEMMs it is split with, what is left shows
        slot_tp = max(0.0, slot_tp - slot_compute)
    inter = hw.inter_node_gbps_per_gpu * 1e9
    p2p_bw = hw.intra_node_gbps * 1e9 if world <= hw.gpus_per_node else inter
    slot_pp = 0.0 if pp == 1 else vs * 2 * act_bytes / tp / p2p_bw   # activation out, its gradient back, per chunk
    # the loss on the last stage: fp32 logits written, softmax read and written, their gradient written
    slot_loss = mbs * seq * v / tp * 4 * 4 / (hw.hbm_tb_s * 1e12)
    slot = slot_compute + slot_tp + slot_pp + slot_loss
    slots = m + (pp - 1) / vs
    rank_params = max(params_per_stage(num_layers=L, hidden_size=h, vocab_size=s["vocab_size"], seq_length=seq,
                                       pp_size=pp, tp_size=tp, partition_method=s["partition_method"],
                                       embedding_weight=s.get("embedding_weight", 1),
                                       ffn_hidden_size=s["ffn_hidden_size"],
                                       make_vocab_size_divisible_by=s["make_vocab_size_divisible_by"],
                                       per_tp_rank=True, **embedding_kind(s)))
    dp_comm = _dp_comm(s, rank_params, tp, dp, hw, assume, slot_compute, mode)
    # pp > 1: the first and last stage all-reduce the tied word embedding's gradient (DeepSpeed's ReduceTiedGrads)
    grad_bytes = 4 if s.get("precision") == "fp32" else 2
    tied = 0.0 if pp == 1 else v * h / tp * grad_bytes / inter
    optimizer = _optimizer_step_s(s, rank_params, dp, hw, assume)
    return {"compute_s": m * slot_compute, "bubble_s": (pp - 1) / vs * slot_compute,
            "tp_comm_s": slots * slot_tp, "pp_comm_s": slots * slot_pp + tied, "dp_comm_s": dp_comm,
            "loss_s": slots * slot_loss, "optimizer_s": optimizer,
            "sec_per_iter": slots * slot + dp_comm + tied + optimizer,
            "assumptions": assume.names()}


def _dp_comm(s, rank_params, tp, dp, hw, assume, slot_compute, mode) -> float:
    """Seconds of the data-parallel exchange that the iteration waits for.

    gptpar (DeepSpeed's pipeline engine, pinned): after the last micro batch's backward, bf16's BF16_Optimizer
    all-reduces its gradients in bf16 (2 bytes), fp16's ZeRO-1 optimizer reduces each gradient partition to the rank
    that owns it (zero_optimization.reduce_scatter, on by default: a reduce-scatter's bytes); overlap_comm defaults
    off below stage 3. Then ZeRO-1's all-gather of the updated 2-byte parameters (mixed precision always runs ZeRO-1).
    What-ifs: distributed-optimizer reduce-scatters instead; ddp drops the all-gather; dp-comm-overlap hides the
    reduction behind one micro batch's backward (and, with distributed-optimizer, the all-gather behind one forward).
    """
    if dp == 1:
        return 0.0
    bw = hw.intra_node_gbps * 1e9 if tp * dp <= hw.gpus_per_node else hw.inter_node_gbps_per_gpu * 1e9
    fp32 = s.get("precision") == "fp32"
    grad_bytes = 4 if fp32 else 2
    ring = (dp - 1) / dp
    scatter = assume.distributed_optimizer or (s.get("precision") == "fp16" and not assume.ddp)
    reduce = rank_params * grad_bytes * ring * (1 if scatter else 2) / bw
    zero = (not fp32 or s.get("zero_stage", 0) >= 1) and not assume.ddp
    gather = rank_params * (4 if fp32 else 2) * ring / bw if zero or assume.distributed_optimizer else 0.0
    if assume.dp_comm_overlap:
        backward = slot_compute * (0.75 if mode == "full" else 2 / 3)
        reduce = max(0.0, reduce - backward)
        if assume.distributed_optimizer:
            gather = max(0.0, gather - (slot_compute - backward))
    return reduce + gather


def _optimizer_step_s(s, rank_params, dp, hw, assume) -> float:
    """The optimizer step is memory-bound: per parameter of the rank's shard it reads and writes the fp32 master copy
    and both moments, reads the fp32 gradient and writes the 2-byte weight; the whole fp32 gradient buffer is zeroed."""
    moments = MOMENT_BYTES.get(s.get("optimizer", "adamw"), 8.0)
    fp32 = s.get("precision") == "fp32"
    sharded = (not fp32 or s.get("zero_stage", 0) >= 1) and not assume.ddp
    shard = dp if sharded else 1
    per_param = (2 * (4 + moments) + 4 + (0 if fp32 else 2)) / shard + 4
    return rank_params * per_param / (hw.hbm_tb_s * 1e12)


def predict_layout(s: dict, hw: Hardware, assume: Assumptions = Assumptions()) -> dict:
    """`predict` for the layout the settings (a config) name: their tp, pp, dp, micro and global batch, plus
    the model TFLOPs per GPU it means (`tflops_per_gpu`), the heaviest stage's memory in GiB (`mem_gib`,
    gptpar.estimate.settings.memory_of) and whether it fits `hw.gpu_mem_gib` (`fits`)."""
    require(s, "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "global_batch_size")
    tp, pp, dp, mbs, gbs = s["tp_size"], s["pp_size"], s["dp_size"], s["micro_batch_size"], s["global_batch_size"]
    out = predict(s, tp, pp, dp, mbs, gbs, hw, assume)
    mem = memory_of(s, virtual_stages=assume.interleaved)["max"]["total"] / GIB
    out.update(mem_gib=mem, fits=mem <= hw.gpu_mem_gib, tflops_per_gpu=tflops_of(s, tp, pp, dp, gbs,
                                                                                 out["sec_per_iter"]))
    return out


def tflops_of(s: dict, tp: int, pp: int, dp: int, gbs: int, sec_per_iter: float) -> float:
    """Model TFLOPs per GPU (improved formula, the config's recompute mode) that `sec_per_iter` means."""
    return tflops_per_gpu(num_layers=s["num_layers"], hidden_size=s["hidden_size"],
                          vocab_size=pad_vocab_size(s["vocab_size"], tp, s["make_vocab_size_divisible_by"]),
                          seq_length=s["seq_length"], global_batch_size=gbs, sec_per_iter=sec_per_iter,
                          num_gpus=tp * pp * dp, recompute=s["activation_checkpointing"],
                          ffn_hidden_size=s["ffn_hidden_size"],
                          glu=str(s.get("activation", "gelu")).endswith("glu"))


def training_time(train_samples: Optional[int], global_batch_size: int, sec_per_iter: float,
                  num_gpus: int) -> Optional[dict]:
    """Days and GPU-hours to train `train_samples` at `sec_per_iter` per global batch (a ramp-up's smaller
    batches counted at the full batch's time per sample); None without a sample count."""
    if not train_samples:
        return None
    seconds = train_samples / global_batch_size * sec_per_iter
    return {"days": seconds / 86400, "gpu_hours": seconds / 3600 * num_gpus}


# ---------------------------------------------------------------------------------------------
# GPU kinds: the shipped kinds (calibrations/kinds/), and calibrations (measured seconds per layer, bench_layer.py)
# ---------------------------------------------------------------------------------------------

CALIBRATIONS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibrations")


@dataclass(frozen=True)
class GpuKind:
    """A GPU kind the plan predicts for: its name, where its compute rate comes from, its Hardware, and how the
    calibrated shape differs from the config's (empty for a shipped kind)."""

    name: str
    source: str
    hardware: Hardware
    notes: tuple = ()


def hardware_of(name: str, gpus_per_node: int = 8, gpu_mem_gib: Optional[float] = None) -> Hardware:
    """The Hardware of a shipped GPU kind (gptpar/estimate/calibrations/kinds/NAME.json); `gpu_mem_gib` overrides
    its memory (plan_topology's --gpu-mem). ValueError naming the known kinds for an unknown one."""
    k = load_kind(name)
    return Hardware(gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem_gib or k["gpu_mem_gib"],
                    achieved_tflops=k["achieved_tflops"], mbs_half_point=k["mbs_half_point"],
                    intra_node_gbps=k["intra_node_gbps"], inter_node_gbps=k["inter_node_gbps_per_gpu"] * gpus_per_node,
                    tile_penalty=k["tile_penalty"], softmax_penalty=k["softmax_penalty"],
                    peak_tflops=k["peak_tflops"], hbm_tb_s=k["hbm_tb_s"], fp8_layer_speedup=k["fp8_layer_speedup"],
                    attention_tflops=k.get("attention_tflops") or 0.0, name=name)


def gpu_kind(name: str, gpus_per_node: int = 8, gpu_mem_gib: Optional[float] = None) -> GpuKind:
    """A shipped GPU kind as the plan names it: `a100-80gb (NVIDIA A100 80GB SXM)`, its facts' file as source."""
    k = load_kind(name)
    return GpuKind(name, f"{k['gpu']}: gptpar/estimate/calibrations/kinds/{name}.json",
                   hardware_of(name, gpus_per_node, gpu_mem_gib))


def shipped_calibrations() -> List[str]:
    """The calibration files gptpar ships (gptpar/estimate/calibrations/*.json), by name."""
    if not os.path.isdir(CALIBRATIONS_DIR):
        return []
    return sorted(f[:-len(".json")] for f in os.listdir(CALIBRATIONS_DIR) if f.endswith(".json"))


def kind_of_gpu(gpu: str) -> Optional[str]:
    """The shipped kind a measured GPU's name belongs to (`NVIDIA H100 80GB HBM3` -> h100-80gb), or None."""
    for needle, kind in (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-80gb")):
        if needle in str(gpu).upper():
            return kind
    return None


def calibrated_kind(path: str, s: dict, base: Optional[Hardware] = None, fallback: str = DEFAULT_KIND) -> GpuKind:
    """The GpuKind of a calibration file (or a shipped one's name, e.g. `h100`) for settings `s`: `base` (default:
    the shipped kind of the GPU it was measured on, else the `fallback` kind) with the measured compute rate."""
    cal = load_calibration(path)
    if base is None:
        base = hardware_of(kind_of_gpu(cal.get("gpu")) or fallback)
    hardware = calibrated_hardware(cal, s["activation_checkpointing"], base)
    when = f", measured {cal['date']}" if cal.get("date") else ""
    return GpuKind(cal["gpu"], f"calibration {cal['path']}{when}", hardware, tuple(calibration_notes(cal, s)))


# ---------------------------------------------------------------------------------------------
# Calibration: measured seconds per layer on a GPU kind (bench/bench_layer.py) -> that kind's Hardware
# ---------------------------------------------------------------------------------------------

_CALIBRATION_SHAPE = ("hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "micro_batch_size",
                      "tp_size")


def load_calibration(path: str) -> dict:
    """Read a calibration file written by bench/bench_layer.py --json, or a shipped one by name (`h100`: see
    `shipped_calibrations`); ValueError naming the file and the fix."""
    if not os.path.isfile(path) and path in shipped_calibrations():
        return dict(load_calibration(os.path.join(CALIBRATIONS_DIR, path + ".json")),
                    path=f"gptpar/estimate/calibrations/{path}.json")
    if not os.path.isfile(path):
        shipped = ", ".join(shipped_calibrations()) or "none"
        raise ValueError(f"--calibration {path!r}: no such file (shipped: {shipped}; write one with "
                         "bench/bench_layer.py --json FILE)")
    try:
        with open(path) as f:
            cal = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--calibration {path}: not valid JSON ({e})") from None
    if not isinstance(cal, dict):
        cal = {}
    shape, modes = cal.get("shape"), cal.get("modes")
    if not isinstance(shape, dict) or not isinstance(modes, dict) or not modes:
        raise ValueError(f"--calibration {path}: needs 'shape' and 'modes' (the output of bench/bench_layer.py --json)")
    missing = [k for k in _CALIBRATION_SHAPE if not isinstance(shape.get(k), int) or shape[k] < 1]
    if missing:
        raise ValueError(f"--calibration {path}: shape lacks positive integers for {missing}")
    for mode, r in modes.items():
        sec = r.get("sec_per_layer") if isinstance(r, dict) else None
        if mode not in ("none", "selective", "full") or not isinstance(sec, (int, float)) or sec <= 0:
            raise ValueError(f"--calibration {path}: mode {mode!r} needs sec_per_layer > 0 "
                             f"(modes are none, selective, full)")
    cal = dict(cal)
    cal.setdefault("gpu", os.path.basename(path))
    cal["path"] = path
    return cal


def calibrated_hardware(cal: dict, mode: str, base: Hardware = Hardware()) -> Hardware:
    """The Hardware of the calibration's GPU kind: `base` (a kind's links, HBM, attention rate and time-model curves)
    with `achieved_tflops` set so that the time model gives, at the calibrated shape, exactly the measured
    seconds per layer of `mode` (the layer's FLOPs at that micro batch / tp, less the attention core at the base's
    attention rate, divided by the measured time left, with the model's micro-batch efficiency and shape penalties
    at that shape taken back out), and the GPU's memory when the file has it. Optional `network`
    {intra_node_gbps, inter_node_gbps} in the file replaces the base's bandwidths."""
    mode = recompute_mode(mode)
    if mode not in cal["modes"]:
        raise ValueError(f"calibration {cal.get('path', '')} has no {mode!r} measurement (has "
                         f"{sorted(cal['modes'])}): rerun bench/bench_layer.py --modes none,selective,full")
    sh = cal["shape"]
    flops = model_flops_per_iteration(num_layers=1, hidden_size=sh["hidden_size"], vocab_size=0,
                                      seq_length=sh["seq_length"], global_batch_size=sh["micro_batch_size"],
                                      recompute=mode, ffn_hidden_size=sh["ffn_hidden_size"]) / sh["tp_size"]
    sec = cal["modes"][mode]["sec_per_layer"]
    if base.attention_tflops:   # the attention core at its own rate; the GEMMs' rate is what is left
        attention = attention_flops({"seq_length": sh["seq_length"], "hidden_size": sh["hidden_size"], "num_layers": 1},
                                    sh["micro_batch_size"], mode) / sh["tp_size"]
        sec -= attention / (base.attention_tflops * 1e12)
        flops -= attention
    measured = flops / sec
    unit = replace(base, achieved_tflops=1.0)   # the time model's shape factor alone
    factor = compute_rate(unit, sh["hidden_size"], sh["num_attention_heads"], sh["tp_size"],
                          sh["micro_batch_size"]) / 1e12
    network = cal.get("network") or {}
    return replace(base, achieved_tflops=measured / factor / 1e12,
                   gpu_mem_gib=cal.get("gpu_mem_gib") or base.gpu_mem_gib,
                   intra_node_gbps=network.get("intra_node_gbps", base.intra_node_gbps),
                   inter_node_gbps=network.get("inter_node_gbps", base.inter_node_gbps),
                   # a layer measured with float8 GEMMs (bench_layer --dtype fp8) has the speed-up in its rate already
                   fp8_layer_speedup=1.0 if cal.get("float8") else base.fp8_layer_speedup)


def calibration_notes(cal: dict, s: dict) -> List[str]:
    """Where the calibrated shape differs from the settings' (the rate is then carried over by the model)."""
    sh = cal["shape"]
    return [f"{k} {sh[k]} calibrated vs {s[k]} here" for k in _CALIBRATION_SHAPE
            if s.get(k) is not None and sh[k] != s[k]]


def plan_topology(s: dict, nodes: int, hw: Hardware = Hardware(), mbs_choices=(1, 2, 4, 8, 16),
                  assume: Assumptions = Assumptions()) -> List[Candidate]:
    """Every runnable (tp, pp, dp, mbs) on whole nodes of `nodes`, best first (see module doc)."""
    if nodes < 1 or hw.gpus_per_node < 1 or hw.gpu_mem_gib <= 0:
        raise ValueError("--nodes, --gpus-per-node and --gpu-mem must be positive")
    require(s, "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "global_batch_size")
    L, h, heads, gbs_req = s["num_layers"], s["hidden_size"], s["num_attention_heads"], s["global_batch_size"]
    total = nodes * hw.gpus_per_node
    out = []
    for tp in range(1, hw.gpus_per_node + 1):
        try:
            check_tp_divides(tp, num_attention_heads=heads, hidden_size=h, ffn_hidden_size=s["ffn_hidden_size"])
        except ValueError:
            continue
        for pp in range(1, L + 1):
            try:
                stage_layer_ranges(L, pp, s["partition_method"], s.get("embedding_weight", 1))
            except ValueError:
                continue
            for dp in range(1, total // (tp * pp) + 1):
                world = tp * pp * dp
                if world % hw.gpus_per_node:      # whole nodes only
                    continue
                for mbs in sorted(set(mbs_choices) | {s["micro_batch_size"]}):
                    c = _candidate(s, tp, pp, dp, mbs, gbs_req, world // hw.gpus_per_node, hw, assume)
                    if c is not None:
                        out.append(c)
    out.sort(key=lambda c: (c.score, c.tp * c.pp * c.dp))
    return out


def _candidate(s, tp, pp, dp, mbs, gbs_req, nodes, hw, assume=Assumptions()) -> Optional[Candidate]:
    gbs = gbs_req - gbs_req % (dp * mbs)          # trimmed to fit dp, as the reference runs trimmed theirs
    if gbs < dp * mbs:
        return None
    m = gbs // (dp * mbs)
    if assume.interleaved > 1 and (pp == 1 or s["num_layers"] % (pp * assume.interleaved) or m % pp):
        return None                               # the interleaved schedule cannot run this layout
    layout = dict(s, tp_size=tp, pp_size=pp, dp_size=dp, micro_batch_size=mbs, global_batch_size=gbs)
    try:
        mem = memory_of(layout, virtual_stages=assume.interleaved)["max"]["total"] / GIB
    except ValueError:                            # a stage whose layers the virtual stages do not divide
        return None
    if mem > hw.gpu_mem_gib:
        return None
    soft = []
    if gbs != gbs_req:
        soft.append(f"gbs {gbs_req}->{gbs}")
    rampup = s.get("rampup_batch_size")
    if rampup and rampup_split_problem(rampup[0], rampup[1], mbs, dp):
        soft.append("rampup")
    if (s["num_attention_heads"] // tp) * mbs % 4:
        soft.append("no fused softmax")
    if s["hidden_size"] % 128:
        soft.append("hidden%128")
    if s["precision"] == "fp8":  # which GEMMs this tp pads or keeps in bf16 (informational, not ranked)
        soft += float8_flags(layer_float8_gemms(s["hidden_size"], s["ffn_hidden_size"] or 4 * s["hidden_size"], tp))
    t = predict(s, tp, pp, dp, mbs, gbs, hw, assume)
    per_req = t["sec_per_iter"] * gbs_req / gbs
    n_ramp = sum(1 for f in soft if f == "rampup" or f.startswith("gbs"))
    cost = training_time(s.get("train_samples"), gbs_req, per_req, tp * pp * dp) or {}
    return Candidate(tp=tp, pp=pp, dp=dp, mbs=mbs, nodes=nodes, global_batch_size=gbs,
                     micro_batches=gbs // (dp * mbs), mem_gib=round(mem, 1), sec_per_iter=t["sec_per_iter"],
                     sec_per_requested_batch=per_req, compute_s=t["compute_s"], bubble_s=t["bubble_s"],
                     tp_comm_s=t["tp_comm_s"], pp_comm_s=t["pp_comm_s"], dp_comm_s=t["dp_comm_s"],
                     score=per_req * (1 + hw.soft_rank_penalty * n_ramp), soft=soft, days=cost.get("days"),
                     gpu_hours=cost.get("gpu_hours"), optimizer_s=t["optimizer_s"], loss_s=t["loss_s"],
                     tflops_per_gpu=tflops_of(s, tp, pp, dp, gbs, t["sec_per_iter"]))


__all__ = ["Hardware", "Candidate", "GpuKind", "compute_rate", "fp8_factor", "predict", "predict_layout", "tflops_of",
           "training_time", "hardware_of", "gpu_kind", "Assumptions", "DEFAULT_KIND",
           "shipped_calibrations", "calibrated_kind", "load_calibration", "calibrated_hardware",
           "calibration_notes", "plan_topology", "CALIBRATIONS_DIR", "kind_of_gpu", "attention_flops",
           "attention_scores_s", "SCORES_BYTES_FORWARD", "SCORES_BYTES_BACKWARD"]
