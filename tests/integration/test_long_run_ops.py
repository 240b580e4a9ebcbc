"""Operating a long run: skip ranges, the kill switch, named validation sets, Megatron-DeepSpeed's
TensorBoard tags, end to end on 2 gloo ranks (dp = 2), each against a reference computation:

- skip ["5-7"] over 12 iterations == a run fed batches 0-3 then 7-11 (its data shifted from outside), bitwise;
- the kill switch touched after iteration 4 stops both ranks there with a checkpoint, and the resumed run (which
  skips 5-7 again) equals the uninterrupted one bitwise; a switch present at launch exits 0 before training;
- through a batch-size ramp-up, a skipped iteration advances the ramp-up and the LR schedule as Megatron's
  formulas (written out in gptpar.testing.runs) say, and TensorBoard holds Megatron's tags at those steps;
- two validation sets from two different real texts (this repository's Python and its Markdown, byte-level
  tokens): each set's loss equals the serial model's on that set alone, built with the plain single-dataset
  reader.

One spawn runs every training (gptpar.training.pretrain.main called in the ranks several times) to keep the suite fast.
"""
import json
import os
import random
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from gptpar.testing import run_distributed
from gptpar.config import ConfigError, config_from_dict
from gptpar.testing.runs import (TINY, cosine_lr, log_lines, megatron_rampup, read_jsonl, read_tensorboard,
                          run_mains, write_config)

GBS, SEQ, SKIP = 8, 16, (5, 7)
RAMP = dict(start=4, increment=4, ramp_samples=24, final=12)
CONSTANT_LR = dict(train_iters=12, lr_warmup_iters=0, lr_decay_style="constant")


class _ShiftedSource:
    """A train source that, from sample `after` on, reads `by` samples later: batches 0-3 then 7-11."""

    def __init__(self, source, after, by):
        self.source, self.after, self.by, self.masks = source, after, by, source.masks

    def micro_batches(self, consumed, global_batch_size):
        return self.source.micro_batches(consumed + (self.by if consumed >= self.after else 0), global_batch_size)


def _shifted_sources(real):
    def build_sources(*args, **kwargs):
        train, valid = real(*args, **kwargs)
        return _ShiftedSource(train, 4 * GBS, (SKIP[1] - SKIP[0] + 1) * GBS), valid
    return build_sources


def _touch_after(path, iteration, real):
    """Trainer.train_step that creates `path` on rank 0 once `iteration` is done (the operator's `touch`)."""
    def train_step(self):
        real(self)
        if self.pstate.rank == 0 and self.counters.iteration == iteration:
            open(path, "w").close()
    return train_step


def _on_rank0(action):
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def _rank_plan(configs, kill_switch):
    """Every run of the module on one harness rank, in order; {name: (exit code, output)}."""
    import gptpar.training.sources as data
    from gptpar.training.trainer import Trainer

    out = run_mains([("skip", ["--config", configs["skip"]])])
    with mock.patch.object(data, "build_sources", _shifted_sources(data.build_sources)):
        out.update(run_mains([("shifted", ["--config", configs["shifted"]])]))
    with mock.patch.object(Trainer, "train_step", _touch_after(kill_switch, 4, Trainer.train_step)):
        out.update(run_mains([("killed", ["--config", configs["kill"]])]))
    _on_rank0(lambda: os.remove(kill_switch))
    out.update(run_mains([("resumed", ["--config", configs["kill"]])]))
    _on_rank0(lambda: open(kill_switch, "w").close())
    out.update(run_mains([("at_launch", ["--config", configs["kill"]])]))
    _on_rank0(lambda: os.remove(kill_switch))
    out.update(run_mains([("ramp", ["--config", configs["ramp"]]), ("valid", ["--config", configs["valid"]])]))
    return out


def _byte_dataset(prefix, texts):
    """An MMIDIDX dataset of `texts` (one document each) tokenized as UTF-8 bytes (ids < 256)."""
    from gptpar.data.indexed import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix), "uint16", 256)
    for text in texts:
        builder.add_document(list(text.encode("utf-8")))
    builder.finalize()
    return str(prefix)


def _corpora(d):
    """Two different texts, made by a seeded generator: Python-like functions (one document each) and English-like
    paragraphs (one each). Not this repository's own files: every edit of those moved the two sets' losses at
    init (which differ only by chance, see the validation-set test) and once put them under the check's reach."""
    rng = random.Random(0)
    names = ["x", "y", "total", "row", "scale", "value", "i", "n"]
    code = ["".join(f"def f{k}_{j}({rng.choice(names)}, {rng.choice(names)}):\n"
                    f"    return {rng.choice(names)} * {rng.randrange(100)} + {rng.randrange(10)}\n\n"
                    for j in range(rng.randrange(3, 12))) for k in range(60)]
    words = ("the loss of each set is read alone and compared with a serial model at the same seed while training "
             "stays at its first weights").split()
    prose = [" ".join(rng.choice(words) for _ in range(rng.randrange(40, 120))).capitalize() + "."
             for _ in range(81)]
    return _byte_dataset(d / "code", code), _byte_dataset(d / "prose", prose)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("long_run")
    kill_switch = str(d / "KILL")
    code, prose = _corpora(d)
    configs = {
        "skip": write_config(d / "skip.json", training=dict(CONSTANT_LR, skip_train_iteration_range=["5-7"]),
                             logging=dict(metrics_file=str(d / "skip.jsonl"))),
        "shifted": write_config(d / "shifted.json", training=dict(CONSTANT_LR, train_iters=9),
                                logging=dict(metrics_file=str(d / "shifted.jsonl"))),
        "kill": write_config(d / "kill.json", training=dict(CONSTANT_LR, skip_train_iteration_range=["5-7"],
                                                            kill_switch_path=kill_switch),
                             checkpoint=dict(save=str(d / "ck"), load=str(d / "ck")),
                             logging=dict(metrics_file=str(d / "kill.jsonl"))),
        "ramp": write_config(d / "ramp.json",
                             training=dict(global_batch_size=RAMP["final"], train_iters=None, train_samples=96,
                                           rampup_batch_size=[RAMP["start"], RAMP["increment"], RAMP["ramp_samples"]],
                                           lr_warmup_iters=0, lr_warmup_samples=16, eval_interval=4, eval_iters=1,
                                           skip_train_iteration_range=["3-4", "9-9"]),
                             logging=dict(metrics_file=str(d / "ramp.jsonl"), tensorboard_dir=str(d / "tb"))),
        # lr 0: the weights stay the seeded initial ones, so the serial model is the reference evaluation
        "valid": write_config(d / "valid.json", model=dict(vocab_size=256),
                              training=dict(train_iters=1, lr=0.0, min_lr=0.0, lr_warmup_iters=0, eval_interval=1,
                                            eval_iters=2),
                              data=dict(synthetic=False, data_path=code, split="90,10,0",
                                        valid_data_path=[f"code: 1.0 0:1 {code}", f"prose: 1.0 0.5:1 {prose}"]),
                              logging=dict(metrics_file=str(d / "valid.jsonl"), tensorboard_dir=str(d / "tb_valid"))),
    }
    out = run_distributed(_rank_plan, 2, (configs, kill_switch), timeout=400)
    return d, out, (code, prose)


def _train(records):
    return [r for r in records if not r.get("eval") and not r.get("skipped_data")]


def test_every_run_exits_zero(runs):
    _, out, _ = runs
    for rank_out in out:
        assert {name: rc for name, (rc, _) in rank_out.items()} == dict.fromkeys(rank_out, 0)


def test_skipped_iterations_draw_and_discard_their_batches(runs):
    """No training logged for 5-7, consumed samples 8 x gbs at iteration 8, and 8-12 == the run fed batches
    7-11 after batches 0-3 (constant LR, so the two runs differ only in which data they saw)."""
    d, out, _ = runs
    records = read_jsonl(d / "skip.jsonl")
    train, shifted = _train(records), _train(read_jsonl(d / "shifted.jsonl"))
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 8, 9, 10, 11, 12]
    skipped = [r for r in records if r.get("skipped_data")]
    assert [(r["iteration"], r["consumed_samples"]) for r in skipped] == [(i, i * GBS) for i in range(5, 8)]
    assert train[4]["consumed_samples"] == 8 * GBS and train[4]["consumed_tokens"] == 8 * GBS * SEQ
    assert all(r["skipped_iterations"] == 0 for r in train)  # discarded data is not an overflow skip
    assert [r["iteration"] for r in shifted] == list(range(1, 10))
    for key in ("lm_loss", "grad_norm", "lr"):
        assert [r[key] for r in train] == [r[key] for r in shifted], key
    lines = log_lines(out[0]["skip"][1])
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [1, 2, 3, 4, 8, 9, 10, 11, 12]
    assert "skipping iterations 5-7 (training.skip_train_iteration_range)" in out[0]["skip"][1]


def test_skipped_iterations_advance_rampup_and_lr(runs):
    """Through a batch-size ramp-up, skipped iterations (3-4, 9) consume their batch sizes and move the LR as
    trained ones: every iteration's batch size and LR follow Megatron's formulas of the consumed samples."""
    d, _, _ = runs
    records = [r for r in read_jsonl(d / "ramp.jsonl") if not r.get("eval")]
    before = 0
    for i, r in enumerate(records, start=1):
        assert r["iteration"] == i and bool(r.get("skipped_data")) == (i in (3, 4, 9))
        gbs = megatron_rampup(before, RAMP["start"], RAMP["increment"], RAMP["ramp_samples"], RAMP["final"])
        assert r["global_batch_size"] == gbs and r["consumed_samples"] == before + gbs
        assert r["lr"] == pytest.approx(cosine_lr(before, 16, 96, 1e-3, 1e-4), rel=1e-12)
        before += gbs
    assert len({r["global_batch_size"] for r in records}) == 3  # the ramp really ramps across the skips


def _deterministic(records):
    """What two runs of the same training must share bitwise (not the wall-clock fields)."""
    keys = ("iteration", "skipped_data", "consumed_samples", "consumed_tokens", "lr", "lm_loss", "grad_norm")
    return [tuple(r.get(k) for k in keys) for r in records]


def test_kill_switch_stops_every_rank_saves_and_resumes_exactly(runs):
    """Touched on rank 0 after iteration 4: both ranks stop there (the checkpoint needs both), exit 0, and the
    resumed run, which skips 5-7 again, equals the uninterrupted 12 iterations bitwise."""
    d, out, _ = runs
    assert f"stopping at iteration 4: kill switch {d / 'KILL'} found (training.kill_switch_path)" in out[0]["killed"][1]
    records = read_jsonl(d / "kill.jsonl")
    assert [r["iteration"] for r in records[:4]] == [1, 2, 3, 4]
    assert f"resumed from {d / 'ck' / 'iter_0000004'}" in out[0]["resumed"][1]
    assert "skipping iterations 5-7" in out[0]["resumed"][1]  # the range applies again after the resume
    assert _deterministic(records) == _deterministic(read_jsonl(d / "skip.jsonl"))
    assert (d / "ck" / "latest").read_text().strip() == "iter_0000012"


def test_kill_switch_present_at_launch_exits_before_training(runs):
    d, out, _ = runs
    assert "kill switch " + str(d / "KILL") + " exists (training.kill_switch_path): exiting before training" \
        in out[0]["at_launch"][1]
    assert "precision plan" not in out[0]["at_launch"][1]  # nothing was built
    assert len(_train(read_jsonl(d / "kill.jsonl"))) == 9  # the launch wrote nothing more


def test_megatron_tensorboard_tags_read_back(runs):
    """The ramp run's event files hold Megatron-DeepSpeed's tags, each value at its iteration and at its
    consumed samples / tokens, exactly the metrics file's numbers; skipped iterations are absent."""
    pytest.importorskip("tensorboard")
    d, _, _ = runs
    scalars = read_tensorboard(d / "tb")
    records = read_jsonl(d / "ramp.jsonl")
    train, evals = _train(records), [r for r in records if r.get("eval")]
    for tag, key in (("lm-loss-training/lm loss", "lm_loss"), ("learning-rate/learning-rate", "lr"),
                     ("grad-norm/grad-norm", "grad_norm"), ("iteration-time/iteration-time", "elapsed_s"),
                     ("lm-loss-validation/lm loss validation", "lm_loss"),
                     ("lm-loss-validation/lm loss validation ppl", "ppl")):
        rows = evals if tag.startswith("lm-loss-validation") else train
        for suffix, x in (("", "iteration"), (" vs samples", "consumed_samples"), (" vs tokens", "consumed_tokens")):
            assert scalars[tag + suffix] == [(r[x], pytest.approx(r[key], rel=1e-6)) for r in rows], tag + suffix
    assert scalars["batch-size/batch-size vs samples"] == [(r["consumed_samples"], r["global_batch_size"])
                                                           for r in train]
    assert [step for step, _ in scalars["steps-vs-samples/y=samples,x=steps"]] == [r["iteration"] for r in train]
    last = max(r["iteration"] for r in records)
    assert [r["iteration"] for r in evals] == sorted({*range(4, last + 1, 4), last})  # every 4 and at the end
    assert not any(tag.startswith("train/") for tag in scalars)  # megatron is the default


def test_named_validation_sets_each_equal_a_single_set_evaluation(runs):
    """Each set's loss == the serial model (the same seed; lr 0 keeps it at init) on that set's first eval_iters
    global batches, read alone: `code` with the plain single-dataset reader (split 0,1,0 = every document),
    `prose` ("0.5:1") as one GPTDataset of documents [round(0.5 D), D) (Megatron-DeepSpeed's get_split_by_range_
    rounding, written out); the total is their mean; both sets reach the log, the metrics file and TensorBoard
    under their names."""
    import numpy as np

    from gptpar.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
    from gptpar.data.indexed import IndexedDataset
    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import GPTModel

    d, out, (code, prose) = runs
    evals = [r for r in read_jsonl(d / "valid.jsonl") if r.get("eval")]
    by_set = {r.get("valid_set"): r for r in evals}
    assert list(by_set) == ["code", "prose", None]
    m = TINY["model"]
    model = GPTModel(GPTConfig(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                               num_attention_heads=m["num_attention_heads"], seq_length=SEQ, vocab_size=256,
                               make_vocab_size_divisible_by=128), seed=TINY["training"]["seed"]).eval()
    seed, ref = TINY["training"]["seed"], str(d / "reference_cache")  # its own index cache, not the run's
    _, code_alone, _ = build_train_valid_test_datasets(code, "0,1,0", SEQ, seed, (0, 2 * GBS, 0), cache_dir=ref)
    prose_docs = IndexedDataset(prose).num_documents
    prose_alone = GPTDataset(IndexedDataset(prose), np.arange(int(round(0.5 * prose_docs)), prose_docs), SEQ, seed,
                             2 * GBS, cache_dir=ref)
    for name, valid in (("code", code_alone), ("prose", prose_alone)):
        losses = []
        with torch.no_grad():
            for k in range(2):
                text = torch.stack([torch.from_numpy(valid[i]["text"]) for i in range(k * GBS, (k + 1) * GBS)])
                losses.append(model(text[:, :-1], labels=text[:, 1:]).item())
        assert by_set[name]["lm_loss"] == pytest.approx(sum(losses) / 2, rel=1e-5), name
    code_loss, prose_loss = by_set["code"]["lm_loss"], by_set["prose"]["lm_loss"]
    # The check above can tell the sets apart: their losses differ by well over its tolerance (a model at its
    # random init scores any text near ln(256), so they differ by chance: 0.9% with these seeded texts).
    assert abs(code_loss - prose_loss) > 10 * 1e-5 * code_loss
    assert by_set[None]["lm_loss"] == pytest.approx((code_loss + prose_loss) / 2, rel=1e-12)
    for name in ("code", "prose"):
        assert f" validation loss of {name} at iteration 1 | lm loss value: {by_set[name]['lm_loss']:.6E} |" \
            in out[0]["valid"][1]
        tag = f"lm-loss-validation/{name}/lm loss validation"
        assert read_tensorboard(d / "tb_valid")[tag] == [(1, pytest.approx(by_set[name]["lm_loss"], rel=1e-6))]


@pytest.mark.parametrize("section, values, message", [
    ("training", {"skip_train_iteration_range": ["5"]}, 'item \'5\' must be "START-END"'),
    ("training", {"skip_train_iteration_range": ["7-5"]}, 'need 1 <= START <= END'),
    ("training", {"skip_train_iteration_range": ["0-3"]}, 'need 1 <= START <= END'),
    ("training", {"skip_train_iteration_range": ["10-20", "5-10"]}, 'ranges 5-10 and 10-20 overlap: merge them'),
    ("training", {"kill_switch_path": ""}, "training.kill_switch_path is an empty string"),
    ("data", {"synthetic": True, "valid_data_path": {"en": "x"}}, "data.valid_data_path names datasets but"),
    ("data", {"valid_data_path": {"a/b": "x"}}, "data.valid_data_path: validation set name 'a/b'"),
    ("data", {"valid_data_path": ["EN: 1 0.5:0.2 x"]}, "needs 0 <= START < END <= 1"),
    ("data", {"valid_data_path": ["EN: 1 0:1 x", "y"]}, "mixes weighted split paths"),
    ("data", {"valid_data_path": {"en": ["0.3", "x", "y"]}}, "set 'en': weighted data_path"),
    ("logging", {"tensorboard_tags": "tb"}, "logging.tensorboard_tags must be one of ['megatron', 'gptpar']"),
])
def test_bad_values_are_config_errors(section, values, message):
    if section == "data" and "synthetic" not in values:
        values = dict(values, synthetic=False, data_path="x")
    with pytest.raises(ConfigError) as e:
        config_from_dict(dict(TINY, **{section: dict(TINY[section], **values)}))
    assert message in str(e.value)


def test_megatron_flags_and_forms_are_accepted():
    from gptpar.training.cli import parse_args

    _, overrides, _ = parse_args(["--skip-train-iteration-range", "101-200", "5-7"])
    sets = {"en": "a", "fr": ["1", "b", "2", "c"]}
    cfg = config_from_dict(dict(TINY, data={"data_path": "x", "valid_data_path": sets}), overrides)
    assert cfg.training.skip_train_iteration_range == ["101-200", "5-7"]
    assert json.loads(cfg.to_json())["data"]["valid_data_path"] == sets  # saved with checkpoints as given
    groups = ["EN: 1.0 0.95:1 data/en", "FR: 0.7 0.9:1 data/fr, 0.3 0.9:1 data/fr2"]
    _, overrides, _ = parse_args(["--valid-weighted-split-paths", *groups])
    cfg = config_from_dict(dict(TINY, data={"data_path": "x"}), overrides)
    assert cfg.data.valid_data_path == groups
