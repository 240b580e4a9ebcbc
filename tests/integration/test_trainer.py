"""The trainer end to end on 2 gloo ranks: the log line and metrics file checked field by field against
recomputation (through a batch-size ramp-up), interval averaging, and exact resume at dp=2 and pp=2.

One spawn runs every training (gptpar.training.pretrain.main called in the ranks, several times) to keep the suite fast.
"""
import json
import math
import os
import time
import types

import pytest
import torch

from gptpar.testing import run_distributed
from gptpar.training.reporting import METRIC_KEYS, format_log_line
from gptpar.testing.runs import (ROOT, TINY, cosine_lr, improved_tflops, log_lines, megatron_rampup, read_jsonl,
                          read_tensorboard, run_mains, synthetic_sample, write_config)

TINY_TRAINING = TINY["training"]

RAMP = dict(start=4, increment=4, ramp_samples=24, final=12)
REAL_VOCAB = 300
TRAIN_SAMPLES, WARMUP_SAMPLES, SEQ, LAYERS, HIDDEN, VOCAB, PADDED_VOCAB = 96, 16, 16, 2, 32, 200, 256


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer")
    ramp_training = dict(global_batch_size=RAMP["final"], train_iters=None, train_samples=TRAIN_SAMPLES,
                         rampup_batch_size=[RAMP["start"], RAMP["increment"], RAMP["ramp_samples"]],
                         lr_warmup_iters=0, lr_warmup_samples=WARMUP_SAMPLES, activation_checkpointing=True,
                         eval_interval=4, eval_iters=1)
    ramp = write_config(d / "ramp.json", training=ramp_training,
                        logging=dict(log_num_zeros=True, metrics_file=str(d / "ramp.jsonl"),
                                     tensorboard_dir=str(d / "tb")))
    ramp3 = write_config(d / "ramp3.json", training=ramp_training,
                         logging=dict(log_interval=3, metrics_file=str(d / "ramp3.jsonl")))
    dropout = dict(hidden_dropout=0.1, attention_dropout=0.1)  # resume must restore the RNG streams too
    resume = {}
    pp2 = dict(pipeline_model_parallel_size=2, data_parallel_size=1)
    for name, parallel, precision in (("dp", {}, "fp32"), ("pp", pp2, "fp32"), ("bf16_dp", {}, "bf16"),
                                      ("bf16_pp", pp2, "bf16")):
        full = write_config(d / f"{name}_full.json", model=dropout, parallel=parallel,
                            training=dict(precision=precision), logging=dict(metrics_file=str(d / f"{name}_full.jsonl")))
        ck = dict(save=str(d / f"{name}_ck"), load=str(d / f"{name}_ck"), keep_last=1)
        split = write_config(d / f"{name}_split.json", model=dropout, parallel=parallel, checkpoint=ck,
                             training=dict(precision=precision),
                             logging=dict(metrics_file=str(d / f"{name}_split.jsonl")))
        resume[name] = [(f"{name}_full", ["--config", full]),
                        (f"{name}_a", ["--config", split, "--set", "training.exit_interval=3"]),
                        (f"{name}_b", ["--config", split])]
    # Last: resuming dp's checkpoint with another model shape must be refused with a clear message; then longer
    # (train_iters 6 -> 9) keeping the checkpoint's LR schedule, through the real checkpoint files.
    resume["dp"].append(("dp_wrong_shape", resume["dp"][-1][1] + ["--set", "model.hidden_size=64"]))
    resume["dp"].append(("dp_longer", resume["dp"][-2][1] + [
        "--set", "training.train_iters=9", "--set", "training.lr_schedule_on_resume=checkpoint",
        "--set", f"logging.metrics_file={d / 'dp_longer.jsonl'}", "--set", f"checkpoint.save={d / 'dp_longer_ck'}"]))
    # The same training at pp=2 without ZeRO and at dp=2 with ZeRO-1 (clipping must use one global norm).
    zero0 = write_config(d / "pp_zero0.json", parallel=dict(pipeline_model_parallel_size=2, data_parallel_size=1),
                         training=dict(zero_stage=0), logging=dict(metrics_file=str(d / "pp_zero0.jsonl")))
    zero1 = write_config(d / "dp_zero1.json", logging=dict(metrics_file=str(d / "dp_zero1.jsonl")))
    real = write_config(d / "real.json", **real_data_sections(d))
    minutes = write_config(d / "minutes.json", training=dict(exit_duration_in_mins=1e-6),
                           checkpoint=dict(save=str(d / "minutes_ck")),
                           logging=dict(metrics_file=str(d / "minutes.jsonl")))
    timers = write_config(d / "timers.json", training=dict(train_iters=4),
                          logging=dict(log_interval=2, timers=True, metrics_file=str(d / "timers.jsonl"),
                                       profile="3-4", profile_dir=str(d / "profile")))
    plan = [("ramp", ["--config", ramp]), ("ramp3", ["--config", ramp3]), ("timers", ["--config", timers])] + \
        resume["dp"] + resume["pp"] + \
        resume["bf16_dp"] + resume["bf16_pp"] + \
        [("pp_zero0", ["--config", zero0]), ("dp_zero1", ["--config", zero1]), ("real", ["--config", real]),
         ("minutes", ["--config", minutes])]
    out = run_distributed(run_mains, 2, (plan,), timeout=400)
    return d, out


def real_data_sections(d):
    """A tokenizer and an MMIDIDX dataset made of this repository's sources (EOD after each file), and the
    config sections that train on them at pp=2 with Megatron's document masks."""
    from gptpar.tools import train_tokenizer
    from gptpar.data.indexed import IndexedDatasetBuilder
    from gptpar.data.tokenizer import load_tokenizer

    sources = sorted(os.path.join(ROOT, "gptpar", f) for f in os.listdir(os.path.join(ROOT, "gptpar"))
                     if f.endswith(".py"))
    with open(d / "corpus.jsonl", "w") as f:
        for path in sources:
            f.write(json.dumps({"text": open(path).read()}) + "\n")
    train_tokenizer.train([str(d / "corpus.jsonl")], REAL_VOCAB, "bpe", str(d / "tok"), byte_fallback=False)
    tok = load_tokenizer(str(d / "tok.model"))
    builder = IndexedDatasetBuilder(str(d / "real_text_document"), "uint16", tok.vocab_size)
    for path in sources:
        builder.add_document(tok.encode(open(path).read()) + [tok.eod])
    builder.finalize()
    return dict(model=dict(vocab_size=tok.vocab_size),
                parallel=dict(pipeline_model_parallel_size=2, data_parallel_size=1),
                training=dict(train_iters=3, lr_warmup_iters=1, eval_interval=3, eval_iters=1),
                data=dict(synthetic=False, data_path=str(d / "real_text_document"), split="80,20,0",
                          tokenizer_model=str(d / "tok.model"), reset_position_ids=True, reset_attention_mask=True,
                          eod_mask_loss=True),
                logging=dict(metrics_file=str(d / "real.jsonl")))


def expected_iterations():
    """(global batch size, consumed samples before it) per iteration, by Megatron's rules written out."""
    rows, consumed = [], 0
    while consumed <= RAMP["ramp_samples"]:
        gbs = megatron_rampup(consumed, **RAMP)
        rows.append((gbs, consumed))
        consumed += gbs
    while consumed + RAMP["final"] <= TRAIN_SAMPLES:
        rows.append((RAMP["final"], consumed))
        consumed += RAMP["final"]
    return rows


def test_every_run_exits_zero(runs):
    _, out = runs
    for rank_out in out:
        for name, (rc, _) in rank_out.items():
            assert rc == (2 if name == "dp_wrong_shape" else 0), name


def test_resume_with_another_model_shape_is_a_clear_error(runs):
    d, out = runs
    for rank_out in out:
        message = rank_out["dp_wrong_shape"][1]
        assert "pretrain_gpt.py: checkpoint error: " in message
        assert "model.hidden_size: checkpoint 32, config 64" in message
    assert (d / "dp_ck" / "latest").read_text().strip() == "iter_0000006"  # untouched by the refused run


def test_a_longer_resume_keeps_the_checkpoints_schedule_when_asked(runs):
    """dp's checkpoint of a 6-iteration cosine run resumed to 9 iterations with
    training.lr_schedule_on_resume=checkpoint: one line says so, and iterations 7-9 train at the 6-iteration
    schedule's LR (Megatron's formula written out: past its decay, min_lr), not at a re-stretched decay."""
    d, out = runs
    code, text = out[0]["dp_longer"]
    assert code == 0, text
    notes = [line for line in text.splitlines() if "LR schedule" in line]
    assert len(notes) == 1 and "(decay 6 -> 9 iterations); keeping the checkpoint's" in notes[0], notes
    gbs = TINY_TRAINING["global_batch_size"]
    lr, min_lr, warmup = TINY_TRAINING["lr"], TINY_TRAINING["min_lr"], TINY_TRAINING["lr_warmup_iters"]
    records = [r for r in read_jsonl(d / "dp_longer.jsonl") if not r.get("eval")]
    assert [r["iteration"] for r in records] == [7, 8, 9]
    for r in records:
        old = cosine_lr((r["iteration"] - 1) * gbs, warmup * gbs, 6 * gbs, lr, min_lr)
        assert r["lr"] == pytest.approx(old, rel=1e-12)
        assert r["lr"] != pytest.approx(cosine_lr((r["iteration"] - 1) * gbs, warmup * gbs, 9 * gbs, lr, min_lr))


def test_log_line_and_metrics_fields_recomputed(runs):
    d, out = runs
    records = [r for r in read_jsonl(d / "ramp.jsonl") if not r.get("eval")]
    lines = log_lines(out[0]["ramp"][1])  # dp=2, pp=1: rank 0 is the last stage's first dp rank
    assert log_lines(out[1]["ramp"][1]) == []
    rows = expected_iterations()
    assert len(records) == len(lines) == len(rows)
    consumed = 0
    for i, (rec, line, (gbs, before)) in enumerate(zip(records, lines, rows), start=1):
        assert set(rec) == set(METRIC_KEYS)
        assert line == format_log_line(**rec)
        consumed += gbs
        assert (rec["iteration"], rec["train_iters"], rec["global_batch_size"]) == (i, len(rows), gbs)
        assert rec["consumed_samples"] == consumed and rec["consumed_tokens"] == consumed * SEQ
        assert rec["lr"] == pytest.approx(cosine_lr(before, WARMUP_SAMPLES, TRAIN_SAMPLES, 1e-3, 1e-4), rel=1e-12)
        assert rec["skipped_iterations"] == 0 and rec["nan_iterations"] == 0
        # fp32: nothing is scaled, and the line says so as Megatron-DeepSpeed's does, with both counts at 0
        assert rec["loss_scale"] == 1.0
        assert " | loss scale: 1.0 | " in line
        assert " | number of skipped iterations:   0 | number of nan iterations:   0 | " in line
        assert math.isfinite(rec["lm_loss"]) and rec["grad_norm"] > 0
        # The padded vocab rows of the tied embedding never get a gradient; the only other gradient that is
        # zero in exact arithmetic is the key bias' (softmax ignores a constant added to a row's scores).
        padded_rows = (PADDED_VOCAB - VOCAB) * HIDDEN
        assert padded_rows <= rec["num_zeros"] <= padded_rows + LAYERS * HIDDEN
        assert rec["samples_per_second"] == pytest.approx(gbs / rec["elapsed_s"], rel=1e-12)
        assert rec["tokens_per_second"] == pytest.approx(gbs * SEQ / rec["elapsed_s"], rel=1e-12)
        total = sum(g for g, _ in rows)  # every iteration's batch, by Megatron's ramp-up rules
        assert rec["time_left_s"] == pytest.approx((total - consumed) * rec["elapsed_s"] / gbs, rel=1e-12)
        assert rec["tflops"] == pytest.approx(improved_tflops(gbs, SEQ, LAYERS, HIDDEN, PADDED_VOCAB,
                                                              rec["elapsed_s"], 2, recompute=True), rel=1e-9)
        assert "TFLOPs: 0.00 |" in line  # a CPU at two decimals
    assert [gbs for gbs, _ in rows][:6] == [4, 4, 4, 8, 8, 12]  # the ramp really ramps
    assert os.listdir(d / "tb"), "TensorBoard events written"


def test_the_run_is_quiet_and_writes_its_resolved_config(runs):
    """By default neither rank shows DeepSpeed's op-load line nor the FutureWarnings of its ZeRO-1 calls (both
    appear once per process: the first run of the harness's ranks), and rank 0 prints where the resolved config is
    instead of the config."""
    d, out = runs
    for rank in out:
        text = rank["ramp"][1]
        assert "built successfully" not in text and "FutureWarning" not in text, text
    assert f"resolved config: {d / 'resolved_config.json'} (--verbose prints it)" in out[0]["ramp"][1]
    assert '"model": {' not in out[0]["ramp"][1]


def test_first_loss_is_the_global_batch_mean(runs):
    """Iteration 1's loss = the tp=pp=dp=1 model's mean loss over the first global batch of synthetic samples."""
    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import GPTModel

    d, _ = runs
    first = read_jsonl(d / "ramp.jsonl")[0]
    model = GPTModel(GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                               vocab_size=VOCAB, make_vocab_size_divisible_by=128), seed=1234)
    text = torch.stack([synthetic_sample(1234, i, VOCAB, SEQ) for i in range(RAMP["start"])])
    with torch.no_grad():
        loss = model(text[:, :-1], labels=text[:, 1:]).item()
    assert first["lm_loss"] == pytest.approx(loss, rel=1e-5)


def test_eval_records(runs):
    d, out = runs
    evals = [r for r in read_jsonl(d / "ramp.jsonl") if r.get("eval")]
    n = len(expected_iterations())
    assert [r["iteration"] for r in evals] == sorted({*range(4, n + 1, 4), n})
    for r in evals:
        assert r["ppl"] == pytest.approx(math.exp(r["lm_loss"]), rel=1e-12)
        assert f"validation loss at iteration {r['iteration']} |" in out[0]["ramp"][1]


def test_interval_averages_loss_and_time(runs):
    d, _ = runs
    every = [r for r in read_jsonl(d / "ramp.jsonl") if not r.get("eval")]
    by3 = [r for r in read_jsonl(d / "ramp3.jsonl") if not r.get("eval")]
    assert [r["iteration"] for r in by3] == list(range(3, len(every) + 1, 3))
    for r in by3:
        window = every[r["iteration"] - 3:r["iteration"]]
        assert r["lm_loss"] == pytest.approx(sum(w["lm_loss"] for w in window) / 3, rel=1e-12)
        assert r["consumed_samples"] == window[-1]["consumed_samples"]
        assert r["global_batch_size"] == window[-1]["global_batch_size"]
        assert r["num_zeros"] is None and "num zeros" not in format_log_line(**r)  # not counted: omitted
        assert r["params_norm"] is None and "params norm" not in format_log_line(**r)  # log_params_norm unset


@pytest.mark.parametrize("name", ["dp", "pp", "bf16_dp", "bf16_pp"])
def test_exact_resume(runs, name):
    """6 iterations straight == 3, stop (exit_interval, saving), resume, 3 more: bitwise, in fp32 and in bf16
    (BF16_Optimizer: its fp32 master weights and Adam state come back from the checkpoint)."""
    d, out = runs
    full, split = read_jsonl(d / f"{name}_full.jsonl"), read_jsonl(d / f"{name}_split.jsonl")
    assert [r["iteration"] for r in split] == [1, 2, 3, 4, 5, 6]
    for key in ("lm_loss", "grad_norm", "lr", "consumed_samples"):
        assert [r[key] for r in split] == [r[key] for r in full], key
    stdout = "".join(rank_out[f"{name}_b"][1] for rank_out in out)
    assert f"resumed from {d / f'{name}_ck' / 'iter_0000003'}" in stdout
    ck = d / f"{name}_ck"
    assert (ck / "latest").read_text().strip() == "iter_0000006"
    assert sorted(p for p in os.listdir(ck) if p.startswith("iter_")) == ["iter_0000006"]  # keep_last=1


def test_pipeline_without_zero_clips_by_the_same_norm(runs):
    """pp=2 / ZeRO-0 and dp=2 / ZeRO-1 train the same model on the same batches: same norms and losses."""
    d, _ = runs
    a, b = read_jsonl(d / "pp_zero0.jsonl"), read_jsonl(d / "dp_zero1.jsonl")
    assert len(a) == len(b) == 6
    for key in ("grad_norm", "lm_loss"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-5), key


def test_real_data_with_document_masks_through_the_pipeline(runs):
    """Iteration 1 on a preprocessed dataset with Megatron's document masks at pp=2 = the serial model's loss
    on the same samples (the trainer averages the micro-batches' masked means, as Megatron does)."""
    from gptpar.data.gpt_dataset import build_train_valid_test_datasets
    from gptpar.data.masks import build_masks
    from gptpar.data.tokenizer import load_tokenizer
    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import GPTModel

    d, _ = runs
    records = read_jsonl(d / "real.jsonl")
    assert [r["iteration"] for r in records if not r.get("eval")] == [1, 2, 3]
    assert [r["iteration"] for r in records if r.get("eval")] == [3]
    tok = load_tokenizer(str(d / "tok.model"))
    train, _, _ = build_train_valid_test_datasets(str(d / "real_text_document"), "80,20,0", SEQ, 1234, (24, 8, 0))
    model = GPTModel(GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                               vocab_size=tok.vocab_size, make_vocab_size_divisible_by=128), seed=1234)
    losses = []
    with torch.no_grad():
        for j in range(4):  # global batch 8 = 4 micro-batches of 2 (dp = 1)
            text = torch.stack([torch.from_numpy(train[i]["text"]) for i in range(2 * j, 2 * j + 2)])
            tokens, labels = text[:, :-1], text[:, 1:]
            mask, loss_mask, positions = build_masks(tokens, tok.eod, reset_position_ids=True,
                                                     reset_attention_mask=True, eod_mask_loss=True)
            losses.append(model(tokens, positions, mask, labels=labels, loss_mask=loss_mask).item())
    assert records[0]["lm_loss"] == pytest.approx(sum(losses) / 4, rel=1e-5)


def test_exit_duration_stops_every_rank_and_saves(runs):
    d, out = runs
    assert [r["iteration"] for r in read_jsonl(d / "minutes.jsonl")] == [1]
    assert "stopping at iteration 1: exit_duration_in_mins (1e-06) reached" in out[0]["minutes"][1]
    assert (d / "minutes_ck" / "latest").read_text().strip() == "iter_0000001"


def test_profile_reports_its_iterations_on_the_log_rank_and_traces_every_rank(runs):
    """logging.profile="3-4" (in the timers run, dp 2): once, after iteration 4, the log rank prints the profiled
    iterations, their wall time and a table of ops by host time (this CPU) holding the model's GEMMs; each rank
    writes a Chrome trace of them, named by its rank; the other rank prints nothing."""
    import gzip

    d, out = runs
    printed = out[0]["timers"][1]
    assert printed.count("logging.profile: iterations 3-4 on rank 0:") == 1, printed
    report = printed[printed.index("logging.profile:"):]
    per_iteration = float(report.split("(")[1].split(" s per iteration")[0])
    assert per_iteration > 0 and "aten::mm" in report and "Self CPU" in report
    assert "logging.profile" not in out[1]["timers"][1]
    for rank in (0, 1):
        with gzip.open(d / "profile" / f"trace_rank{rank}.json.gz", "rt") as f:
            assert '"aten::mm"' in f.read()


def test_timers_split_each_iteration(runs):
    """logging.timers: after each log line, ms per iteration of each phase, which add up to the elapsed time
    (`other` is the rest: fetching the batch, the loss's dp all-reduce), also in the metrics file."""
    d, out = runs
    records = read_jsonl(d / "timers.jsonl")
    logged = [r for r in records if not r.get("timers")]
    timers = [r for r in records if r.get("timers")]
    assert [r["iteration"] for r in logged] == [r["iteration"] for r in timers] == [2, 4]
    printed = out[0]["timers"][1].splitlines()
    for log, timer in zip(logged, timers):
        phases = timer["ms_per_iteration"]
        assert list(phases) == ["batch", "forward", "backward", "micro-step", "optimizer", "other"]
        assert all(phases[k] > 0 for k in ("forward", "backward", "micro-step", "optimizer")), phases
        assert phases["batch"] >= 0 and phases["other"] >= 0, phases
        assert sum(phases.values()) == pytest.approx(1e3 * log["elapsed_s"], rel=1e-9)
        line = printed[printed.index(next(p for p in printed if p.startswith(f" iteration {log['iteration']:8d}"))) + 1]
        assert line == " time (ms) |" + "".join(f" {k}: {v:.2f} |" for k, v in phases.items())


class _LoopEngine:
    """The TrainEngine surface the trainer's loop uses, doing nothing; a test overrides what it watches."""
    device, phase_seconds, loss_scale, grad_norm, step_applied = torch.device("cpu"), None, 1.0, 0.5, True

    def set_micro_batches(self, *args):
        pass

    def set_lr(self, lr):
        pass

    def train_step(self, micro_batches, prepare_next=None):
        return 2.0

    def eval_step(self, micro_batches):
        return 3.0

    def to_device(self, micro_batches):
        return micro_batches

    def parameters(self):
        return [torch.ones(2)]


_ONE_RANK = types.SimpleNamespace(dp_size=1, tp_size=1, world_size=1, rank=0, dp_rank=0, tp_rank=0,
                                  is_last_stage=True, device=torch.device("cpu"))


def test_elapsed_time_is_wall_clock_between_steps_less_eval_saves_and_skips(tmp_path, monkeypatch):
    """Megatron's interval timer: an iteration's elapsed time runs from the end of the previous optimizer step to
    the end of its own, so the loop's work between steps (here the log line) is in it, while evaluation, saves and
    a skipped iteration are not. A fake clock that only the fake engine, checkpointer and log advance makes the
    expected times exact (no sleeps, no timing margins)."""
    import gptpar.training.trainer as trainer_module
    from gptpar.config import config_from_dict

    now = [0.0]

    def advance(seconds):
        now[0] += seconds

    class Engine(_LoopEngine):
        def train_step(self, micro_batches, prepare_next=None):
            advance(1.0)
            return 2.0

        def eval_step(self, micro_batches):
            advance(100.0)
            return 3.0

    class Checkpointer:
        def __init__(self):
            self.saved = []
            self.pre_save_checks = []

        def due(self, iteration):
            return iteration % 2 == 0  # checkpoint.save_interval

        def save(self, engine, iteration, client_state, tracker, final=False):
            if self.saved[-1:] == [iteration]:  # saved already (the real one's policy)
                return None
            advance(50.0)
            self.saved.append(iteration)
            return str(tmp_path / f"iter_{iteration}")

        def poll(self):
            pass

        def wait(self, *args):
            pass

        def failed(self):
            return False

    source = types.SimpleNamespace(micro_batches=lambda consumed, gbs: [])
    pstate = _ONE_RANK
    cfg = config_from_dict({"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                                      "vocab_size": 200},
                            "training": {"micro_batch_size": 1, "global_batch_size": 1, "train_iters": 4,
                                         "eval_interval": 2, "eval_iters": 1, "skip_train_iteration_range": ["3-3"]},
                            "data": {"synthetic": True},
                            "checkpoint": {"save": str(tmp_path / "ck"), "save_interval": 2},
                            "logging": {"log_interval": 1, "metrics_file": str(tmp_path / "m.jsonl")}})
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0], time=time.time))
    memory_reads = []
    monkeypatch.setattr(trainer_module, "memory_usage",
                        lambda device: memory_reads.append(device) or {"resident": 1.0, "max resident": 2.0})
    printed = []
    checkpointer = Checkpointer()
    trainer = trainer_module.Trainer(cfg, pstate, Engine(), source, {None: source}, checkpointer,
                                     log=lambda line: (printed.append(line), advance(0.25)))
    assert trainer.train() == "train_iters reached"
    logged = [r for r in read_jsonl(tmp_path / "m.jsonl") if "elapsed_s" in r]
    # 1: the step; 2: iteration 1's log line and memory report (printed once) + the step; 4: iteration 2's log
    # line + the step (iteration 2's evaluation and save and iteration 3, skipped, with the lines they print, are
    # left out)
    assert [(r["iteration"], r["elapsed_s"]) for r in logged] == [(1, 1.0), (2, 1.5), (4, 1.25)]
    # the time left: the samples still to train (4 iterations of 1) at the interval's seconds per sample
    assert [r["time_left_s"] for r in logged] == [3 * 1.0, 2 * 1.5, 0.0]
    assert [r["tokens_per_second"] for r in logged] == [16 / 1.0, 16 / 1.5, 16 / 1.25]
    assert sum("memory (MB)" in line for line in printed) == 1
    assert len(memory_reads) == len(logged)  # at every log line, for the metrics file's memory fields
    assert [(r["max_allocated_bytes"], r["max_reserved_bytes"]) for r in logged] == [(2.0, None)] * len(logged)
    assert any("skipping iterations 3-3" in line for line in printed)
    assert sum("validation loss" in line for line in printed) == 2  # the evaluations did run (iterations 2, 4)
    assert checkpointer.saved == [2, 4]


def test_a_log_line_reads_nothing_from_the_device(tmp_path, monkeypatch):
    """With the metrics file and TensorBoard on, each log line's memory figures are the allocator's host-side
    counters, the largest over the ranks reduced on the host (one rank here: nothing to reduce): no tensor is made
    on the device to be read back, which would make the host wait for the step queued there. The device is `meta`
    here, where reading back any tensor raises; the figures reach the record's memory fields and TensorBoard."""
    import gptpar.training.trainer as trainer_module
    from gptpar.config import config_from_dict

    usage = {"allocated": 1.0, "max allocated": 3.0, "reserved": 4.0, "max reserved": 5.0}  # CUDA's labels
    monkeypatch.setattr(trainer_module, "memory_usage", lambda device: dict(usage))
    pstate = types.SimpleNamespace(**{**vars(_ONE_RANK), "device": torch.device("meta")})
    source = types.SimpleNamespace(micro_batches=lambda consumed, gbs: [])
    cfg = config_from_dict({"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                                      "vocab_size": 200},
                            "training": {"micro_batch_size": 1, "global_batch_size": 1, "train_iters": 3},
                            "data": {"synthetic": True},
                            "logging": {"log_interval": 1, "metrics_file": str(tmp_path / "m.jsonl"),
                                        "tensorboard_dir": str(tmp_path / "tb")}})
    trainer = trainer_module.Trainer(cfg, pstate, _LoopEngine(), source, {}, log=lambda line: None)
    assert trainer.train() == "train_iters reached"
    records = read_jsonl(tmp_path / "m.jsonl")
    assert [(r["max_allocated_bytes"], r["max_reserved_bytes"]) for r in records] == [(3.0, 5.0)] * 3
    assert read_tensorboard(tmp_path / "tb")["mem-max-reserved-bytes"] == [(1, 5.0), (2, 5.0), (3, 5.0)]


def test_the_next_batch_is_drawn_during_the_step_and_used_only_where_it_is_that_iterations(monkeypatch):
    """The trainer draws the next global batch while the engine's step waits for the device (`prepare_next`,
    called once the last backward is queued), and trains iteration k on the batch after iteration k's own consumed
    samples and at its own ramped-up size: drawn once (prefetched), not for a skipped iteration (discarded
    instead) nor after the last; a prefetch that fails leaves the step it ran in alone, and the batch is drawn
    again in its own iteration."""
    import gptpar.training.trainer as trainer_module
    from gptpar.config import config_from_dict

    draws, trained, failed_once = [], [], set()

    def micro_batches(consumed, gbs):
        draws.append((consumed, gbs))
        if consumed == 8 and consumed not in failed_once:  # the prefetch of iteration 6's batch fails once
            failed_once.add(consumed)
            raise OSError("a flaky read")
        return [{"consumed": consumed, "gbs": gbs}]

    class Engine(_LoopEngine):
        def train_step(self, batches, prepare_next=None):
            c = trainer.counters
            trained.append((c.iteration + 1, batches, (c.consumed_samples, trainer.engine_gbs)))
            if prepare_next is not None:
                prepare_next()
            return 2.0

        def to_device(self, batches):
            return [dict(mb, prefetched=True) for mb in batches]

    source = types.SimpleNamespace(micro_batches=micro_batches)
    pstate = _ONE_RANK
    cfg = config_from_dict({"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                                      "vocab_size": 200},
                            "training": {"micro_batch_size": 1, "global_batch_size": 2, "rampup_batch_size": [1, 1, 2],
                                         "train_samples": 11, "lr_warmup_samples": 0, "lr_decay_samples": 11,
                                         "skip_train_iteration_range": ["4-4"]},
                            "data": {"synthetic": True}})
    monkeypatch.setattr(trainer_module, "memory_usage", lambda device: {"resident": 1.0, "max resident": 2.0})
    trainer = trainer_module.Trainer(cfg, pstate, Engine(), source, {}, log=lambda line: None)
    assert trainer.train() == "train_iters reached"
    # consumed before each iteration: 0, 1 (gbs 1 while consumed <= 1), 3, 5 (skipped), 7, 9; gbs 2 from 2 on
    assert [(k, key) for k, _, key in trained] == [(1, (0, 1)), (2, (1, 1)), (3, (1 + 1, 2)), (5, (6, 2)),
                                                    (6, (8, 2))]
    for _, batches, (consumed, gbs) in trained:
        assert [(mb["consumed"], mb["gbs"]) for mb in batches] == [(consumed, gbs)]
    prefetched = [k for k, batches, _ in trained if batches[0].get("prefetched")]
    assert prefetched == [2, 3]  # 1: before any step; 5: after the skipped 4; 6: its prefetch failed
    # each batch drawn once, but iteration 4's (discarded by the skip) and 6's (its prefetch failed, then drawn)
    assert draws == [(0, 1), (1, 1), (2, 2), (4, 2), (6, 2), (8, 2), (8, 2)]
