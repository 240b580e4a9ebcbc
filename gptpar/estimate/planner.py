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

from gptpar.estimate.flops import model_flops_per_iteration, params_per_stage, stage_layer_ranges
from gptpar.estimate.memory import GIB, memory_per_gpu
from gptpar.estimate.settings import embedding_kind, require
from gptpar.model.config import check_tp_divides, pad_vocab_size, recompute_mode
from gptpar.tensor_parallel.float8_shapes import float8_flags, layer_float8_gemms
from gptpar.schedules import rampup_split_problem


# ---------------------------------------------------------------------------------------------
# The time model
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    """Assumptions of the time model (defaults: the A100 80GB nodes of the measured Megatron-DeepSpeed runs in
    docs/planning.md)."""

    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    achieved_tflops: float = 197.0      # GEMM-bound model TFLOPs/GPU at a large micro batch, no communication:
                                        # the rate at which this model reproduces the measured A100 runs' best
                                        # 1-node row (6 layers, tp 8, mbs 2, gbs 512: 119.19 s = 157 TFLOPs)
    mbs_half_point: float = 0.25        # efficiency(b) = b / (b + 0.25): small GEMMs and launches at small b
    intra_node_gbps: float = 150.0      # GB/s all-reduce bus bandwidth inside a node (NVLink)
    inter_node_gbps: float = 400 / 8    # GB/s per node between nodes (400 Gbps: those runs' link maximum)
    tile_penalty: float = 0.80          # hidden % 128 != 0 (measured: 14400 vs 13824, 94 vs 120 TFLOPs)
    softmax_penalty: float = 0.90       # (heads/tp)*mbs % 4 != 0: no fused softmax kernel
    soft_rank_penalty: float = 0.05     # ranking penalty per batch-ramp-up incompatibility


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


def predict(s: dict, tp: int, pp: int, dp: int, mbs: int, gbs: int, hw: Hardware) -> dict:
    """Predicted seconds per iteration, split into its parts (see docs/planning.md).

    m = gbs/(dp*mbs) micro batches pass a pp-stage 1F1B pipeline: (m + pp - 1) slots, each slot one
    micro batch through one stage: its compute at efficiency(mbs) * achieved_tflops (times the soft
    penalties), its tensor-parallel all-reduces (6 per layer with recompute, 4 without, of b*s*h
    bf16 values, ring within a node) and its stage-to-stage send (b*s*h/tp per GPU, between nodes).
    Then the gradient all-reduce over dp (2 bytes per parameter of the rank, not overlapped).
    """
    L, h, seq = s["num_layers"], s["hidden_size"], s["seq_length"]
    heads, v = s["num_attention_heads"], pad_vocab_size(s["vocab_size"], tp, s["make_vocab_size_divisible_by"])
    m = gbs // (dp * mbs)
    rate = compute_rate(hw, h, heads, tp, mbs)
    flops = model_flops_per_iteration(num_layers=L, hidden_size=h, vocab_size=v, seq_length=seq,
                                      global_batch_size=gbs, recompute=s["activation_checkpointing"],
                                      ffn_hidden_size=s["ffn_hidden_size"])
    slot_compute = flops / (m * dp * pp * tp) / rate
    layers_per_stage = L / pp
    n_ar = 6 if s["activation_checkpointing"] == "full" else 4   # selective redoes no linear, no all-reduce
    ar_bytes = mbs * seq * h * 2
    slot_tp = 0.0 if tp == 1 else layers_per_stage * n_ar * ar_bytes * 2 * (tp - 1) / tp / (hw.intra_node_gbps * 1e9)
    per_gpu_inter = hw.inter_node_gbps * 1e9 / hw.gpus_per_node
    slot_pp = 0.0 if pp == 1 else 2 * ar_bytes / tp / per_gpu_inter
    slots = m + pp - 1
    rank_params = max(params_per_stage(num_layers=L, hidden_size=h, vocab_size=s["vocab_size"], seq_length=seq,
                                       pp_size=pp, tp_size=tp, partition_method=s["partition_method"],
                                       embedding_weight=s.get("embedding_weight", 1),
                                       ffn_hidden_size=s["ffn_hidden_size"],
                                       make_vocab_size_divisible_by=s["make_vocab_size_divisible_by"],
                                       per_tp_rank=True, **embedding_kind(s)))
    dp_bw = hw.intra_node_gbps * 1e9 if tp * dp <= hw.gpus_per_node else per_gpu_inter
    dp_comm = 0.0 if dp == 1 else rank_params * 2 * 2 * (dp - 1) / dp / dp_bw
    return {"compute_s": m * slot_compute, "bubble_s": (pp - 1) * slot_compute,
            "tp_comm_s": slots * slot_tp, "pp_comm_s": slots * slot_pp, "dp_comm_s": dp_comm,
            "sec_per_iter": slots * (slot_compute + slot_tp + slot_pp) + dp_comm}


def predict_layout(s: dict, hw: Hardware) -> dict:
    """`predict` for the layout the settings (a config) name: their tp, pp, dp, micro and global batch, plus
    the heaviest stage's memory in GiB (`mem_gib`) and whether it fits `hw.gpu_mem_gib` (`fits`)."""
    require(s, "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "global_batch_size")
    tp, pp, dp, mbs, gbs = s["tp_size"], s["pp_size"], s["dp_size"], s["micro_batch_size"], s["global_batch_size"]
    out = predict(s, tp, pp, dp, mbs, gbs, hw)
    mem = memory_per_gpu(num_layers=s["num_layers"], hidden_size=s["hidden_size"],
                         num_attention_heads=s["num_attention_heads"], vocab_size=s["vocab_size"],
                         seq_length=s["seq_length"], micro_batch_size=mbs, global_batch_size=gbs, tp_size=tp,
                         pp_size=pp, dp_size=dp, partition_method=s["partition_method"], precision=s["precision"],
                         embedding_weight=s.get("embedding_weight", 1), zero_stage=s["zero_stage"],
                         optimizer=s["optimizer"], activation_checkpointing=s["activation_checkpointing"],
                         ffn_hidden_size=s["ffn_hidden_size"],
                         make_vocab_size_divisible_by=s["make_vocab_size_divisible_by"],
                         **embedding_kind(s))["max"]["total"] / GIB
    out.update(mem_gib=mem, fits=mem <= hw.gpu_mem_gib)
    return out


def training_time(train_samples: Optional[int], global_batch_size: int, sec_per_iter: float,
                  num_gpus: int) -> Optional[dict]:
    """Days and GPU-hours to train `train_samples` at `sec_per_iter` per global batch (a ramp-up's smaller
    batches counted at the full batch's time per sample); None without a sample count."""
    if not train_samples:
        return None
    seconds = train_samples / global_batch_size * sec_per_iter
    return {"days": seconds / 86400, "gpu_hours": seconds / 3600 * num_gpus}


# ---------------------------------------------------------------------------------------------
# GPU kinds: the A100 fit, and calibrations (measured seconds per layer, bench/bench_layer.py)
# ---------------------------------------------------------------------------------------------

CALIBRATIONS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibrations")
A100_KIND = "A100 80GB"
A100_SOURCE = "time model fitted to measured Megatron-DeepSpeed runs on A100 80GB nodes (docs/planning.md)"


@dataclass(frozen=True)
class GpuKind:
    """A GPU kind the plan predicts for: its name, where its compute rate comes from, its Hardware, and how the
    calibrated shape differs from the config's (empty for the A100 fit)."""

    name: str
    source: str
    hardware: Hardware
    notes: tuple = ()


def a100_kind(gpus_per_node: int = 8, gpu_mem_gib: float = 80.0) -> GpuKind:
    return GpuKind(A100_KIND, A100_SOURCE, Hardware(gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem_gib))


def shipped_calibrations() -> List[str]:
    """The calibration files gptpar ships (gptpar/estimate/calibrations/*.json), by name."""
    if not os.path.isdir(CALIBRATIONS_DIR):
        return []
    return sorted(f[:-len(".json")] for f in os.listdir(CALIBRATIONS_DIR) if f.endswith(".json"))


def calibrated_kind(path: str, s: dict, base: Hardware = Hardware()) -> GpuKind:
    """The GpuKind of a calibration file (or a shipped one's name, e.g. `h100`) for settings `s`."""
    cal = load_calibration(path)
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
    """The Hardware of the calibration's GPU kind: `base` (the A100 cluster's network and time-model curves)
    with `achieved_tflops` set so that the time model gives, at the calibrated shape, exactly the measured
    seconds per layer of `mode` (the layer's FLOPs at that micro batch / tp, divided by the measured time,
    with the model's micro-batch efficiency and shape penalties at that shape taken back out), and the
    GPU's memory when the file has it. Optional `network` {intra_node_gbps, inter_node_gbps} in the file
    replaces the A100 cluster's bandwidths."""
    mode = recompute_mode(mode)
    if mode not in cal["modes"]:
        raise ValueError(f"calibration {cal.get('path', '')} has no {mode!r} measurement (has "
                         f"{sorted(cal['modes'])}): rerun bench/bench_layer.py --modes none,selective,full")
    sh = cal["shape"]
    flops = model_flops_per_iteration(num_layers=1, hidden_size=sh["hidden_size"], vocab_size=0,
                                      seq_length=sh["seq_length"], global_batch_size=sh["micro_batch_size"],
                                      recompute=mode, ffn_hidden_size=sh["ffn_hidden_size"]) / sh["tp_size"]
    measured = flops / cal["modes"][mode]["sec_per_layer"]
    unit = replace(base, achieved_tflops=1.0)   # the time model's shape factor alone
    factor = compute_rate(unit, sh["hidden_size"], sh["num_attention_heads"], sh["tp_size"],
                          sh["micro_batch_size"]) / 1e12
    network = cal.get("network") or {}
    return replace(base, achieved_tflops=measured / factor / 1e12,
                   gpu_mem_gib=cal.get("gpu_mem_gib") or base.gpu_mem_gib,
                   intra_node_gbps=network.get("intra_node_gbps", base.intra_node_gbps),
                   inter_node_gbps=network.get("inter_node_gbps", base.inter_node_gbps))


def calibration_notes(cal: dict, s: dict) -> List[str]:
    """Where the calibrated shape differs from the settings' (the rate is then carried over by the model)."""
    sh = cal["shape"]
    return [f"{k} {sh[k]} calibrated vs {s[k]} here" for k in _CALIBRATION_SHAPE
            if s.get(k) is not None and sh[k] != s[k]]


def plan_topology(s: dict, nodes: int, hw: Hardware = Hardware(), mbs_choices=(1, 2, 4, 8, 16)) -> List[Candidate]:
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
                    c = _candidate(s, tp, pp, dp, mbs, gbs_req, world // hw.gpus_per_node, hw)
                    if c is not None:
                        out.append(c)
    out.sort(key=lambda c: (c.score, c.tp * c.pp * c.dp))
    return out


def _candidate(s, tp, pp, dp, mbs, gbs_req, nodes, hw) -> Optional[Candidate]:
    gbs = gbs_req - gbs_req % (dp * mbs)          # trimmed to fit dp, as the reference runs trimmed theirs
    if gbs < dp * mbs:
        return None
    mem = memory_per_gpu(num_layers=s["num_layers"], hidden_size=s["hidden_size"],
                         num_attention_heads=s["num_attention_heads"], vocab_size=s["vocab_size"],
                         seq_length=s["seq_length"], micro_batch_size=mbs, global_batch_size=gbs, tp_size=tp,
                         pp_size=pp, dp_size=dp, partition_method=s["partition_method"], precision=s["precision"],
                         embedding_weight=s.get("embedding_weight", 1),
                         zero_stage=s["zero_stage"], optimizer=s["optimizer"],
                         activation_checkpointing=s["activation_checkpointing"], ffn_hidden_size=s["ffn_hidden_size"],
                         make_vocab_size_divisible_by=s["make_vocab_size_divisible_by"],
                         **embedding_kind(s))["max"]["total"] / GIB
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
    t = predict(s, tp, pp, dp, mbs, gbs, hw)
    per_req = t["sec_per_iter"] * gbs_req / gbs
    n_ramp = sum(1 for f in soft if f == "rampup" or f.startswith("gbs"))
    cost = training_time(s.get("train_samples"), gbs_req, per_req, tp * pp * dp) or {}
    return Candidate(tp=tp, pp=pp, dp=dp, mbs=mbs, nodes=nodes, global_batch_size=gbs,
                     micro_batches=gbs // (dp * mbs), mem_gib=round(mem, 1), sec_per_iter=t["sec_per_iter"],
                     sec_per_requested_batch=per_req, compute_s=t["compute_s"], bubble_s=t["bubble_s"],
                     tp_comm_s=t["tp_comm_s"], pp_comm_s=t["pp_comm_s"], dp_comm_s=t["dp_comm_s"],
                     score=per_req * (1 + hw.soft_rank_penalty * n_ramp), soft=soft, days=cost.get("days"),
                     gpu_hours=cost.get("gpu_hours"))


__all__ = ["Hardware", "Candidate", "GpuKind", "compute_rate", "predict", "predict_layout", "training_time",
           "a100_kind", "shipped_calibrations", "calibrated_kind", "load_calibration", "calibrated_hardware",
           "calibration_notes", "plan_topology", "A100_KIND", "A100_SOURCE", "CALIBRATIONS_DIR"]
