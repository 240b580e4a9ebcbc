"""training.precision = fp8 through the trainer (gptpar.training.pretrain.main on 2 gloo ranks, torchao's emulation on CPU).

- fp8 learns as bf16 does: 20 iterations of a tiny model on data it can learn, at tp 1 and tp 2, its last loss
  within 2% of bf16's, its losses not bf16's;
- checkpoints stay bf16: a model whose GEMMs are padded or kept in bf16 saves its weights at their own shapes,
  and fp8 <-> bf16 resume at the same and at another (tp, dp) shape.
"""
import os

import numpy as np
import pytest
import torch

from gptpar.testing import run_distributed
from gptpar.testing.runs import log_lines, read_jsonl, run_mains, write_config

VOCAB = 64


def write_learnable_corpus(prefix, num_docs=400, seed=0):
    """Documents that count up from a random start by a step of 1, 2 or 3 (mod VOCAB): after two tokens each next
    one is determined, so a model can learn the data (uniform random tokens would keep the loss at ln V whatever
    the GEMMs do)."""
    from gptpar.data.indexed import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(str(prefix), np.uint16, VOCAB) as builder:
        for _ in range(num_docs):
            start, step, length = rng.integers(0, VOCAB), rng.integers(1, 4), rng.integers(40, 80)
            builder.add_document((start + step * np.arange(length)) % VOCAB)
        builder.finalize()
    return str(prefix)


def _config(d, name, data, *, tp=1, load=None, save=False, model=None, **training):
    t = dict(train_iters=20, lr=1e-2, min_lr=1e-3, lr_warmup_iters=2, micro_batch_size=2, global_batch_size=8,
             precision="fp8")
    t.update(training)
    return ["--config", write_config(
        d / f"{name}.json", model=dict(dict(hidden_size=64, num_attention_heads=4, seq_length=32,
                                            vocab_size=VOCAB), **(model or {})),
        parallel=dict(tensor_model_parallel_size=tp, data_parallel_size=2 // tp),
        training=t, data=dict(synthetic=False, data_path=data, split="100,0,0"),
        checkpoint=dict(save=str(d / f"{name}_ck") if save else None,
                        load=str(load) if load is not None else None,
                        save_interval=4 if save else None),
        logging=dict(log_interval=1, metrics_file=str(d / f"{name}.jsonl")))]


def _losses(d, name):
    return {r["iteration"]: r["lm_loss"] for r in read_jsonl(d / f"{name}.jsonl") if not r.get("eval")}


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8_learn")
    data = write_learnable_corpus(d / "count_text_document")
    runs = [(f"{precision}_tp{tp}", _config(d, f"{precision}_tp{tp}", data, tp=tp, precision=precision))
            for tp in (1, 2) for precision in ("bf16", "fp8")]
    return d, run_distributed(run_mains, 2, (runs,), timeout=900)[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_learns_as_bf16_does(learned, tp):
    d, out = learned
    for name in (f"bf16_tp{tp}", f"fp8_tp{tp}"):
        assert out[name][0] == 0, out[name][1][-3000:]
        assert len(log_lines(out[name][1])) == 20
    bf16, fp8 = _losses(d, f"bf16_tp{tp}"), _losses(d, f"fp8_tp{tp}")
    assert sorted(fp8) == sorted(bf16) == list(range(1, 21))
    assert bf16[20] < 0.75 * bf16[1]  # the data is learnt: the 2% below is a comparison of learning, not of noise
    assert fp8[20] == pytest.approx(bf16[20], rel=0.02)
    assert any(fp8[i] != bf16[i] for i in fp8)  # float8 GEMMs, not bf16's
    plan = next(line for line in out[f"fp8_tp{tp}"][1].splitlines() if line.startswith("precision plan:"))
    assert "parameters bf16, gradient accumulation fp32" in plan and "BF16_Optimizer" in plan
    assert "GEMMs float8 through torchao" in plan and "emulated: no CUDA device" in plan
    assert "output layer (tied embedding) bf16" in plan
    assert "GEMMs float8" not in next(line for line in out[f"bf16_tp{tp}"][1].splitlines()
                                      if line.startswith("precision plan:"))


# -- checkpoints: bf16's, resumable in either precision at any shape -------------------------------------------------

# hidden 120: query_key_value (360, 120) is padded to (368, 128) and dense (120, 120) kept in bf16 at tp 1; at tp 2
# query_key_value (180, 120) and dense (120, 60) are kept in bf16 and the MLP's slices padded.
PADDED = dict(hidden_size=120, num_attention_heads=4)
RESUMED = dict(train_iters=6)


def _checkpoint_runs(d, data):
    ck = lambda name, it: d / f"{name}_ck" / f"iter_{it:07d}"  # noqa: E731
    first = [("fp8", _config(d, "fp8", data, model=PADDED, save=True, train_iters=6))]
    then = [("bf16_same", _config(d, "bf16_same", data, model=PADDED, load=ck("fp8", 4), save=True, precision="bf16",
                                  **RESUMED)),
            ("bf16_tp2", _config(d, "bf16_tp2", data, model=PADDED, tp=2, load=ck("fp8", 4), precision="bf16",
                                 **RESUMED))]
    back = [("bf16_cont", _config(d, "bf16_cont", data, model=PADDED, load=ck("bf16_same", 6), precision="bf16",
                                  train_iters=7)),
            ("fp8_same", _config(d, "fp8_same", data, model=PADDED, load=ck("bf16_same", 6), train_iters=7)),
            ("fp8_tp2", _config(d, "fp8_tp2", data, model=PADDED, tp=2, load=ck("bf16_same", 6), train_iters=7))]
    return first + then + back


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8_resume")
    data = write_learnable_corpus(d / "count_text_document")
    return d, run_distributed(run_mains, 2, (_checkpoint_runs(d, data),), timeout=900)[0]


def test_every_resume_run_exits_zero(resumed):
    _, out = resumed
    for name, (rc, text) in out.items():
        assert rc == 0, (name, text[-3000:])
    for name in ("bf16_tp2", "fp8_tp2"):
        assert "reshaping checkpoint" in out[name][1] and "from (tp,pp,dp) (1, 1, 2) to (2, 1, 1)" in out[name][1]
    plan = next(line for line in out["fp8"][1].splitlines() if line.startswith("precision plan:"))
    assert "query_key_value 360x120 fp8 padded to 368x128" in plan and "dense 120x120 kept in bf16" in plan


def test_padded_and_bf16_kept_gemms_save_their_own_shapes(resumed):
    """The fp8 checkpoint's weights have the shapes a bf16 model of the same config has (padding is inside the
    layer), in bf16, and its optimizer files are BF16_Optimizer's."""
    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import GPTModel

    d, _ = resumed
    folder = d / "fp8_ck" / "iter_0000004"
    states = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    config = GPTConfig(num_layers=2, seq_length=32, vocab_size=VOCAB, **PADDED)
    want = {k: v.shape for k, v in GPTModel(config, device="meta").state_dict().items()}
    assert {k: v.shape for k, v in states.items()} == want
    assert states["layers.0.query_key_value.weight"].shape == (360, 120)
    assert {v.dtype for v in states.values()} == {torch.bfloat16}
    assert sorted(os.listdir(folder)).count("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt") == 1


def test_fp8_checkpoint_resumes_in_bf16_at_the_same_and_another_shape(resumed):
    """bf16 runs resumed from the fp8 run's iteration 4 train iterations 5 and 6 on its weights: their losses are
    the fp8 run's own to float8 rounding (2%), far below a fresh model's."""
    d, _ = resumed
    fp8 = _losses(d, "fp8")
    assert fp8[5] < 0.9 * fp8[1]  # learnt enough that a fresh start would show (5x the 2% bound)
    for name in ("bf16_same", "bf16_tp2"):
        losses = _losses(d, name)
        assert sorted(losses) == [5, 6], name
        for it in (5, 6):
            assert losses[it] == pytest.approx(fp8[it], rel=0.02), (name, it)


def test_bf16_checkpoint_resumes_in_fp8_at_the_same_and_another_shape(resumed):
    """fp8 runs resumed from a bf16 checkpoint (iteration 6) at (1, 1, 2) and at (2, 1, 1) train iteration 7 with
    the loss the bf16 run continuing from it has, to float8 rounding."""
    d, _ = resumed
    cont = _losses(d, "bf16_cont")
    assert sorted(cont) == [7]
    for name in ("fp8_same", "fp8_tp2"):
        losses = _losses(d, name)
        assert sorted(losses) == [7], name
        assert losses[7] == pytest.approx(cont[7], rel=0.02) and losses[7] != cont[7], name
