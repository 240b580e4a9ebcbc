"""The time model against published, measured large runs (gptpar/estimate/published_runs.json).

Each run is expressed as settings for the time model (its model, layout, precision, recompute, and the features
its source states passed as assumptions), predicted on its GPU kind with no per-row constant, and compared with
the seconds per iteration its published TFLOPs per GPU mean. `error_band(kind)` is what the dry run and the
planner print beside days and GPU-hours; docs/planning.md shows the table (`validation_table`).
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace
from functools import lru_cache
from typing import Dict, List, Optional

from gptpar.estimate.flops import model_flops_per_iteration
from gptpar.estimate.kinds import parse_assumptions
from gptpar.estimate.planner import hardware_of, predict_layout
from gptpar.model.config import pad_vocab_size

RUNS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published_runs.json")


def published_runs(path: str = RUNS_PATH) -> List[dict]:
    with open(path) as f:
        return json.load(f)["runs"]


def run_settings(run: dict) -> dict:
    """The time model's settings for a published run (GPT-2 architecture, f = 4h, learned positions, unless its
    `model` says otherwise; `transformer` partitioning unless its `layout` names another; flash attention unless the
    run says `flash_attention: false`, an unfused attention core whose scores go through HBM)."""
    m, lay = run["model"], run["layout"]
    return {"ffn_hidden_size": 4 * m["hidden_size"], "max_position_embeddings": m["seq_length"],
            "make_vocab_size_divisible_by": 128, "activation": "gelu", "position_embedding_type": "learned",
            "embed_layernorm": False, **m, "tp_size": lay["tp"], "pp_size": lay["pp"], "dp_size": lay["dp"],
            "partition_method": lay.get("partition_method", "transformer"), "embedding_weight": 1,
            "micro_batch_size": lay["micro_batch_size"],
            "global_batch_size": lay["global_batch_size"], "precision": run["precision"], "fp8_recipe": "tensorwise",
            "zero_stage": 1, "optimizer": "adamw", "activation_checkpointing": run["recompute"],
            "sequence_parallel": run.get("sequence_parallel", False), "rampup_batch_size": None, "train_samples": None,
            "flash_attention": run.get("flash_attention", True)}


def published_sec_per_iter(run: dict) -> float:
    """Seconds per iteration the published TFLOPs per GPU mean (the FLOPs counted as the source counted them)."""
    if run.get("published_sec_per_iter"):
        return run["published_sec_per_iter"]
    s, lay = run_settings(run), run["layout"]
    flops = model_flops_per_iteration(num_layers=s["num_layers"], hidden_size=s["hidden_size"],
                                      vocab_size=pad_vocab_size(s["vocab_size"], lay["tp"], 128),
                                      seq_length=s["seq_length"], global_batch_size=lay["global_batch_size"],
                                      recompute=run["flop_formula_recompute"])
    gpus = lay["tp"] * lay["pp"] * lay["dp"]
    return flops / (run["published_tflops_per_gpu"] * 1e12 * gpus)


def predict_run(run: dict) -> dict:
    """predicted vs published seconds per iteration of one run, with the assumptions used and the memory fit."""
    hw = hardware_of(run["gpu"])
    if run.get("inter_node_gbps_per_gpu"):   # the run's own cluster network (a fact of that cluster)
        hw = replace(hw, inter_node_gbps=run["inter_node_gbps_per_gpu"] * hw.gpus_per_node)
    assume = parse_assumptions(run.get("assume", []))
    p = predict_layout(run_settings(run), hw, assume)
    published = published_sec_per_iter(run)
    return {"name": run["name"], "gpu": run["gpu"], "predicted_s": p["sec_per_iter"], "published_s": published,
            "ratio": p["sec_per_iter"] / published, "assumptions": assume.names(), "fits": p["fits"],
            "mem_gib": p["mem_gib"]}


@lru_cache(maxsize=None)
def _table() -> tuple:
    return tuple(predict_run(r) for r in published_runs())


def validation_table() -> List[dict]:
    """predict_run for every published run."""
    return list(_table())


def error_band(kind: Optional[str] = None) -> Dict[str, float]:
    """median and worst |predicted/published - 1| over the published runs of `kind` (all kinds when None or when
    the kind has none), and how many runs that is."""
    rows = [r for r in _table() if r["gpu"] == kind] or list(_table())
    errors = [abs(r["ratio"] - 1) for r in rows]
    return {"median": statistics.median(errors), "worst": max(errors), "runs": len(rows),
            "kind": kind if any(r["gpu"] == kind for r in _table()) else "all"}


def band_phrase(kind: Optional[str] = None) -> str:
    """e.g. `±6% median, ±14% worst over 10 published a100-80gb runs (docs/planning.md)`."""
    b = error_band(kind)
    what = f"{b['kind']} " if b["kind"] != "all" else ""
    return (f"±{100 * b['median']:.0f}% median, ±{100 * b['worst']:.0f}% worst over {b['runs']} published "
            f"{what}runs (docs/planning.md)")


__all__ = ["RUNS_PATH", "published_runs", "run_settings", "published_sec_per_iter", "predict_run",
           "validation_table", "error_band", "band_phrase"]
