"""The topology planner and the dry-run report (the plan first: GPUs, memory, time, days), against formulas written
out here and the measured 48-node A100 runs of the reference planning notes."""
import json
import os

import pytest

from gptpar.estimate.flops import exact_model_params, params_per_stage, tflops_per_gpu
from gptpar.estimate.memory import GIB
from gptpar.estimate.planner import Hardware, plan_topology, predict
from gptpar.estimate.report import render_dry_run
from gptpar.estimate.settings import memory_of, settings_of
from gptpar.config import load_config
from gptpar.testing import ROOT



def config(name):
    return load_config(os.path.join(ROOT, "configs", f"{name}.json"))


def reference_runs():
    """The runs measured in the 176B prequel log and the 104B tune-up notes (test data)."""
    with open(os.path.join(ROOT, "tests", "data", "seed_runs.json")) as f:
        return [tuple(row) for row in json.load(f)["runs"]]


def report(cfg, **kw):
    """The dry-run report on the world the config names (as pretrain_gpt.py --dry-run plans it), with the reference
    runs."""
    return render_dry_run(cfg, cfg.parallel.data_parallel_size or 1, measured=reference_runs(), **kw)


@pytest.fixture(scope="module")
def plan_181b():
    s = settings_of(config("181b_48nodes"))
    return s, plan_topology(s, 48, Hardware(gpus_per_node=8, gpu_mem_gib=80))


def test_the_reference_winners_are_among_the_top_candidates(plan_181b):
    _, cands = plan_181b
    top = [(c.tp, c.pp, c.dp, c.mbs) for c in cands[:5]]
    # the 176B prequel log's "48 node contenders" / "Final round": DP=8 PP=6 MBS=4 and DP=4 PP=12 MBS=4 (TP=8);
    # "GBS variations" (TP tweak): the fastest of all, TP=4 PP=12 DP=8 MBS=2 (110.48 s)
    for winner in [(8, 6, 8, 4), (8, 12, 4, 4), (4, 12, 8, 2)]:
        assert winner in top, (winner, top)


def test_hard_constraints(plan_181b):
    s, cands = plan_181b
    assert cands, "the 181B model fits 48 nodes"
    for c in cands:
        assert c.tp <= 8 and s["num_attention_heads"] % c.tp == 0 and s["hidden_size"] % c.tp == 0
        assert s["num_layers"] % c.pp == 0 or (s["num_layers"] + 2) % c.pp == 0
        assert c.tp * c.pp * c.dp == 8 * c.nodes and c.nodes <= 48
        assert c.mem_gib <= 80
        assert c.global_batch_size % (c.dp * c.mbs) == 0 and c.global_batch_size <= 2048
    layouts = {(c.tp, c.pp, c.dp, c.mbs) for c in cands}
    # the prequel log: OOM for TP=8 PP=1 DP=48 and TP=2 PP=6 DP=32; "fail" for TP=1 PP=48 (72 % 48 != 0)
    for oom in [(8, 1, 48, 1), (2, 6, 32, 1), (2, 6, 32, 2), (1, 48, 8, 1)]:
        assert oom not in layouts
    assert cands == sorted(cands, key=lambda c: (c.score, c.tp * c.pp * c.dp))


def test_soft_constraints_are_flagged_not_filtered(plan_181b):
    _, cands = plan_181b
    by = {(c.tp, c.pp, c.dp, c.mbs): c for c in cands}
    # dp 6 and 12 break the ramp-up by 32 (seed: "DP % 4 = 0 and GBS % 32 = 0") and trim the batch to 2046/2040
    c = by[(8, 8, 6, 4)]
    assert "rampup" in c.soft and c.global_batch_size == 2040 and any(f.startswith("gbs") for f in c.soft)
    assert c.score > c.sec_per_requested_batch
    assert by[(8, 6, 8, 4)].soft == []
    # heads 64 / tp 8 = 8 per rank: fine for every micro batch; hidden 14336 % 128 == 0
    assert all("no fused softmax" not in c.soft and "hidden%128" not in c.soft for c in cands)


def test_time_model_parts():
    s = dict(settings_of(config("181b_48nodes")), flash_attention=False)   # the prequel's run: unfused attention
    hw = Hardware()
    t = predict(s, 8, 12, 4, 4, 2048, hw)
    m = 2048 // (4 * 4)
    # bubble = (pp - 1)/m of the compute; the whole = (m + pp - 1) slots + the dp exchange + the optimizer step
    assert t["bubble_s"] == pytest.approx(t["compute_s"] * 11 / m)
    assert t["sec_per_iter"] == pytest.approx(t["compute_s"] + t["bubble_s"] + t["tp_comm_s"] + t["pp_comm_s"]
                                              + t["dp_comm_s"] + t["loss_s"] + t["optimizer_s"])
    # compute = model FLOPs / (GPUs x rate at mbs 4) + the unfused attention's score traffic: per micro batch and
    # layer, 4 x 64/8 heads x 2048^2 fp16 scores moved (13 bytes forward, twice under full recompute, + 19 backward)
    # through HBM; the implied TFLOPs of the rest is that rate
    scores = m * 72 / 12 * 4 * 8 * 2048 ** 2 * (2 * 13 + 19) / (hw.hbm_tb_s * 1e12)
    implied = tflops_per_gpu(num_layers=72, hidden_size=14336, vocab_size=250880, seq_length=2048,
                             global_batch_size=2048, sec_per_iter=t["compute_s"] - scores, num_gpus=384)
    assert implied == pytest.approx(hw.achieved_tflops * 4 / (4 + hw.mbs_half_point))
    # flash attention (gptpar's SDPA, the default) keeps the scores on chip: no such term
    flash = predict(dict(s, flash_attention=True), 8, 12, 4, 4, 2048, hw)
    assert flash["compute_s"] == pytest.approx(t["compute_s"] - scores)
    assert predict({k: v for k, v in s.items() if k != "flash_attention"}, 8, 12, 4, 4, 2048, hw) == flash
    # no tp, no pp, no dp: pure compute
    t1 = predict(s, 1, 1, 1, 1, 8, hw)
    assert t1["tp_comm_s"] == t1["pp_comm_s"] == t1["dp_comm_s"] == t1["bubble_s"] == 0
    # a hidden size off the 128 tile, or heads without the fused softmax, are slower
    s_bad = dict(s, hidden_size=14400, ffn_hidden_size=57600, num_attention_heads=96)
    assert predict(s_bad, 8, 12, 4, 4, 2048, hw)["compute_s"] > t["compute_s"]
    s_sm = dict(s, num_attention_heads=56, hidden_size=14336)
    assert predict(s_sm, 8, 12, 4, 1, 2048, hw)["compute_s"] > predict(s, 8, 12, 4, 1, 2048, hw)["compute_s"]


def test_ranking_agrees_with_the_prequel_48_node_sweep():
    """The 176B prequel log's 181B sweep on 48 nodes, TP=8: the 7 measured layouts; the planner must order them
    mostly right."""
    s = settings_of(config("181b_48nodes"))
    rows = [(12, 4, 1, 143.31), (12, 4, 2, 134.02), (12, 4, 4, 123.69), (12, 4, 8, 129.26), (6, 8, 1, 139.82),
            (6, 8, 2, 131.02), (6, 8, 4, 121.48)]
    pred = [predict(s, 8, pp, dp, mbs, 2048, Hardware())["sec_per_iter"] for pp, dp, mbs, _ in rows]
    meas = [r[3] for r in rows]
    rank = lambda xs: [sorted(xs).index(x) for x in xs]
    n = len(rows)
    rho = 1 - 6 * sum((a - b) ** 2 for a, b in zip(rank(pred), rank(meas))) / (n * (n * n - 1))
    assert rho > 0.7, rho
    assert min(range(n), key=lambda i: pred[i]) == min(range(n), key=lambda i: meas[i])   # pp6 mbs4 wins both
    for p, m in zip(pred, meas):
        assert abs(p - m) / m < 0.25


def test_planner_errors():
    s = settings_of(config("181b_48nodes"))
    with pytest.raises(ValueError, match="--nodes"):
        plan_topology(s, 0)
    assert plan_topology(s, 1) == []       # 181B cannot fit one node: nothing, not a crash
    with pytest.raises(ValueError, match="--config"):
        load_config(os.path.join(ROOT, "configs", "no_such.json"))


@pytest.mark.parametrize("name", ["200b", "104b", "181b_48nodes"])
def test_dry_run_report(name):
    cfg = config(name)
    s = settings_of(cfg)
    exact = exact_model_params(num_layers=s["num_layers"], hidden_size=s["hidden_size"], vocab_size=s["vocab_size"],
                               seq_length=s["seq_length"], tp_size=s["tp_size"])
    text = report(cfg, meta_param_count=exact)
    stages = params_per_stage(num_layers=s["num_layers"], hidden_size=s["hidden_size"], vocab_size=s["vocab_size"],
                              seq_length=s["seq_length"], pp_size=s["pp_size"], tp_size=s["tp_size"],
                              partition_method=s["partition_method"])
    # per-stage totals add up to the model size (plus the tied copy of the embedding on the last stage)
    tied = s["padded_vocab_size"] * s["hidden_size"] if s["pp_size"] > 1 else 0
    assert sum(stages) == exact + tied
    assert f"sum over stages: {sum(stages):,} = model {exact:,} + tied output-embedding copy {tied:,}" in text
    assert "matches the formula" in text
    for section in ("resolved config", "pipeline partition", "memory per GPU", "TFLOPs per GPU"):
        assert section in text
    assert len([line for line in text.splitlines() if line.strip().split(" ")[0].isdigit()]) >= s["pp_size"]


def test_dry_run_reports_the_seed_tflops_for_200b():
    text = report(config("200b"))
    # the 10-node bf16 log line: 853.81 s/it printed 97.82 TFLOPs (legacy formula)
    line = next(line for line in text.splitlines() if "853.81" in line)
    assert "legacy 97.82" in line
    B, s, L, h, V = 2048, 2048, 80, 14400, 250880   # Narayanan eq. 3, written out
    narayanan = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)) / (853.81 * 80 * 1e12)
    assert f"improved {narayanan:.2f}" in line
    text = report(config("200b"), sec_per_iter=200.0)
    assert "given --sec-per-iter" in text


def test_dry_run_report_is_cheap(monkeypatch):
    """Formulas only: the report builds no module and allocates no tensor (checked directly, not by a clock
    whose margin would depend on the machine)."""
    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("dry_run_report built a module or a tensor")

    monkeypatch.setattr(torch.nn.Module, "__init__", refuse)
    for factory in ("empty", "zeros", "ones", "randn", "tensor"):
        monkeypatch.setattr(torch, factory, refuse)
    assert "TFLOPs" in report(config("200b"))


# -- the plan at the top of the dry run ------------------------------------------------------------

def plan_rows(text):
    """{GPU kind: (memory cell, s/iter, days, GPU-hours, source)} of the plan's table (the lines after its
    header, up to the first blank line)."""
    lines = text.split("\n\n")[0].splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("GPU kind"))
    rows = {}
    for line in lines[header + 1:]:
        kind, memory, rest = line[2:28].strip(), line[29:51].strip(), line[51:].split(None, 3)
        band, source = rest[3][:24].strip(), rest[3][24:]   # the error band, then the source
        rows[kind] = (memory, float(rest[0]), float(rest[1]), float(rest[2].replace(",", "")), source.strip(), band)
    return rows


def days_and_gpu_hours(samples, gbs, sec, gpus):
    """Written out: global batches x seconds each, in days, and times the GPUs in hours."""
    seconds = samples / gbs * sec
    return seconds / 86400, seconds / 3600 * gpus


def test_dry_run_starts_with_the_plan_of_200b(capsys):
    """pretrain_gpt.py --dry-run of configs/200b.json: GPUs as nodes x GPUs per node, the heaviest stage against
    each GPU kind's memory, seconds per iteration from the time model (the A100 fit) and from the shipped H100
    calibration, days and GPU-hours for train_samples, and a measured --sec-per-iter with its TFLOPs."""
    from gptpar.training.pretrain import main as pretrain_main
    from gptpar.estimate.planner import hardware_of, predict_layout
    from gptpar.estimate.validation import error_band

    assert pretrain_main(["--config", "configs/200b.json", "--dry-run", "--sec-per-iter", "150"]) == 0
    text = capsys.readouterr().out
    cfg = config("200b")
    s = settings_of(cfg)
    samples, gbs, gpus = cfg.training.train_samples, cfg.training.global_batch_size, 8 * 10 * 4
    lines = text.splitlines()
    assert lines[0] == "== plan =="
    assert lines[1] == "GPUs:     320 = 40 nodes x 8 GPUs per node (tp 8 x pp 10 x dp 4)"
    assert lines[3] == f"training: {samples:,} samples = {samples // gbs:,} global batches of {gbs:,}"
    need = memory_of(s)["max"]["total"] / GIB
    assert lines[4].startswith(f"memory:   {need:.1f} GiB per GPU on the heaviest stage (stage 0;")
    rows = plan_rows(text)
    assert list(rows) == ["a100-80gb", "h100-80gb", "h200", "measured (--sec-per-iter)"]
    for kind in ("a100-80gb", "h100-80gb", "h200"):
        hw = hardware_of(kind)
        memory, sec, days, gpu_hours, source, band = rows[kind]
        expected = predict_layout(s, hw)["sec_per_iter"]
        assert sec == pytest.approx(expected, rel=5e-3)   # printed to 3 significant digits
        want_days, want_hours = days_and_gpu_hours(samples, gbs, expected, gpus)
        assert days == pytest.approx(want_days, rel=5e-3)
        assert gpu_hours == pytest.approx(want_hours, rel=5e-3)
        assert memory == f"{hw.gpu_mem_gib:.1f} GiB: fits"
        assert source.endswith(f"gptpar/estimate/calibrations/kinds/{kind}.json")
        b = error_band(kind)
        all_kinds = " (all)" if b["kind"] == "all" else ""
        assert band == f"±{100 * b['median']:.0f}% med, ±{100 * b['worst']:.0f}% max{all_kinds}"
    _, sec, days, gpu_hours, source, _ = rows["measured (--sec-per-iter)"]
    assert sec == 150.0 and days == pytest.approx(days_and_gpu_hours(samples, gbs, 150, gpus)[0], rel=5e-3)
    B, q, L, h, V = 2048, 2048, 80, 14400, 250880   # Narayanan eq. 3, written out
    narayanan = 96 * B * q * L * h * h * (1 + q / (6 * h) + V / (16 * L * h)) / (150 * gpus * 1e12)
    assert source == f"= {narayanan:.2f} TFLOPs per GPU (improved formula)"
    plan = text.split("== resolved config ==")[0]
    assert "seed" not in plan  # what the sources are, said in words
    assert plan.count("== pipeline partition") == 1


def test_the_plan_says_when_the_heaviest_stage_does_not_fit():
    from gptpar.estimate.planner import GpuKind

    small = GpuKind("small GPU", "a test kind", Hardware(gpu_mem_gib=20.0))
    rows = plan_rows(render_dry_run(config("200b"), 4, kinds=[small]))
    assert rows["small GPU"][0] == "20.0 GiB: DOES NOT FIT"


def test_the_plan_of_a_small_world_and_an_iteration_count():
    """Fewer GPUs than a node, and train_iters instead of train_samples (train_iters global batches)."""
    cfg = load_config(os.path.join(ROOT, "configs", "cpu_tiny.json"))
    text = render_dry_run(cfg, 1)
    assert "GPUs:     1 = 1 node x 1 GPU (tp 1 x pp 1 x dp 1)" in text
    t = cfg.training
    assert f"training: {t.train_iters * t.global_batch_size:,} samples = {t.train_iters:,} global batches" in text
    import torch
    from gptpar.model.gpt import GPTModel

    with torch.device("meta"):
        params = sum(p.numel() for p in GPTModel(cfg.model).parameters())
    assert f"model:    {params / 1e6:.1f}M parameters," in text  # a small model in millions, not "0.0B"


def test_a_bad_calibration_is_one_line_exit_2(capsys):
    from gptpar.training.pretrain import main as pretrain_main

    assert pretrain_main(["--config", "configs/200b.json", "--dry-run", "--calibration", "h900"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--calibration 'h900': no such file (shipped: h100;" in err


def test_each_layout_is_priced_in_days_and_gpu_hours():
    s = settings_of(config("200b"))
    for c in plan_topology(s, 40)[:10]:
        days, hours = days_and_gpu_hours(s["train_samples"], s["global_batch_size"], c.sec_per_requested_batch,
                                         c.tp * c.pp * c.dp)
        assert (c.days, c.gpu_hours) == (pytest.approx(days, rel=1e-12), pytest.approx(hours, rel=1e-12))


CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".json"))


def test_dry_run_json_for_every_config_on_every_kind(capsys):
    """pretrain_gpt.py --config C --dry-run --json --gpu KIND: one JSON object, the plan for KIND at C's own layout,
    equal to the time model's figures."""
    from gptpar.estimate.kinds import kind_names
    from gptpar.estimate.planner import hardware_of, predict_layout, training_time
    from gptpar.training.pretrain import main as pretrain_main

    for name in CONFIGS:
        cfg = load_config(os.path.join(ROOT, "configs", name))
        s = settings_of(cfg)
        for kind in kind_names():
            assert pretrain_main(["--config", os.path.join(ROOT, "configs", name), "--dry-run", "--json",
                                  "--gpu", kind]) == 0, (name, kind)
            out = capsys.readouterr().out
            assert len(out.strip().splitlines()) == 1
            d = json.loads(out)
            want = predict_layout(s, hardware_of(kind))
            cost = training_time(s["train_samples"], s["global_batch_size"], want["sec_per_iter"], d["gpus"])
            assert d["gpu"] == kind and d["gpus"] == s["tp_size"] * s["pp_size"] * s["dp_size"]
            assert d["sec_per_iter"] == pytest.approx(want["sec_per_iter"])
            assert d["memory_gib"] == pytest.approx(memory_of(s)["max"]["total"] / GIB)
            assert d["fits"] is (d["memory_gib"] <= hardware_of(kind).gpu_mem_gib)
            assert (d["days"], d["gpu_hours"]) == (pytest.approx(cost["days"]), pytest.approx(cost["gpu_hours"]))
            assert d["tflops_per_gpu"] > 0 and d["assumptions"] == [] and d["error_band"]["median"] > 0


def test_dry_run_names_its_assumptions(capsys):
    from gptpar.training.pretrain import main as pretrain_main

    args = ["--config", os.path.join(ROOT, "configs", "200b.json"), "--dry-run", "--gpu", "h100-80gb"]
    assert pretrain_main(args + ["--json", "--assume", "dp-comm-overlap", "--assume", "tp-comm-overlap"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["assumptions"] == ["tp-comm-overlap", "dp-comm-overlap"] and d["parts"]["tp_comm_s"] == 0
    assert pretrain_main(args + ["--assume", "dp-comm-overlap"]) == 0
    text = capsys.readouterr().out
    assert "assumes:  dp-comm-overlap (gradient reduction overlapped" in text
    assert "plan for h100-80gb" in text
    assert pretrain_main(args) == 0
    assert "assumes:  what gptpar runs (1F1B schedule" in capsys.readouterr().out


@pytest.mark.parametrize("extra,needle", [(["--gpu", "v100"], "--gpu 'v100': unknown GPU kind (known: a100-80gb"),
                                          (["--assume", "zero-bubble"], "--assume 'zero-bubble': unknown assumption"),
                                          (["--assume", "interleaved=3"], "interleaved=3 needs")])
def test_dry_run_bad_kind_or_assumption_is_one_line_exit_2(capsys, extra, needle):
    from gptpar.training.pretrain import main as pretrain_main

    assert pretrain_main(["--config", os.path.join(ROOT, "configs", "200b.json"), "--dry-run", *extra]) == 2
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1 and needle in err, err


def test_a_cpu_configs_dry_run_has_no_gpu_rows_and_no_cuda_context(capsys):
    from gptpar.training.pretrain import main as pretrain_main

    assert pretrain_main(["--config", os.path.join(ROOT, "configs", "cpu_tiny.json"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    plan = text.split("\n\n")[0]
    assert "GPU kinds: none for an fp32 config; pass --gpu KIND" in plan and "s/iter" not in plan
    assert "CUDA context" not in text
    assert pretrain_main(["--config", os.path.join(ROOT, "configs", "cpu_tiny.json"), "--dry-run", "--gpu",
                          "a100-80gb"]) == 0
    rows = plan_rows(capsys.readouterr().out)
    assert list(rows)[0] == "a100-80gb" and rows["a100-80gb"][1] > 0   # three significant digits, never 0.0


def test_plan_topology_ranks_for_the_kind_asked(capsys):
    from gptpar.estimate.planner import hardware_of, plan_topology
    from gptpar.tools.plan_topology import main as plan_main

    args = ["--config", os.path.join(ROOT, "configs", "200b.json"), "--nodes", "48", "--gpu", "h100-80gb"]
    assert plan_main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    best = plan_topology(settings_of(config("200b")), 48, hardware_of("h100-80gb"))[0]
    assert d["gpu"] == "h100-80gb" and d["gpu_mem"] == pytest.approx(hardware_of("h100-80gb").gpu_mem_gib)
    assert (d["candidates"][0]["tp"], d["candidates"][0]["pp"], d["candidates"][0]["dp"]) == (best.tp, best.pp, best.dp)
    assert d["sec_per_iter"] == pytest.approx(best.sec_per_requested_batch) and d["days"] == pytest.approx(best.days)
    assert d["fits"] is True and d["memory_gib"] == best.mem_gib and d["assumptions"] == []
    assert plan_main(args) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "8 h100-80gb (79.2 GiB" in head and "error band ±" in head and "A100" not in head


def test_planning_doc_names_the_notes_by_file_name_only():
    with open(os.path.join(ROOT, "docs", "planning.md")) as f:
        text = f.read()
    assert "/work/" not in text and "seeds/`" not in text
    for name in ("000_8a7d515bbeffde54.txt", "003_c1a2cf81af8065a2.txt"):
        assert f"`{name}`" in text
