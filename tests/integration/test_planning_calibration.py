"""The planner's calibration files: a GPU kind's measured seconds per layer become its compute rate."""
import json
import os
import subprocess
import sys

import pytest

from gptpar.estimate.flops import model_flops_per_iteration
from gptpar.estimate.planner import Hardware, calibrated_hardware, compute_rate, load_calibration, predict_layout
from gptpar.estimate.settings import settings_of
from gptpar.config import load_config
from gptpar.testing import ROOT
from gptpar.testing.deadline import stretched

CONFIG_200B = os.path.join(ROOT, "configs", "200b.json")


def _shape_200b(mbs=2):
    return {"hidden_size": 14400, "num_attention_heads": 96, "ffn_hidden_size": 57600, "seq_length": 2048,
            "micro_batch_size": mbs, "tp_size": 8}


def _layer_seconds(shape, mode, hw):
    """What the time model says one layer (fwd + bwd + the mode's recompute) takes per micro batch on one GPU."""
    flops = model_flops_per_iteration(num_layers=1, hidden_size=shape["hidden_size"], vocab_size=0,
                                      seq_length=shape["seq_length"], global_batch_size=shape["micro_batch_size"],
                                      recompute=mode, ffn_hidden_size=shape["ffn_hidden_size"]) / shape["tp_size"]
    return flops / compute_rate(hw, shape["hidden_size"], shape["num_attention_heads"], shape["tp_size"],
                                shape["micro_batch_size"])


def _write(tmp_path, name, shape, seconds, **extra):
    path = tmp_path / name
    path.write_text(json.dumps({"gpu": name, "shape": shape, "modes": {m: {"sec_per_layer": s}
                                                                        for m, s in seconds.items()}, **extra}))
    return str(path)


def test_a_calibration_of_the_a100_fit_reproduces_the_a100_prediction(tmp_path):
    """A file whose seconds per layer are what the A100 fit (the time model) implies gives back that model."""
    a100 = Hardware()
    shape = _shape_200b()
    path = _write(tmp_path, "a100.json", shape, {m: _layer_seconds(shape, m, a100) for m in ("none", "full")})
    s = settings_of(load_config(CONFIG_200B))
    hw = calibrated_hardware(load_calibration(path), s["activation_checkpointing"])
    assert hw.achieved_tflops == pytest.approx(a100.achieved_tflops, rel=1e-12)
    assert predict_layout(s, hw)["sec_per_iter"] == pytest.approx(predict_layout(s, a100)["sec_per_iter"], rel=1e-12)


def test_measured_seconds_per_layer_drive_the_compute(tmp_path):
    """Adding one layer per stage adds (micro batches + pp - 1) x the measured seconds per layer; a kind twice
    as fast halves compute and bubble and leaves the communication alone."""
    shape = _shape_200b()
    sec = {"full": 0.25, "selective": 0.2, "none": 0.19}
    s = settings_of(load_config(CONFIG_200B))
    cal = load_calibration(_write(tmp_path, "x.json", shape, sec, gpu_mem_gib=139.8))
    hw = calibrated_hardware(cal, "full")
    assert hw.gpu_mem_gib == 139.8
    m = s["global_batch_size"] // (s["dp_size"] * s["micro_batch_size"])
    base = predict_layout(s, hw)
    more = predict_layout({**s, "num_layers": s["num_layers"] + s["pp_size"]}, hw)
    assert (more["compute_s"] + more["bubble_s"]) - (base["compute_s"] + base["bubble_s"]) == pytest.approx(
        (m + s["pp_size"] - 1) * sec["full"], rel=1e-9)
    fast = calibrated_hardware(load_calibration(_write(tmp_path, "y.json", shape, {k: v / 2 for k, v in sec.items()})),
                               "full")
    half = predict_layout(s, fast)
    for key in ("compute_s", "bubble_s"):
        assert half[key] == pytest.approx(base[key] / 2, rel=1e-12)
    for key in ("tp_comm_s", "pp_comm_s", "dp_comm_s"):
        assert half[key] == base[key]
    # the mode's own measurement is used
    sel = calibrated_hardware(cal, "selective")
    s_sel = {**s, "activation_checkpointing": "selective"}
    more_sel = predict_layout({**s_sel, "num_layers": s["num_layers"] + s["pp_size"]}, sel)
    base_sel = predict_layout(s_sel, sel)
    assert (more_sel["compute_s"] + more_sel["bubble_s"]) - (base_sel["compute_s"] + base_sel["bubble_s"]) == \
        pytest.approx((m + s["pp_size"] - 1) * sec["selective"], rel=1e-9)


def test_plan_topology_prints_calibrated_kinds_beside_the_a100(tmp_path):
    a100 = Hardware()
    shape = _shape_200b()
    path = _write(tmp_path, "fast.json", shape, {"full": _layer_seconds(shape, "full", a100) / 3})
    out = subprocess.run([sys.executable, "tools/plan_topology.py", "--config", CONFIG_200B, "--nodes", "40",
                          "--calibration", path, "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=stretched(120))
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["layouts"]
    assert [r["kind"] for r in rows] == ["a100-80gb", "fast.json"]
    assert rows[1]["achieved_tflops"] == pytest.approx(3 * rows[0]["achieved_tflops"], rel=1e-9)
    assert rows[1]["compute_s"] == pytest.approx(rows[0]["compute_s"] / 3, rel=1e-9)
    text = subprocess.run([sys.executable, "tools/plan_topology.py", "--config", CONFIG_200B, "--nodes", "40",
                           "--calibration", path, "--measured", os.path.join("tests", "data", "seed_runs.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=stretched(120)).stdout
    assert "a100-80gb" in text and "fast.json" in text and "): 207.92 s/it" in text


def test_bad_calibration_files(tmp_path):
    with pytest.raises(ValueError, match="bench_layer.py"):
        load_calibration(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="sec_per_layer"):
        load_calibration(_write(tmp_path, "z.json", _shape_200b(), {"full": 0}))
    cal = load_calibration(_write(tmp_path, "n.json", _shape_200b(), {"none": 1.0}))
    with pytest.raises(ValueError, match="no 'full' measurement"):
        calibrated_hardware(cal, True)
