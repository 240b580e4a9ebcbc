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
