"""The planning CLIs, run as `python tools/X.py` from the repo root, as users do."""
import concurrent.futures
import json
import os
import re
import subprocess
import sys

import pytest
from gptpar.testing import ROOT
from gptpar.testing.deadline import stretched


# Three log lines of the 176B prequel log (fp16 "Best TFLOPs" section), verbatim
PREQUEL_LOG = """\
 iteration        2/   95367 | consumed samples:         4096 | consumed tokens:      8388608 | elapsed time per iteration (s): 844.81 | learning rate: 3.787E-06 | global batch size:  2048 | lm loss: 6.373861E+01 | loss scale: 4096.0 | grad norm: 34132.119 | num zeros: 0.0 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 2.424 | TFLOPs: 98.87 |
some other line that the parser must skip
 iteration        2/   95367 | consumed samples:         4096 | consumed tokens:      8388608 | elapsed time per iteration (s): 853.81 | learning rate: 3.787E-06 | global batch size:  2048 | lm loss: 6.369443E+01 | loss scale: 1.0 | grad norm: 4.461 | num zeros: 0.0 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 2.399 | TFLOPs: 97.82 |
"""


def run(tool, *args, check=True):
    proc = subprocess.run([sys.executable, os.path.join("tools", tool), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=stretched(60), env={**os.environ, "PYTHONPATH": ""})
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def run_json(tool, *args):
    return parse_json(run(tool, *args, "--json"))


def parse_json(proc):
    out = proc.stdout
    assert len(out.strip().splitlines()) == 1
    return json.loads(out)


def side_by_side(*calls):
    """run(*call) for each call, two at a time."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda call: run(*call), calls))


PLANNERS = [("tflops.py", "--config", "configs/200b.json", "--gpus", "80", "--sec-per-iter", "90"),
            ("memory.py", "--config", "configs/200b.json", "--set", "training.precision=fp8"),
            ("model_size.py", "--config", "configs/104b.json"),
            ("plan_topology.py", "--config", "configs/200b.json", "--nodes", "48")]


@pytest.mark.parametrize("call", PLANNERS, ids=[c[0] for c in PLANNERS])
def test_planners_answer_without_importing_torch(call):
    """The planning tools are arithmetic on a config: they run where torch is absent or slow to import (a login
    node; torch's import alone takes seconds), so none of them imports it, fp8's GEMM shapes included."""
    code = (f"import runpy, sys\nsys.argv = {list(call)!r}\n"
            f"try:\n    runpy.run_path('tools/{call[0]}', run_name='__main__')\nexcept SystemExit as e:\n"
            f"    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=stretched(60),
                          env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()


def test_tflops_flags_reproduce_the_20b_log_line():
    out = run_json("tflops.py", "--num-layers", "8", "--hidden-size", "14400", "--vocab-size", "250880",
                   "--seq-length", "2048", "--global-batch-size", "2048", "--tensor-model-parallel-size", "8",
                   "--gpus", "8", "--sec-per-iter", "769.99", "--formula", "legacy")
    assert abs(out["tflops"] - 108.47) <= 0.01


def test_tflops_config_with_override_reproduces_the_final_round():
    out, other, no_rc = map(parse_json, side_by_side(
        ("tflops.py", "--config", "configs/181b_48nodes.json", "--gpus", "384", "--sec-per-iter", "120.85", "--json"),
        # flags override the config: the 176B prequel log's 84-layer, 13312-wide final-round model (ffn back to 4h)
        ("tflops.py", "--config", "configs/181b_48nodes.json", "--num-layers", "84", "--hidden-size", "13312",
         "--gpus", "384", "--sec-per-iter", "122.93", "--json"),
        ("tflops.py", "--config", "configs/181b_48nodes.json", "--gpus", "384", "--sec-per-iter", "120.85",
         "--no-recompute", "--json")))
    assert abs(out["tflops"] - 133.40) <= 0.01 and out["formula"] == "improved" and out["recompute"] == "full"
    assert abs(other["tflops"] - 132.00) <= 0.01
    assert no_rc["tflops"] < out["tflops"] * 0.8 and no_rc["recompute"] == "none"


def test_tflops_from_a_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(PREQUEL_LOG)
    out = run_json("tflops.py", "--config", "configs/200b.json", "--gpus", "80", "--formula", "legacy",
                   "--log", str(log))
    assert [r["iteration"] for r in out["iterations"]] == [2, 2]
    for r in out["iterations"]:
        assert abs(r["tflops"] - r["printed_tflops"]) <= 0.01
    text = run("tflops.py", "--config", "configs/200b.json", "--gpus", "80", "--formula", "legacy",
               "--log", str(log)).stdout
    assert "98.87" in text and "mean TFLOPs" in text


def test_model_size_tool():
    out, cfg, table = side_by_side(("model_size.py", "--num-layers", "64", "--hidden-size", "11600", "--seq-length",
                                    "2048", "--vocab-size", "50257", "--json"),
                                   ("model_size.py", "--config", "configs/200b.json", "--json"),
                                   ("model_size.py", "--config", "configs/104b.json"))
    out, cfg = parse_json(out), parse_json(cfg)
    assert round(out["model_size_formula"] / 1e9) == 104
    assert len(cfg["params_per_stage"]) == 10 and cfg["padded_vocab_size"] == 250880
    assert sum(cfg["params_per_stage"]) == cfg["exact_params"] + 250880 * 14400
    assert "Model size" not in table.stdout  # table, not JSON
    assert "104B" in table.stdout


def test_memory_tool():
    out = run_json("memory.py", "--config", "configs/181b_48nodes.json")
    assert out["dp_size"] == 8 and len(out["stages"]) == 6 and 30 < out["max_gib"] < 80
    pp12 = run_json("memory.py", "--config", "configs/181b_48nodes.json", "--pipeline-model-parallel-size", "12",
                    "--gpus", "384")
    assert pp12["dp_size"] == 4 and pp12["pp_size"] == 12


def test_plan_topology_tool():
    out = run_json("plan_topology.py", "--config", "configs/181b_48nodes.json", "--nodes", "48",
                   "--gpus-per-node", "8", "--gpu-mem", "80")
    top = [(c["tp"], c["pp"], c["dp"], c["mbs"]) for c in out["candidates"][:5]]
    assert (8, 6, 8, 4) in top and (8, 12, 4, 4) in top
    text = run("plan_topology.py", "--config", "configs/200b.json", "--nodes", "48").stdout
    assert "layouts fit" in text and "hidden%128" in text     # 14400 is off the 128 tile: flagged


BAD_INPUT = [
    ("tflops.py", ["--config", "configs/missing.json"], "--config"),
    ("tflops.py", ["--config", "configs/200b.json", "--gpus", "80", "--sec-per-iter", "1", "--formula", "x"],
     "--formula"),
    ("tflops.py", ["--config", "configs/200b.json", "--gpus", "80"], "--sec-per-iter"),
    ("tflops.py", ["--num-layers", "8"], "--hidden-size"),
    ("tflops.py", ["--config", "configs/200b.json", "--gpus", "80", "--log", "no/such.log"], "--log"),
    ("memory.py", ["--config", "configs/200b.json", "--tensor-model-parallel-size", "7", "--gpus", "70"],
     "parallel.tensor_model_parallel_size (7)"),  # the trainer's check, naming the key the flag sets
    ("memory.py", ["--config", "configs/200b.json", "--pipeline-model-parallel-size", "7"], "pipeline_model_parallel"),
    ("model_size.py", ["--config", "configs/200b.json", "--pipeline-model-parallel-size", "100"],
     "pipeline_model_parallel_size (100)"),
    ("plan_topology.py", ["--config", "configs/200b.json", "--nodes", "0"], "--nodes"),
    ("plan_topology.py", ["--config", "configs/200b.json", "--nodes", "1", "--gpu-mem", "8"], "--gpu-mem"),
] + [  # one line each, exit 2
    ("plan_topology.py", ["--config", "configs/200b.json", "--nodes", "4", "--measured", "no/such.json"],
     "error: --measured 'no/such.json': no such file"),
    ("plan_topology.py", ["--config", "configs/200b.json", "--nodes", "4", "--gpu", "v100"],
     "error: --gpu 'v100': unknown GPU kind (known: a100-80gb, h100-80gb, h200)"),
    ("plan_topology.py", ["--config", "configs/200b.json", "--nodes", "4", "--assume", "zero-bubble"],
     "error: --assume 'zero-bubble': unknown assumption"),
    ("tflops.py", ["--log", "no/such.log"], "error: --log 'no/such.log': no such file"),
    ("tflops.py", ["--config", "configs/181b_48nodes.json", "--gpu", "384", "--sec-per-iter", "120.85"],
     "the number of GPUs is --gpus 384"),
]
ONE_LINE = BAD_INPUT[-5:]


@pytest.fixture(scope="module")
def bad_input_runs():
    """Every BAD_INPUT case's process, two side by side."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda case: run(case[0], *case[1], check=False), BAD_INPUT))


@pytest.mark.parametrize("tool,args,needle", BAD_INPUT)
def test_bad_input_is_one_clear_message(bad_input_runs, tool, args, needle):
    proc = bad_input_runs[BAD_INPUT.index((tool, args, needle))]
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert needle in proc.stderr, proc.stderr
    if (tool, args, needle) in ONE_LINE:
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout, proc.stderr


def test_no_layout_fits_is_status_1_in_one_line():
    proc = run("plan_topology.py", "--config", "configs/200b.json", "--nodes", "1", "--gpu", "h100-80gb", check=False)
    assert proc.returncode == 1 and not proc.stdout
    assert proc.stderr.strip() == ("error: no layout fits 1 nodes x 8 h100-80gb GPUs with 79.18 GiB: raise "
                                   "--nodes or --gpu-mem")


def test_tflops_never_abbreviates_an_option():
    """--gpu was an abbreviation of --gpus; no option is abbreviated now (--sec-per is not --sec-per-iter)."""
    proc = run("tflops.py", "--config", "configs/181b_48nodes.json", "--gpus", "384", "--sec-per", "120.85",
               check=False)
    assert proc.returncode == 2 and "unrecognized arguments: --sec-per" in proc.stderr
    out = run_json("tflops.py", "--config", "configs/181b_48nodes.json", "--gpus", "384", "--sec-per-iter", "120.85",
                   "--gpu", "a100-80gb")
    assert out["mfu"] == pytest.approx(out["tflops"] / 312)


def test_allreduce_bench_on_two_gloo_ranks():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "tools/allreduce_bench.py", "--min-bytes", "4K", "--max-bytes",
                           "64K", "--factor", "4", "--iters", "3", "--warmup", "1", "--backend", "gloo", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=stretched(120),
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][0])
    assert out["world_size"] == 2 and out["backend"] == "gloo"
    assert [r["bytes"] for r in out["results"]] == [4096, 16384, 65536]
    for r in out["results"]:
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)


# -- one config reader: the tools print what the trainer's dry run prints ---------------------------------

def _memory_figures(text, stage_row, header, heaviest):
    """(precision, optimizer, ZeRO, dp, micro batch, recompute), the per-stage GiB column and the heaviest stage."""
    head = re.search(header, text)
    stages = [line.split()[-1] for line in text.splitlines() if re.match(stage_row, line)]
    worst = re.search(heaviest, text)
    assert head and stages and worst, text
    return head.groups(), stages, worst.groups()


def _configs_and_one_without_the_state_keys(tmp_path):
    paths = sorted(os.path.join("configs", name) for name in os.listdir(os.path.join(ROOT, "configs")))
    with open(os.path.join(ROOT, "configs", "1.3b.json")) as f:
        bare = json.load(f)
    for key in ("precision", "zero_stage", "activation_checkpointing"):  # left to the defaults
        bare["training"].pop(key)
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    return paths + [str(tmp_path / "bare.json")]


@pytest.mark.slow  # too slow for make test's budget: in make test-slow
def test_memory_tool_prints_what_the_dry_run_prints(tmp_path, capsys):
    from gptpar.training.pretrain import main as pretrain_main

    for config in _configs_and_one_without_the_state_keys(tmp_path):
        tool = _memory_figures(run("memory.py", "--config", config).stdout, r"\s*\d+\s+[\d,]+\s",
                               r"dp=(\d+) micro batch (\d+) (\w+) (\w+) ZeRO-(\d) recompute (\w+)",
                               r"heaviest: stage (\d+), ([\d.]+) GiB")
        # per GPU, with its CUDA context, as the memory tool prints (an fp32 config's plain dry run plans for the CPU)
        assert pretrain_main(["--config", os.path.join(ROOT, config), "--dry-run", "--gpu", "a100-80gb"]) == 0
        dry = _memory_figures(capsys.readouterr().out, r"\s*\d+\s+\[\d+, \d+\)",
                              r"memory per GPU \((\w+), (\w+), ZeRO-(\d) over dp=(\d+), micro batch (\d+), "
                              r"recompute (\w+)\)",
                              r"heaviest stage (\d+):.* = ([\d.]+) GiB")
        (dp, mbs, precision, optimizer, zero, recompute), stages, worst = tool
        assert (precision, optimizer, zero, dp, mbs, recompute) == dry[0], config
        assert (stages, worst) == dry[1:], config


def documented_planner_lines():
    """Every `python tools/plan_topology.py ...` command line of README.md and docs/planning.md (comments cut)."""
    found = []
    for doc in ("README.md", os.path.join("docs", "planning.md")):
        with open(os.path.join(ROOT, doc)) as f:
            for line in f:
                line = line.strip().strip("`").split(" #")[0].strip()
                if line.startswith("python tools/plan_topology.py"):
                    found.append((doc, line))
    return found


def test_every_documented_planner_line_runs_as_written():
    import shlex

    lines = documented_planner_lines()
    assert len(lines) >= 3, lines
    procs = side_by_side(*[(shlex.split(line)[1][len("tools/"):], *shlex.split(line)[2:]) for _, line in lines])
    for (doc, line), proc in zip(lines, procs):
        assert proc.returncode == 0, f"{doc}: {line}\n{proc.stderr}"
        assert "days" in proc.stdout and "GPU-hours" in proc.stdout, line
