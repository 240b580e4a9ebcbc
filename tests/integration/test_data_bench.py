"""Smoke test: the preprocessing benchmark runs end to end in its --tiny form."""
import subprocess
import sys
from gptpar.testing import ROOT as REPO
from gptpar.testing.deadline import stretched



def test_bench_preprocess_tiny(tmp_path):
    out = subprocess.run([sys.executable, "bench/bench_preprocess.py", "--tiny", "--workdir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=stretched(120))
    assert out.returncode == 0, out.stderr
    assert "outputs identical: True" in out.stdout and "tokens/s" in out.stdout


def test_bench_data_index_small(tmp_path):
    # gptpar against its first implementation (Megatron-Core lives in another environment: skipped, with the reason).
    out = subprocess.run([sys.executable, "bench/bench_data_index.py", "--docs", "400", "--sample-tokens", "2e5",
                          "--seq-length", "128", "--blend-samples", "5000", "--datasets", "3", "--libraries",
                          "gptpar,gptpar-first,megatron", "--workdir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Megatron-Core skipped: no --megatron-python given" in out.stdout
    for case in ("single", "blend"):
        assert f"{case}: gptpar's indices identical to the first implementation's: True" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["single"], ["blend"], ["greedy"])
            and len(line.split()) == 8]
    assert len(rows) == 6 and {r[1] for r in rows} == {"gptpar", "gptpar-first"}
