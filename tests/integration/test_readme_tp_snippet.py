"""README.md's tensor-parallel snippet, as written (read from README.md): started on 2 ranks the way its first line
says (torchrun), each rank's output equals the same file run as one process at tp = 1 (the comment's claim)."""
import os
import re
import subprocess
import sys

from gptpar.testing import ROOT, free_port
from gptpar.testing.deadline import stretched


def snippet():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    return re.search(r"```python\n(# my_mlp\.py.*?)```", readme, re.S).group(1)


def outputs(text):
    """{rank: the three printed values}."""
    return {int(r): [float(v) for v in vals.split(",")]
            for r, vals in re.findall(r"^rank (\d+): y\[0, :3\] = \[(.*)\]$", text, re.M)}


def test_the_snippet_on_two_ranks_equals_tp1(tmp_path):
    code = snippet()
    first = code.splitlines()[0]
    assert "torchrun --nproc_per_node 2 my_mlp.py" in first and "init_parallel(tp=2)" in code
    (tmp_path / "my_mlp.py").write_text(code)
    (tmp_path / "my_mlp_tp1.py").write_text(code.replace("init_parallel(tp=2)", "init_parallel(tp=1)"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # each rank's stdout to its own file (--redirects): two ranks printing at once can interleave in one pipe
    logs = tmp_path / "logs"
    two = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), "--redirects", "3",
                          "--log-dir", str(logs), "my_mlp.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=stretched(180))
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    two_stdout = "".join(p.read_text() for p in sorted(logs.rglob("stdout.log")))
    one = subprocess.run([sys.executable, "my_mlp_tp1.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=stretched(120))
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    ranks, serial = outputs(two_stdout), outputs(one.stdout)
    assert sorted(ranks) == [0, 1] and sorted(serial) == [0], (two_stdout, one.stdout)
    for values in ranks.values():
        assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(values, serial[0])), (values, serial[0])
