"""Smoke tests: the single-rank and scaling benchmarks run end to end at a tiny size (nothing is timed)."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "DS_ACCELERATOR": "cpu"}


def _run(args, tmp_path, timeout):
    out_json = tmp_path / "out.json"
    out = subprocess.run([sys.executable, *args, "--tiny", "--json", str(out_json)], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "summary:" in out.stdout
    return out.stdout, json.loads(out_json.read_text())


def test_bench_single_rank_tiny(tmp_path):
    pytest.importorskip("transformers")
    stdout, res = _run(["bench/bench_single_rank.py"], tmp_path, timeout=180)
    assert "vs HF" in stdout and "MFU" in stdout
    fp32 = [r for r in res["results"] if r["dtype"] == "float32"]
    bf16 = [r for r in res["results"] if r["dtype"] == "bfloat16"]
    assert fp32 and bf16 and all(r["ratio"] > 0 for r in fp32)
    for r in res["results"]:
        assert r["flops_per_step"] > r["flops_per_step_causal"] > 0 and r["gptpar"]["mfu"] > 0


def test_bench_single_rank_without_hf(tmp_path):
    stdout, res = _run(["bench/bench_single_rank.py", "--no-hf", "--bf16-shapes", "", "--breakdown"], tmp_path,
                       timeout=120)
    assert all("hf" not in r for r in res["results"])
    b = res["results"][0]["breakdown"]
    assert b["floor_s"] == b["gemm_s"] + b["attention_s"] > 0 and 0 < b["mfu_ceiling"]


def test_bench_scaling_tiny(tmp_path):
    pytest.importorskip("deepspeed")
    stdout, res = _run(["bench/bench_scaling.py"], tmp_path, timeout=300)
    assert res["tp"]["ratio"] > 0 and res["pp"]["efficiency"] > 0
    # ZeRO-1 halves the optimizer state at dp=2: this is arithmetic, not timing.
    assert 0.45 < res["zero"]["opt_bytes_ratio"] < 0.55


@pytest.mark.slow
def test_gpu_trainer_flow_on_cpu(tmp_path):
    """bench/gpu_trainer.py's whole flow (bf16 train/save/resume, recompute, fp16 loss scaling, the bench) at a
    tiny shape on CPU: every run exits 0 and every check of its summary holds (~3 min on 2 cores)."""
    out = subprocess.run([sys.executable, "bench/gpu_trainer.py", "--out", str(tmp_path), "--cpu-smoke"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert out.returncode == 0 and all(v is True for v in summary["checks"].values()), summary["checks"]
    assert set(summary["exit_codes"]) == set("abcde")
    assert summary["figures"]["d_fp16"]["skipped_iterations"] > 0
    assert not os.path.exists(tmp_path / "checkpoints" / "ck_bf16")  # cleaned up
