"""Starting a run from existing weights: `checkpoint.init_from` (a Hugging Face GPT-2 directory, a gptpar checkpoint
saved at another topology) and weights-only gptpar checkpoints (tools/convert_checkpoint.py --to gptpar) given as
`checkpoint.load`. The references are Hugging Face's GPT2LMHeadModel on the same batch of synthetic samples.

One 4-rank spawn runs every training (gptpar.training.pretrain.main three times) to keep the suite fast; the checks that need
no process group (layout, read-back, errors) run in this process.
"""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from gptpar.testing import run_distributed
from gptpar.testing.runs import read_jsonl, run_mains, synthetic_sample, write_config

transformers = pytest.importorskip("transformers")

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 2, 32, 4, 16, 200  # gptpar.testing.runs.TINY's shape
GLOBAL_BATCH, SEED = 8, 1234
MODEL = dict(activation="gelu_tanh")  # HF GPT-2's gelu_new; everything else is TINY's (eps 1e-5, no dropout)
TP2_PP2 = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=1)


def _make_hf(path, vocab=VOCAB, hidden=HIDDEN):
    """A GPT2LMHeadModel with random weights from a local config (nothing downloaded). Initialised 10x wider
    than GPT-2's 0.02, so that its logits are far from uniform and every misplaced weight moves the loss (at
    0.02 any small-weight model scores about ln(vocab))."""
    torch.manual_seed(7)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=hidden, n_head=HEADS, n_positions=SEQ, vocab_size=vocab,
                                     activation_function="gelu_new", resid_pdrop=0.0, attn_pdrop=0.0,
                                     embd_pdrop=0.0, initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


def _hf_first_batch_loss(model_dir):
    """HF's mean loss over the run's first global batch (synthetic samples 0..7, shifted as gptpar shifts)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    text = torch.stack([synthetic_sample(SEED, i, VOCAB, SEQ) for i in range(GLOBAL_BATCH)])
    with torch.no_grad():
        logits = model(text[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), text[:, 1:].reshape(-1)).item()


# A BLOOM of TINY's shape (gptpar's ALiBi + embedding LayerNorm, HF's BloomForCausalLM).
BLOOM = dict(MODEL, position_embedding_type="alibi", embed_layernorm=True)
MEGATRON_PADDED_VOCAB = 256  # Megatron pads the vocabulary to a multiple of 128 (x tp)


def _make_hf_bloom(path):
    """A BloomForCausalLM with random weights from a local config, every tensor (biases, LayerNorms too) moved
    off HF's initial values so that each one changes the loss."""
    torch.manual_seed(11)
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                      layer_norm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0,
                                      initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    model = transformers.BloomForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


def _megatron_name(hf_name):
    """Megatron-DeepSpeed's GPTModelPipe name of a BloomForCausalLM tensor (None: the tied lm_head). HF's BLOOM
    keeps Megatron's names inside a layer; GPTModelPipe's specs put the tied embedding first (`tied_modules.
    embed`, its LayerNorm at `word_embeddings.norm`), transformer layer i at spec 3 + i (after a cast and a
    transpose) and the final LayerNorm, a bare LayerNorm, at spec L + 4."""
    name = hf_name[len("transformer."):]
    if name.startswith("h."):
        i, rest = name[2:].split(".", 1)
        return f"{int(i) + 3}.{rest}"
    return {"word_embeddings.weight": "tied_modules.embed.word_embeddings.weight",
            "word_embeddings_layernorm.weight": "tied_modules.embed.word_embeddings.norm.weight",
            "word_embeddings_layernorm.bias": "tied_modules.embed.word_embeddings.norm.bias",
            "ln_f.weight": f"{LAYERS + 4}.weight", "ln_f.bias": f"{LAYERS + 4}.bias"}.get(name)


def _write_megatron_universal(hf_dir, out):
    """The folder DeepSpeed's ds_to_universal.py writes for a Megatron-DeepSpeed BLOOM run with these weights:
    zero/{name}/{fp32,exp_avg,exp_avg_sq}.pt as {"param", "cat_dim" (tp-split ones), "vocab_tensor" (the word
    embedding, here padded with random rows to MEGATRON_PADDED_VOCAB)} and step.pt a bare tensor; beside them
    the pickles DeepSpeed copies (the mp_rank file with Megatron's args, zero/optimizer_state.pt)."""
    import argparse

    model = transformers.BloomForCausalLM.from_pretrained(hf_dir)
    column = ("query_key_value.weight", "query_key_value.bias", "dense_h_to_4h.weight", "dense_h_to_4h.bias")
    row = ("self_attention.dense.weight", "dense_4h_to_h.weight")
    torch.manual_seed(12)
    for hf_name, tensor in model.state_dict().items():
        name = _megatron_name(hf_name)
        if name is None:
            continue
        extra = {}
        if name.endswith(column) or name.endswith(row):
            extra["cat_dim"] = 1 if name.endswith(row) else 0
        if name.endswith("word_embeddings.weight"):
            tensor = torch.cat([tensor, torch.randn(MEGATRON_PADDED_VOCAB - VOCAB, HIDDEN)])
            extra.update(cat_dim=0, vocab_tensor=True)
        os.makedirs(out / "zero" / name)
        for key, value in (("fp32", tensor), ("exp_avg", 1e-3 * torch.randn_like(tensor)),
                           ("exp_avg_sq", 1e-6 * torch.rand_like(tensor))):
            torch.save(dict(extra, param=value.float()), out / "zero" / name / f"{key}.pt")
        torch.save(torch.tensor(5.0), out / "zero" / name / "step.pt")
    torch.save({"param_groups": [{"lr": 1e-4}], "args": argparse.Namespace(num_layers=LAYERS)},
               out / "zero" / "optimizer_state.pt")
    torch.save({"args": argparse.Namespace(num_layers=LAYERS), "iteration": 5}, out / "mp_rank_00_model_states.pt")
    return str(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """HF -> init_from at (tp 2, pp 2) for 2 iterations, saved; that checkpoint -> init_from at (2, 1, dp 2); HF's
    weights-only checkpoint written at (2, 2) -> checkpoint.load at (1, 2, dp 2); a Megatron-DeepSpeed BLOOM
    universal folder -> init_from at (2, 1, dp 2)."""
    from gptpar.tools import convert_checkpoint

    d = tmp_path_factory.mktemp("init_from")
    hf = _make_hf(d / "hf")
    assert convert_checkpoint.main(["--from-hf", hf, "--to", "gptpar", "--output", str(d / "w22"),
                                    "--tp", "2", "--pp", "2"]) == 0
    megatron = _write_megatron_universal(_make_hf_bloom(d / "hf_bloom"), d / "megatron_bloom")

    def config(name, iters, parallel, checkpoint, model=MODEL):
        return write_config(d / f"{name}.json", model=model, parallel=parallel, checkpoint=checkpoint,
                            training=dict(train_iters=iters, lr_warmup_iters=0),
                            logging=dict(metrics_file=str(d / f"{name}.jsonl")))

    configs = {
        "hf": config("hf", 2, TP2_PP2, dict(init_from=hf, save=str(d / "a"), load=str(d / "a"))),
        "other": config("other", 1, dict(tensor_model_parallel_size=2, data_parallel_size=2),
                        dict(init_from=str(d / "a"))),
        "weights": config("weights", 1, dict(pipeline_model_parallel_size=2, data_parallel_size=2),
                          dict(load=str(d / "w22"))),
        "megatron": config("megatron", 1, dict(tensor_model_parallel_size=2, data_parallel_size=2),
                           dict(init_from=megatron), model=BLOOM),
    }
    out = run_distributed(run_mains, 4, ([(name, ["--config", path]) for name, path in configs.items()],),
                          timeout=600)
    for name in configs:
        assert all(rank[name][0] == 0 for rank in out), out[0][name][1][-3000:]
    return d, hf, out[0]


def test_init_from_hugging_face_at_tp2_pp2_gives_hf_loss(runs):
    d, hf, out = runs
    first = read_jsonl(d / "hf.jsonl")[0]
    assert first["iteration"] == 1
    assert first["lm_loss"] == pytest.approx(_hf_first_batch_loss(hf), rel=1e-5, abs=0)
    assert f"starting from the weights of checkpoint.init_from {hf}" in out["hf"][1]


def test_init_from_a_megatron_deepspeed_bloom_universal_folder_at_tp2_gives_hf_loss(runs):
    d, _, out = runs
    first = read_jsonl(d / "megatron.jsonl")[0]
    assert first["iteration"] == 1
    assert first["lm_loss"] == pytest.approx(_hf_first_batch_loss(str(d / "hf_bloom")), rel=1e-5, abs=0)


def test_megatron_universal_folder_reads_with_unpickling_disabled(runs, monkeypatch):
    """read_weights maps every name, drops the padding rows and reads nothing but weights_only files (the
    pickles DeepSpeed copies beside them are never opened); the tensors are HF's."""
    from gptpar.checkpoint.huggingface import load_hf
    from gptpar.checkpoint.weights import read_weights

    d, _, _ = runs
    reference, config = load_hf(str(d / "hf_bloom"))
    real_load = torch.load

    def safe_only(*args, **kwargs):
        assert kwargs.get("weights_only") is True, "a universal folder's file was unpickled"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", safe_only)
    state, read_config = read_weights(str(d / "megatron_bloom"), config=config)
    assert read_config == config and sorted(state) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name


def test_convert_exports_a_megatron_universal_folder_given_the_run_config(runs, tmp_path, capsys):
    """convert_checkpoint reads the folder with the model of --config (it records none gptpar reads): exported to
    Hugging Face it holds the BLOOM tensors it was written from; without --config it is a clear error."""
    from gptpar.tools import convert_checkpoint

    from gptpar.checkpoint.huggingface import load_hf

    d, _, _ = runs
    out = tmp_path / "hf"
    assert convert_checkpoint.main(["--load", str(d / "megatron_bloom"), "--to", "hf", "--output", str(out)]) == 2
    assert "config" in capsys.readouterr().err
    assert convert_checkpoint.main(["--load", str(d / "megatron_bloom"), "--config", str(d / "megatron.json"),
                                    "--to", "hf", "--output", str(out)]) == 0
    (want, _), (got, _) = load_hf(str(d / "hf_bloom")), load_hf(str(out))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_megatron_universal_folder_errors_name_the_file(runs, tmp_path):
    """A parameter folder no model of the config has, a file holding a pickled object, and a model of another
    shape: clear errors before anything is built."""
    import argparse
    import shutil

    from gptpar.checkpoint.layout import CheckpointError

    d, _, _ = runs
    folder = tmp_path / "megatron_bloom"
    shutil.copytree(d / "megatron_bloom", folder)
    with pytest.raises(CheckpointError, match="model.num_layers = 4"):
        _check(tmp_path, init_from=str(folder), **dict(BLOOM, num_layers=4))
    with pytest.raises(CheckpointError, match=r"zero/tied_modules.embed.position_embeddings.weight \(read as "
                                              r"'embedding.position_embeddings.weight'\) is no parameter"):
        os.makedirs(folder / "zero" / "tied_modules.embed.position_embeddings.weight")
        _check(tmp_path, init_from=str(folder), **BLOOM)
    os.rmdir(folder / "zero" / "tied_modules.embed.position_embeddings.weight")
    fp32 = folder / "zero" / "3.mlp.dense_h_to_4h.bias" / "fp32.pt"
    torch.save({"param": torch.zeros(4 * HIDDEN), "shape": argparse.Namespace(rows=1)}, fp32)
    with pytest.raises(CheckpointError, match="fp32.pt holds objects other than tensors and plain values"):
        _check(tmp_path, init_from=str(folder), **BLOOM)
    torch.save({"param": torch.zeros(2 * HIDDEN)}, fp32)
    with pytest.raises(CheckpointError, match=r"fp32.pt has shape \[64\], the model \[128\]"):
        _check(tmp_path, init_from=str(folder), **BLOOM)


def test_init_from_a_checkpoint_of_another_topology(runs, tmp_path):
    """The (2, 2, 1) checkpoint after 2 iterations, started at (2, 1, 2): its first loss is the saved model's loss
    on batch 0, computed by HF on the checkpoint exported with the (independently tested) --to hf path."""
    from gptpar.tools import convert_checkpoint

    d, _, out = runs
    exported = str(tmp_path / "a_hf")
    assert convert_checkpoint.main(["--load", str(d / "a"), "--to", "hf", "--output", exported]) == 0
    first = read_jsonl(d / "other.jsonl")[0]
    assert first["iteration"] == 1 and first["consumed_samples"] == GLOBAL_BATCH  # a fresh start, not a resume
    assert first["lm_loss"] == pytest.approx(_hf_first_batch_loss(exported), rel=1e-5, abs=0)
    assert read_jsonl(d / "hf.jsonl")[-1]["lm_loss"] != pytest.approx(first["lm_loss"], rel=1e-3)  # it trained


def test_the_optimizer_started_from_the_loaded_weights(runs):
    """The fp32 master copy (ZeRO-1) must start from HF's weights, not from the model's own initialisation: after
    2 AdamW steps at lr <= 1e-3 (at steps 1-2 with betas 0.9/0.95 the bias-corrected |m/sqrt(v)| is <= 1.0004, so
    each step moves a weight by <= lr, plus a decay of lr x 0.01 x |w|) the saved weights are within 2.2e-3 of
    HF's. A master copy made before the load would have trained the seeded initialisation instead."""
    from gptpar.checkpoint.huggingface import load_hf
    from gptpar.checkpoint.weights import read_weights

    d, hf, _ = runs
    saved, _ = read_weights(str(d / "a"))
    reference, _ = load_hf(hf)
    drift = max((saved[name] - tensor).abs().max().item() for name, tensor in reference.items())
    assert 0 < drift < 2.2e-3


def test_weights_only_checkpoint_as_load_starts_at_iteration_0(runs):
    d, hf, out = runs
    first = read_jsonl(d / "weights.jsonl")[0]
    assert first["iteration"] == 1 and first["consumed_samples"] == GLOBAL_BATCH
    assert first["lm_loss"] == pytest.approx(_hf_first_batch_loss(hf), rel=1e-5, abs=0)
    lines = [line for line in out["weights"][1].splitlines() if "weights-only checkpoint" in line]
    assert lines == [f"checkpoint.load {d / 'w22'} is a weights-only checkpoint: starting from its weights at "
                     "iteration 0, a fresh optimizer, LR schedule and counters"]


def test_weights_only_checkpoint_layout_reads_back_hf_tensors(tmp_path):
    from gptpar.tools import convert_checkpoint

    from gptpar.checkpoint.huggingface import load_hf
    from gptpar.checkpoint.weights import read_weights
    from gptpar.checkpoint.layout import MANIFEST
    from gptpar.checkpoint.manifest import MARK

    hf = _make_hf(tmp_path / "hf")
    out = tmp_path / "w22"
    os.makedirs(out)  # an empty folder may be the output
    assert convert_checkpoint.main(["--from-hf", hf, "--to", "gptpar", "--output", str(out), "--tp", "2",
                                    "--pp", "2"]) == 0
    # DeepSpeed's names for 2 layers at pp > 1: embedding 0, layers 1-2, final LayerNorm 3; per tp rank
    expected = {f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(4) for t in range(2)}
    assert set(os.listdir(out)) == expected | {"config.json", MANIFEST}
    manifest = json.load(open(out / MANIFEST))
    assert manifest["kind"] == "weights-only" and sorted(manifest["files"]) == sorted(expected | {"config.json"})
    for name in expected:  # plain tensors (and gptpar's mark): no unpickling of arbitrary objects needed
        layer = torch.load(out / name, weights_only=True)
        assert layer.pop(MARK) is True and all(isinstance(t, torch.Tensor) for t in layer.values())
    state, config = read_weights(str(out))
    reference, ref_config = load_hf(hf)
    assert config == ref_config and sorted(state) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name
    # tp 2 halves of the fused QKV: rank 1 holds heads 2-3 of HF's c_attn (reordered per head)
    qkv = torch.load(out / "layer_01-model_01-model_states.pt", weights_only=True)["query_key_value.weight"]
    assert torch.equal(qkv, reference["layers.0.query_key_value.weight"][3 * HIDDEN // 2:])

    # resharded from that checkpoint to tp 1, pp 1: the same tensors again
    assert convert_checkpoint.main(["--load", str(out), "--to", "gptpar", "--output", str(tmp_path / "w11")]) == 0
    again, _ = read_weights(str(tmp_path / "w11"))
    assert all(torch.equal(again[name], tensor) for name, tensor in reference.items())


def test_convert_refuses_bad_layouts_and_existing_output(tmp_path, capsys):
    from gptpar.tools import convert_checkpoint

    hf = _make_hf(tmp_path / "hf")
    assert convert_checkpoint.main(["--from-hf", hf, "--to", "gptpar", "--output", str(tmp_path / "x"),
                                    "--tp", "3"]) == 2
    assert "model.num_attention_heads (4) must divide by" in capsys.readouterr().err
    assert convert_checkpoint.main(["--from-hf", hf, "--to", "gptpar", "--output", str(tmp_path / "x"),
                                    "--pp", "3"]) == 2
    assert "exceeds model.num_layers" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x") and [p for p in os.listdir(tmp_path) if "tmp" in p] == []
    # an output holding anything is never written into: one line, exit 2
    assert convert_checkpoint.main(["--from-hf", hf, "--to", "gptpar", "--output", str(tmp_path / "hf")]) == 2
    assert "exists: choose a new path" in capsys.readouterr().err


def _check(tmp_path, *, load=None, init_from=None, save=None, **model):
    """preflight's rank-0 decision for a (tp 2, pp 2) run: (load target, weights to start from, log lines)."""
    from gptpar.checkpoint.resume import shape_of
    from gptpar.config import load_config
    from gptpar.training.preflight import check_on_rank0

    path = write_config(tmp_path / "check.json", model={**MODEL, **model}, parallel=TP2_PP2,
                        checkpoint=dict(load=load, init_from=init_from, save=save))
    cfg = load_config(path)
    lines = []
    shape = shape_of(cfg.to_dict(), 2, 2, 1, cfg.model.padded_vocab_size(2), cfg.resolved_partition_method(2))
    target, init, _ = check_on_rank0(cfg, 4, 2, 2, shape, lines.append)
    return target, init, lines


def test_weights_of_another_shape_are_refused_naming_the_field(tmp_path):
    from gptpar.checkpoint.layout import CheckpointError

    hf = _make_hf(tmp_path / "hf", vocab=VOCAB + 10, hidden=64)
    with pytest.raises(CheckpointError) as e:
        _check(tmp_path, init_from=hf)
    assert "model.hidden_size: checkpoint.init_from" in str(e.value) and "has 64, the config 32" in str(e.value)
    assert "model.vocab_size: checkpoint.init_from" in str(e.value) and "has 210 tokens" in str(e.value)
    with pytest.raises(CheckpointError, match="model.num_layers: checkpoint.init_from"):
        _check(tmp_path, init_from=hf, num_layers=4, hidden_size=64, vocab_size=VOCAB + 10)
    with pytest.raises(CheckpointError, match="checkpoint.init_from .*/nowhere does not exist"):
        _check(tmp_path, init_from=str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "junk")
    with pytest.raises(CheckpointError, match="junk cannot be read as model weights: .* holds no checkpoint .*is empty"):
        _check(tmp_path, init_from=str(tmp_path / "junk"))
    # a smaller vocabulary fits (the rows it lacks start at zero)
    assert _check(tmp_path, init_from=hf, hidden_size=64, vocab_size=VOCAB + 100)[1] == hf


def test_a_checkpoint_to_resume_wins_over_init_from(runs, tmp_path):
    from gptpar.checkpoint.layout import CheckpointError

    d, hf, _ = runs
    target, init, lines = _check(tmp_path, load=str(d / "a"), init_from=hf)
    assert target.path == str(d / "a" / "iter_0000002") and init is None
    assert lines == [f"checkpoint.init_from {hf} ignored: resuming {target.path} (checkpoint.load holds a checkpoint, "
                     "and a resume wins)"]
    with pytest.raises(CheckpointError, match="model.hidden_size: checkpoint.load"):  # weights-only: shape checked too
        _check(tmp_path, load=str(d / "w22"), hidden_size=64)
    with pytest.raises(CheckpointError, match=f"already holds checkpoint iter_0000002 of an earlier run, and "
                                              f"checkpoint.load {d / 'w22'} resumes nothing"):
        _check(tmp_path, load=str(d / "w22"), save=str(d / "a"))  # starting from weights never saves over a run
