"""Smoke tests: the single-rank and scaling benchmarks run end to end at a tiny size (nothing is timed)."""
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile

import pytest

from gptpar.testing import load_script
from gptpar.testing import ROOT as REPO
from gptpar.testing.deadline import stretched

ENV = {**os.environ, "DS_ACCELERATOR": "cpu"}


def _run(args, tmp_path, timeout):
    out_json = tmp_path / "out.json"
    out = subprocess.run([sys.executable, *args, "--tiny", "--json", str(out_json)], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=stretched(timeout))
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


@pytest.mark.slow  # too slow for make test's budget: in make test-slow
def test_bench_single_rank_without_hf(tmp_path):
    stdout, res = _run(["bench/bench_single_rank.py", "--no-hf", "--bf16-shapes", "", "--breakdown"], tmp_path,
                       timeout=120)
    assert all("hf" not in r for r in res["results"])
    b = res["results"][0]["breakdown"]
    assert b["floor_s"] == b["gemm_s"] + b["attention_s"] > 0 and 0 < b["mfu_ceiling"]


@pytest.mark.slow  # too slow for make test's budget: in make test-slow
def test_bench_scaling_tiny(tmp_path):
    pytest.importorskip("deepspeed")
    stdout, res = _run(["bench/bench_scaling.py"], tmp_path, timeout=300)
    assert res["tp"]["ratio"] > 0 and res["pp"]["efficiency"] > 0
    # ZeRO-1 halves the optimizer state at dp=2: this is arithmetic, not timing.
    assert 0.45 < res["zero"]["opt_bytes_ratio"] < 0.55


def _load_bench(name):
    return load_script(os.path.join(REPO, "bench", f"{name}.py"))


def test_peer_loop_tiny(tmp_path):
    """The peer loop trains (finite losses) and reports TFLOPs by gptpar's formula for its own time."""
    from gptpar.estimate.flops import tflops_per_gpu

    out_json = tmp_path / "peer.json"
    out = subprocess.run([sys.executable, "bench/bench_peer_loop.py", "--tiny", "--device", "cpu", "--json",
                          str(out_json)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=stretched(120))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out_json.read_text())
    assert json.loads(out.stdout.strip().splitlines()[-1]) == res
    c = res["config"]
    assert res["micro_batches"] == res["global_batch_size"] // res["micro_batch_size"]
    assert len(res["sec_per_iter"]) == res["iters"] and len(res["losses"]) == res["iters"] + res["warmup_iters"]
    assert all(l == l and 0 < l < 20 for l in res["losses"])
    assert res["tflops"] == pytest.approx(tflops_per_gpu(
        num_layers=c["n_layer"], hidden_size=c["n_embd"], vocab_size=res["padded_vocab_size"],
        seq_length=c["block_size"], global_batch_size=res["global_batch_size"],
        sec_per_iter=res["sec_per_iter_median"], num_gpus=1, recompute=False))
    assert res["tokens_per_s"] == pytest.approx(res["global_batch_size"] * c["block_size"] / res["sec_per_iter_median"])


def _peer_and_gptpar(tmp_path, *flags):
    out_json = tmp_path / "both.json"
    out = subprocess.run([sys.executable, "bench/bench_peer_loop.py", "--tiny", "--device", "cpu", "--gptpar",
                          *flags, "--json", str(out_json)], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=stretched(900))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out_json.read_text())
    assert res["peer"]["loop"].startswith("peer") and res["gptpar"]["loop"] == "gptpar GPTModel"
    for loop in ("peer", "gptpar"):
        assert all(l == l and 0 < l < 20 for l in res[loop]["losses"])
        assert res[loop]["compiled"] == ("--compile" in flags)
    assert res["ratio_gptpar_vs_peer_tokens_per_s"] == pytest.approx(
        res["gptpar"]["tokens_per_s"] / res["peer"]["tokens_per_s"])
    assert "gptpar / peer tokens/s" in out.stdout
    return res


def test_peer_loop_against_gptpar_tiny(tmp_path):
    """--gptpar times gptpar's model in the same process and loop: same shape and batch, both train."""
    res = _peer_and_gptpar(tmp_path)
    assert res["peer"]["global_batch_size"] == res["gptpar"]["global_batch_size"]


@pytest.mark.slow
def test_peer_loop_against_gptpar_compiled_tiny(tmp_path):
    """The same with --compile: the peer through torch.compile, gptpar's layers through training.compile's path."""
    _peer_and_gptpar(tmp_path, "--compile")


def test_bench_loss_memory_tiny(tmp_path):
    """The loss-memory bench counts each path: gptpar's loss (fused, and the pipeline's) creates less than the
    textbook F.cross_entropy on an fp32 copy of the logits, in bf16 and fp32."""
    out_json = tmp_path / "loss.json"
    out = subprocess.run([sys.executable, "bench/bench_loss_memory.py", "--tiny", "--json", str(out_json)], cwd=REPO,
                         env=ENV, capture_output=True, text=True, timeout=stretched(300))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["dtype"], r["path"]): r for r in json.loads(out_json.read_text())}
    assert set(rows) == {(d, p) for d in ("bf16", "fp32") for p in ("model", "pipeline", "textbook")}
    for dtype in ("bf16", "fp32"):
        for path in ("model", "pipeline"):
            assert 0 < rows[dtype, path]["peak_bytes"] < rows[dtype, "textbook"]["peak_bytes"]
    assert "at the 1.3B shape" in out.stdout


def test_peer_model_computes_gptpar_model():
    """The peer is the same function as gptpar's GPT (tanh GELU), so one FLOP count fits both loops: with the
    peer's weights moved into GPTModel (through the Hugging Face layout: nanoGPT's names, Conv1D transposed)
    the logits over the real vocabulary agree."""
    import torch

    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import GPTModel
    from gptpar.model.hf import from_hf_state_dict
    from gptpar.model.sharding import load_full_state_dict

    peer = _load_bench("bench_peer_loop")
    cfg = peer.PeerConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=100)
    torch.manual_seed(0)
    model = peer.GPT(cfg).eval()
    with torch.no_grad():  # zero biases and unit LayerNorms would hide a swapped tensor
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf = {}
    for name, t in model.state_dict().items():
        transposed = name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        hf[name] = t.t() if transposed else t
    gcfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                     make_vocab_size_divisible_by=64, activation=peer.ACTIVATION)
    assert gcfg.padded_vocab_size(1) == cfg.padded_vocab
    ours = GPTModel(gcfg).eval()
    load_full_state_dict(ours, from_hf_state_dict(hf, gcfg), None)
    x = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[..., :100], model(x)[..., :100], rtol=1e-5, atol=1e-5)


def test_peer_takes_only_a_config_of_its_own_activation(tmp_path):
    """The speed comparison trains one model in both loops: configs/1.3b.json asks for the peer's activation
    (the one test_peer_model_computes_gptpar_model proves the peer computes), and a config asking for another
    is refused, naming the field, rather than timing erf GELU against tanh GELU."""
    peer = _load_bench("bench_peer_loop")
    cfg, mbs, section = peer.config_from_file(os.path.join(REPO, "configs", "1.3b.json"))
    assert section["activation"] == peer.ACTIVATION and (cfg.n_layer, cfg.n_embd, mbs) == (24, 2048, 4)
    erf = json.loads(open(os.path.join(REPO, "configs", "1.3b.json")).read())
    del erf["model"]["activation"]  # gptpar's default: erf GELU
    path = tmp_path / "erf.json"
    path.write_text(json.dumps(erf))
    with pytest.raises(SystemExit, match="model.activation is 'gelu'.*set model.activation to 'gelu_tanh'"):
        peer.config_from_file(str(path))


def test_bench_layer_tiny_calibrates_the_planner(tmp_path):
    """bench_layer at a tiny shape on the CPU writes a calibration file; its TFLOPs are gptpar's count over its
    own times, and the planner turns it into a rate that reproduces the measured seconds per layer."""
    from gptpar.estimate.flops import model_flops_per_iteration
    from gptpar.estimate.planner import calibrated_hardware, load_calibration, predict

    cal_path = tmp_path / "cal.json"
    out = subprocess.run([sys.executable, "bench/bench_layer.py", "--tiny", "--device", "cpu", "--json", str(cal_path)],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=stretched(120))
    assert out.returncode == 0, out.stderr[-3000:]
    cal = load_calibration(str(cal_path))
    sh = cal["shape"]
    assert (sh["heads_per_rank"], sh["ffn_per_rank"]) == (sh["num_attention_heads"] // sh["tp_size"],
                                                          sh["ffn_hidden_size"] // sh["tp_size"])
    assert set(cal["modes"]) == {"none", "selective", "full"} and "excluded" in cal["tp_communication"]
    for mode, r in cal["modes"].items():
        flops = model_flops_per_iteration(num_layers=1, hidden_size=sh["hidden_size"], vocab_size=0,
                                          seq_length=sh["seq_length"], global_batch_size=sh["micro_batch_size"],
                                          recompute=mode, ffn_hidden_size=sh["ffn_hidden_size"]) / sh["tp_size"]
        assert r["flops_per_layer_per_gpu"] == pytest.approx(flops)
        assert r["tflops"] == pytest.approx(flops / r["sec_per_layer"] / 1e12)
        assert len(r["sec_per_layer_all"]) == cal["iters"]
    # A model of this shape: one more layer per stage costs (m + pp - 1) x the measured seconds per layer.
    s = {"num_layers": 4, "hidden_size": sh["hidden_size"], "num_attention_heads": sh["num_attention_heads"],
         "ffn_hidden_size": sh["ffn_hidden_size"], "seq_length": sh["seq_length"], "vocab_size": 128,
         "make_vocab_size_divisible_by": 128, "partition_method": "transformer",
         "activation_checkpointing": "selective"}
    hw = calibrated_hardware(cal, "selective")
    tp, pp, dp, mbs, gbs = sh["tp_size"], 2, 1, sh["micro_batch_size"], 8 * sh["micro_batch_size"]
    t4, t6 = predict(s, tp, pp, dp, mbs, gbs, hw), predict({**s, "num_layers": 6}, tp, pp, dp, mbs, gbs, hw)
    grown = (t6["compute_s"] + t6["bubble_s"]) - (t4["compute_s"] + t4["bubble_s"])
    assert grown == pytest.approx((8 + pp - 1) * cal["modes"]["selective"]["sec_per_layer"], rel=1e-9)


def test_bench_layer_fp8_tiny(tmp_path):
    """bench_layer's fp8 mode (the GPU script runs it at 200B tp 8) at the tiny shape on the CPU, emulated: the
    layer's four GEMMs run in float8 (the plan gptpar.tensor_parallel.float8 gives at that shape), bf16 around."""
    pytest.importorskip("torchao")
    from gptpar.tensor_parallel.float8 import GEMM_NAMES, layer_float8_gemms

    cal_path = tmp_path / "cal_fp8.json"
    out = subprocess.run([sys.executable, "bench/bench_layer.py", "--tiny", "--device", "cpu", "--dtype", "fp8",
                          "--modes", "none,full", "--json", str(cal_path)],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=stretched(180))
    assert out.returncode == 0, out.stderr[-3000:]
    cal = json.loads(cal_path.read_text())
    sh = cal["shape"]
    assert cal["dtype"] == "bfloat16" and "emulated: no CUDA device" in cal["float8"]
    plan = layer_float8_gemms(sh["hidden_size"], sh["ffn_hidden_size"], sh["tp_size"])
    assert cal["float8_gemms"] == [g.describe(name) for g, name in zip(plan, GEMM_NAMES)]
    assert all(g.mode == "fp8" for g in plan) and set(cal["modes"]) == {"none", "full"}
    assert "float8 GEMMs" in out.stdout


@pytest.mark.slow
def test_bench_fp8_padding_tiny(tmp_path):
    """bench_fp8_padding counts a padded GEMM's FLOPs as the padded shape's (what plan_float8_gemm says padding
    adds) and finds the pad copies among the bytes it writes."""
    pytest.importorskip("torchao")
    out_json = tmp_path / "padding.json"
    out = subprocess.run([sys.executable, "bench/bench_fp8_padding.py", "--tiny", "--json", str(out_json)], cwd=REPO,
                         env=ENV, capture_output=True, text=True, timeout=stretched(180))
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["extra_flops"] == pytest.approx(48 * 32 / (40 * 24) - 1) == pytest.approx(row["planned_extra_flops"])
    assert row["extra_bytes"] > 0 and row["padded_ops_bytes"]["constant_pad_nd"] > 0


def _gpu_script_on_cpu(mode, tmp_path, timeout, env=None):
    """`bash bench/gpu.sh MODE` with GPU_CPU_SMOKE=1: every step at a tiny shape on the CPU, so the one GPU call
    runs a script whose flow, flags and summary have run end to end. Returns (stdout, out folder, raw folder)."""
    out = tmp_path / "out"
    run = subprocess.run(["bash", "bench/gpu.sh", mode], cwd=REPO, capture_output=True, text=True,
                         timeout=stretched(timeout),
                         env={**ENV, "GPU_CPU_SMOKE": "1", "OUT": str(out), "PYTHON": sys.executable, **(env or {})})
    assert run.returncode == 0, run.stderr[-3000:]
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and "raw.tgz" in files and "machine.txt" in files, files  # what a device call returns
    raw = tmp_path / "raw"
    with tarfile.open(out / "raw.tgz") as tar:
        tar.extractall(raw)
    assert not (raw / "failed.txt").exists(), (raw / "failed.txt").read_text() + run.stdout[-3000:]
    assert not (raw / "skipped.txt").exists(), (raw / "skipped.txt").read_text()
    return run.stdout, out, raw


# A run taking turns in bench/rounds.py's rounds without a model: each turn "times" `timed` iterations of lengths
# of its own (its speed, times a factor that differs by round and run; slept) and records them, as
# bench_peer_loop.py --rounds does.
STAND_IN = """
import sys, time
from gptpar.testing import load_script
Turns = load_script("bench/rounds.py").Turns
turns, speed = Turns.from_env(), float(sys.argv[1])
for r in range(1, turns.rounds + 1):
    turns.wait(r)
    secs = [speed * (1 + r * int(speed * 1000) % 7 / 20) * (1 + k / 10) for k in range(turns.timed)]
    time.sleep(sum(secs))
    turns.done(r, {"sec_per_iter": secs, "tokens_per_iteration": 1000})
"""


# bench/rounds.py's turns over three runs, three rounds: (round, run), the order rotated by one place per round
ROTATED = [(1, "peer"), (1, "bf16"), (1, "fp8"), (2, "bf16"), (2, "fp8"), (2, "peer"), (3, "fp8"), (3, "peer"),
           (3, "bf16")]


def _rounds_of_stand_ins(tmp_path, speeds):
    """bench/rounds.py over stand-in runs {name: speed}: (exit code, output folder)."""
    runs = [arg for name, speed in speeds.items()
            for arg in ("--run", f"{name}={sys.executable} -c {shlex.quote(STAND_IN)} {speed}")]
    out = subprocess.run([sys.executable, "bench/rounds.py", "--out", str(tmp_path), "--rounds", "3", "--timed", "3",
                          "--timeout", "120"] + runs, cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=stretched(180))
    return out, tmp_path / "rounds"


def _done(rounds_dir, name, r):
    return json.loads((rounds_dir / f"done.{name}.{r}").read_text())


def test_rounds_give_the_runs_turns_and_the_summary_reads_them(tmp_path):
    """bench/rounds.py starts every run, then gives one run at a time the device: each round gives each run one turn,
    in an order rotated by one place per round, and no two runs are active at once (by their own clocks). The
    summary's per-round ratios, their median and worst come from the runs' own per-turn numbers."""
    rounds_figures = _load_bench("gpu_summary").rounds_figures

    speeds = {"peer": 0.011, "bf16": 0.01, "fp8": 0.008}
    out, rounds_dir = _rounds_of_stand_ins(tmp_path, speeds)
    assert out.returncode == 0, out.stdout + out.stderr
    turns = [json.loads(line) for line in (rounds_dir / "turns.jsonl").read_text().splitlines()]
    assert [(t["round"], t["name"]) for t in turns] == ROTATED
    active = sorted(_done(rounds_dir, t["name"], t["round"])["active"] for t in turns)
    assert all(a[1] <= b[0] for a, b in zip(active, active[1:]))  # one run at a time
    fig = rounds_figures(str(tmp_path))
    for key, (a, b) in {"bf16_vs_peer": ("bf16", "peer"), "fp8_vs_bf16": ("fp8", "bf16")}.items():
        per_round = [statistics.median(_done(rounds_dir, b, r)["sec_per_iter"]) /
                     statistics.median(_done(rounds_dir, a, r)["sec_per_iter"]) for r in (1, 2, 3)]
        ratio = fig["ratios"][key]
        assert list(ratio["per_round"].values()) == pytest.approx(per_round, rel=1e-12)
        assert ratio["median"] == pytest.approx(statistics.median(per_round), rel=1e-12)
        assert ratio["worst"] == pytest.approx(min(per_round), rel=1e-12)
        assert len(set(per_round)) == 3  # the rounds differ: the median and the worst are different numbers


@pytest.mark.slow
def test_rounds_go_on_without_a_run_that_fails(tmp_path):
    """A run that dies before its turns fails the call (exit 1, named) and the others still take theirs."""
    out, rounds_dir = _rounds_of_stand_ins(tmp_path, {"peer": 0.005, "bf16": "not-a-number"})
    assert out.returncode == 1 and "bf16: not ready" in out.stdout, out.stdout + out.stderr
    turns = [json.loads(line) for line in (rounds_dir / "turns.jsonl").read_text().splitlines()]
    assert [t["name"] for t in turns] == ["peer"] * 3


@pytest.mark.slow
def test_gpu_speed_script_flow_on_cpu(tmp_path):
    """`bench/gpu.sh speed` at tiny shapes on the CPU (minutes, most of it compiling): the peer, the trainer
    in bf16 and in fp8 take turns in three rounds (the order rotated, one run active at a time by the runs' own
    clocks), then the layer in bf16 and fp8 and the two profiles (named in STEPS), then the summary. Its per-round
    ratios, their
    median and worst round are recomputed here from the raw numbers (the peer's own timings, the trainers' metrics
    records at the iterations each turn names); every run reports its memory peaks over the run; the tree that
    ran is the one here (its commit, changed or not)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("torchao")
    steps = "rounds layer_bf16 layer_fp8 peer_profile trainer_profile summary"
    _, out, raw = _gpu_script_on_cpu("speed", tmp_path, timeout=2400, env={
        "STEPS": steps, "BUDGET_S": "2200", "ROUNDS_TIMEOUT": "1500"})
    summary = json.loads((out / "summary.json").read_text())
    rounds = raw / "rounds"
    turns = [json.loads(line) for line in (rounds / "turns.jsonl").read_text().splitlines()]
    assert [(t["round"], t["name"]) for t in turns] == ROTATED
    done = {(t["name"], t["round"]): json.loads((rounds / f"done.{t['name']}.{t['round']}").read_text()) for t in turns}
    active = sorted(d["active"] for d in done.values())
    assert all(a[1] <= b[0] for a, b in zip(active, active[1:]))  # one run at a time
    metrics = {name: {r["iteration"]: r for r in map(json.loads, (rounds / f"{name}.jsonl").read_text().splitlines())
                      if "lm_loss" in r} for name in ("bf16", "fp8")}

    def seconds(name, r):
        """A turn's median seconds per timed iteration: the peer's own, the trainer's log-line times."""
        if name == "peer":
            return statistics.median(done[name, r]["sec_per_iter"])
        timed = done[name, r]["timed_iterations"]
        assert timed == [2 + (r - 1) * 3 + 2, 2 + r * 3]  # 2 before the rounds, then 1 untimed + 2 timed per turn
        return statistics.median(metrics[name][i]["elapsed_s"] for i in timed)

    for key, (a, b) in {"bf16_vs_peer": ("bf16", "peer"), "fp8_vs_bf16": ("fp8", "bf16")}.items():
        per_round = [seconds(b, r) / seconds(a, r) for r in (1, 2, 3)]  # the same 4 x 32 tokens per iteration
        ratio = summary["rounds"]["ratios"][key]
        assert ratio["same_tokens_per_iteration"]
        assert [ratio["per_round"][str(r)] for r in (1, 2, 3)] == pytest.approx(per_round, rel=1e-12)
        assert ratio["median"] == pytest.approx(statistics.median(per_round), rel=1e-12)
        assert ratio["worst"] == pytest.approx(min(per_round), rel=1e-12)
    for name, run in summary["rounds"]["runs"].items():
        assert run["memory_bytes"]["max resident"] > 2 ** 20, name  # CPU: the peak resident set over the run
    assert summary["checks"]["losses_fp8_vs_bf16"]["within"] and summary["checks"]["bf16_loss_falls"]
    assert "float8" in (rounds / "fp8.log").read_text() and "float8" not in (rounds / "bf16.log").read_text()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    assert summary["tree"]["commit"] == head and bool(summary["tree"]["changed"]) == bool(changed.strip())
    assert f"= commit {head[:12]}" in (out / "machine.txt").read_text()
    assert 0 < summary["call_seconds_to_summary"] < 2400
    assert "logging.profile: iterations 4-5 on rank 0:" in (raw / "trainer_profile.log").read_text()
    assert "peer (nanoGPT-style) profile: iterations 1-2" in (raw / "peer_profile.log").read_text()
    assert json.loads((raw / "layer_fp8.json").read_text())["float8"] and summary["layer_fp8"]["gemms"]


@pytest.mark.slow
def test_gpu_calibrate_script_flow_on_cpu(tmp_path):
    """`bench/gpu.sh calibrate`: the layer's calibration file, the single rank per recompute mode and the planner
    reading the calibration."""
    stdout, _, raw = _gpu_script_on_cpu("calibrate", tmp_path, timeout=900)
    assert set(json.loads((raw / "layer_200b_tp8_mbs2.json").read_text())["modes"]) == {"none", "selective", "full"}
    assert all((raw / f"single_rank_1.3b_{mode}.json").exists() for mode in ("none", "selective", "full"))
    assert "a100-80gb" in (raw / "plan_200b_calibrated.log").read_text()


@pytest.mark.slow
def test_gpu_trainer_flow_on_cpu(tmp_path):
    """bench/gpu_trainer.py's whole flow (bf16 train/save/resume, recompute, fp16 loss scaling, the bench) at a
    tiny shape on CPU: every run exits 0 and every check of its summary holds (minutes: slow)."""
    out = subprocess.run([sys.executable, "bench/gpu_trainer.py", "--out", str(tmp_path), "--cpu-smoke"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=stretched(900))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert out.returncode == 0 and all(v is True for v in summary["checks"].values()), summary["checks"]
    assert set(summary["exit_codes"]) == set("abcde")
    assert summary["figures"]["d_fp16"]["skipped_iterations"] > 0
    assert not os.path.exists(tmp_path / "checkpoints" / "ck_bf16")  # cleaned up


@pytest.mark.slow
def test_bench_optimizer8bit_smoke(tmp_path):
    """bench/bench_optimizer8bit.py end to end for 2 iterations per optimizer (the demo's data is built on first
    use): both state figures, their ratio and the loss ratio come from the runs it made."""
    pytest.importorskip("bitsandbytes")
    out = subprocess.run([sys.executable, "bench/bench_optimizer8bit.py", "--out", str(tmp_path), "--train-iters", "2"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=stretched(900))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    state = summary["state"]
    assert state["adamw"]["optimizer_state_bytes_per_param"] == pytest.approx(8, rel=1e-3)
    assert state["adamw8bit"]["optimizer_state_bytes_per_param"] == pytest.approx(2.03, rel=0.01)
    for name in ("adamw", "adamw8bit"):
        records = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        assert summary["loss"][name]["final_lm_loss"] == [r for r in records if "train_iters" in r][-1]["lm_loss"]
    assert summary["final_lm_loss_ratio"] == pytest.approx(summary["loss"]["adamw8bit"]["final_lm_loss"]
                                                           / summary["loss"]["adamw"]["final_lm_loss"])
    assert "optimizer=bitsandbytes AdamW8bit" in (tmp_path / "adamw8bit" / "train.log").read_text()


def test_trace_kernels_reads_a_profiler_trace(tmp_path):
    """bench/trace_kernels.py on a hand-made Chrome trace whose figures are known: kernel time by category per
    iteration, each other kernel's launching host op (by the runtime call's correlation id), the host's waits and
    the device's idle gaps (the union over streams: an overlapping side-stream kernel closes no gap)."""
    trace_kernels = _load_bench("trace_kernels")

    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}

    def launch(corr, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": 1,
                "args": {"correlation": corr}}

    def kernel(name, corr, ts, dur, stream=7):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr,
                                                                                        "stream": stream}}
    events = [
        op("step", 0, 1000), op("aten::mul_", 10, 5), op("aten::add_", 20, 5), op("aten::mm", 30, 5),
        launch(1, 11), launch(2, 21), launch(3, 31), launch(4, 12),
        kernel("nvjet_sm90_gemm", 3, 100, 300),                    # GEMM: 100-400
        kernel("elementwise_mul", 1, 400, 50),                     # 400-450
        kernel("elementwise_add", 2, 500, 40),                     # gap 50 us, 500-540
        kernel("elementwise_mul", 4, 520, 100, stream=9),          # side stream, overlaps: union 500-620
        kernel("cudnn_sdpa_fprop", 5, 650, 30),                    # gap 30 us (no launch on record: "?")
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 40, "dur": 600, "tid": 1},
    ]
    r = trace_kernels.summarize(events, iterations=2, min_gap_us=20)
    assert r["ms"] == {"GEMM": 0.15, "other": 0.095, "attention": 0.015}
    mul, add = r["other"]
    assert (mul["kernel"], mul["launches"], mul["us_each"]) == ("elementwise_mul", 1, 75)
    assert mul["launched_in"] == "step > aten::mul_" and add["launched_in"] == "step > aten::add_"
    assert [(w["call"], w["ms"], w["in"]) for w in r["waits"]] == [("cudaStreamSynchronize", 0.6, "step")]
    assert [(g["ms"], g["after"], g["before"]) for g in r["gaps"]] == [
        (0.05, "elementwise_mul", "elementwise_add"), (0.03, "elementwise_mul", "cudnn_sdpa_fprop")]
    assert r["idle_ms"] == pytest.approx(0.04) and r["span_ms"] == pytest.approx(0.58)
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run([sys.executable, "bench/trace_kernels.py", str(trace), "--iterations", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=stretched(60))
    assert out.returncode == 0, out.stderr
    assert "0.04 ms per iteration in gaps of >= 20 us" in out.stdout


@pytest.mark.slow
def test_bench_straggler_smoke():
    """bench/bench_straggler.py end to end for 3 iterations: every part timed on both ranks, the shares printed."""
    out = subprocess.run([sys.executable, "bench/bench_straggler.py", "--iters", "3"], cwd=REPO, capture_output=True,
                         text=True, timeout=stretched(300))
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        line = next(line for line in out.stdout.splitlines() if line.startswith(f"rank {rank}: iteration "))
        assert "collective log" in line and "report" in line and "rank clock" in line, line
    assert "straggler report (rank clock + report): " in out.stdout and "% of an iteration's CPU time" in out.stdout


@pytest.mark.slow
def test_bench_universal_conversion_smoke():
    """bench/bench_universal_conversion.py on a tiny model, one round at 1 and 2 ranks: both copies the same files."""
    out = subprocess.run([sys.executable, "bench/bench_universal_conversion.py", "--layers", "2", "--hidden", "64",
                          "--rounds", "1", "--ranks", "1", "2"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for ranks in (1, 2):
        assert f"round 1, {ranks} rank(s): " in out.stdout and f"{ranks} rank(s): median " in out.stdout, out.stdout
    assert "the same files as the first 1-rank copy: False" not in out.stdout
