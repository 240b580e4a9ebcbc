"""tools/generate.py and gptpar.model.generation against references: Hugging Face's own greedy `generate` on a
random local model (tp = 1 and tp = 2), the model's full forward (the KV-cache path), Hugging Face's top-k / top-p
warpers, exp(mean token loss) computed by the Hugging Face model (--eval-file), and a plain greedy loop over a
serial GPTModel for a checkpoint trained here at pp = 2 on data tokenized by a Hugging Face tokenizer directory.

One 2-rank spawn runs everything distributed (the training, then generate.py at tp = 2); tp = 1 runs in-process.
"""
import contextlib
import io
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from gptpar.model.config import GPTConfig
from gptpar.testing import run_distributed
from gptpar.testing.tiny_tokenizer import source_texts, train_hf_tokenizer
from gptpar.testing.runs import environ_kept, run_mains, write_config

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 42]
NEW = 32
SAMPLING = ["--temperature", "0.9", "--top-k", "50", "--top-p", "0.9"]
# Random Hugging Face models from local configs, each run through every generate.py case below. initializer_range
# 0.3: with the default 0.02 greedy decoding of a random model repeats one token, which would let a broken cache
# pass. BLOOM (ALiBi + embedding LayerNorm) checks the cache against ALiBi's query/key offsets; a random BLOOM
# repeats one token sooner, hence its third layer and larger init (17 distinct ids of 32 here).
HF_MODELS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                                   initializer_range=0.3)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=32, n_layer=3, n_head=4, initializer_range=0.8)),
}


def _hf_dir(root, name, tokdir):
    """A Hugging Face model directory (random weights, the tokenizer's vocab) holding the tokenizer too."""
    model_cls, config_cls, kw = HF_MODELS[name]
    vocab = len(transformers.PreTrainedTokenizerFast.from_pretrained(tokdir))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(vocab_size=vocab, **kw))
    out = os.path.join(root, name)
    model.save_pretrained(out)
    transformers.PreTrainedTokenizerFast.from_pretrained(tokdir).save_pretrained(out)
    return out


def _eval_docs():
    """Two short documents and one of a few hundred tokens (several windows of GPT-2's 64 positions)."""
    return ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())", source_texts()[0][:600]]


def _generate_argvs(hf_dirs, eval_file, tp):
    """(name, argv) of every case to run at this tp, for each Hugging Face model: names are "{model}:{case}"."""
    argvs = []
    for model, hf_dir in hf_dirs.items():
        base = ["--load", hf_dir, "--tp", str(tp), "--max-new-tokens", str(NEW), "--print-ids",
                "--prompt-ids", ",".join(map(str, PROMPT))]
        cases = [("greedy", ["--greedy"]), ("greedy_no_cache", ["--greedy", "--no-cache"]),
                 ("sample_7", SAMPLING + ["--seed", "7"])]
        if tp == 1:  # what needs no second tp size
            cases += [("sample_7_no_cache", SAMPLING + ["--seed", "7", "--no-cache"]),
                      ("sample_8", SAMPLING + ["--seed", "8"]),
                      ("top_1", ["--top-k", "1", "--temperature", "5"])]  # one candidate: greedy at any temperature
        argvs += [(f"{model}:{case}", base + extra) for case, extra in cases]
        argvs.append((f"{model}:eval", ["--load", hf_dir, "--tp", str(tp), "--eval-file", eval_file]))
    return argvs


def run_generate(runs):
    """generate.main(argv) for each (name, argv) on this rank: {name: (exit code, stdout)}."""
    from gptpar.tools import generate

    out = {}
    for name, argv in runs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), environ_kept():
            rc = generate.main(argv)
        out[name] = (rc, buf.getvalue())
    return out


def _on_two_ranks(train_runs, generate_runs):
    """Train (gptpar.training.pretrain.main), then generate at tp = 2, in the same two ranks."""
    return run_mains(train_runs), run_generate(generate_runs)


def _train_sections(d, tokdir):
    """pp = 2 training on a corpus preprocessed with the Hugging Face tokenizer directory, with the EOD-based masks
    (the EOD id comes from the directory's declared eos_token)."""
    from gptpar.data.preprocess import preprocess

    with open(d / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in source_texts())
    preprocess(str(d / "corpus.jsonl"), ["text"], tokdir, str(d / "corpus"), append_eod=True, progress=False)
    vocab = len(transformers.PreTrainedTokenizerFast.from_pretrained(tokdir))
    return dict(model=dict(vocab_size=vocab, init_method_std=0.3),
                parallel=dict(pipeline_model_parallel_size=2, data_parallel_size=1),
                training=dict(train_iters=2, lr_warmup_iters=1, lr=1e-4),
                data=dict(synthetic=False, data_path=str(d / "corpus_text_document"), split="90,10,0",
                          tokenizer_model=tokdir, reset_attention_mask=True, eod_mask_loss=True),
                checkpoint=dict(save=str(d / "ck")), logging=dict(metrics_file=str(d / "m.jsonl")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("generate")
    tokdir = train_hf_tokenizer(d / "tok")
    hf_dirs = {name: _hf_dir(str(d), name, tokdir) for name in HF_MODELS}
    with open(d / "eval.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in _eval_docs())
    cfg = write_config(d / "train.json", **_train_sections(d, tokdir))
    trained = ["--load", str(d / "ck"), "--prompt", "def main(", "--max-new-tokens", "8", "--greedy", "--print-ids"]
    # First the run the trainer refuses (before it touches checkpoint.save), then the one that trains.
    train_runs = [("train_small_vocab", ["--config", cfg, "--set", "model.vocab_size=299"]),
                  ("train", ["--config", cfg])]
    generate_runs = _generate_argvs(hf_dirs, str(d / "eval.jsonl"), 2) + [("trained", trained + ["--tp", "2"])]
    (train, tp2), _ = run_distributed(_on_two_ranks, 2, args=(train_runs, generate_runs), timeout=400)
    tp1 = run_generate(_generate_argvs(hf_dirs, str(d / "eval.jsonl"), 1) + [("trained", trained)])
    return dict(dir=d, tokdir=tokdir, hf_dirs=hf_dirs, train=train, tp1=tp1, tp2=tp2)


def _ids(result):
    rc, stdout = result
    assert rc == 0, stdout
    lines = [line for line in stdout.splitlines() if line.startswith("ids: ")]
    assert len(lines) == 1 and " " not in lines[0][len("ids: "):], stdout
    return [int(i) for i in lines[0][len("ids: "):].split(",")]


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.parametrize("model_name", HF_MODELS)
def test_greedy_equals_hugging_face_generate(runs, model_name, tp):
    model = transformers.AutoModelForCausalLM.from_pretrained(runs["hf_dirs"][model_name]).eval()
    model.generation_config.eos_token_id = None  # 32 tokens whatever is drawn, as generate.py does
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    expected = out[0, len(PROMPT):].tolist()
    assert len(set(expected)) > 4  # a random model that repeats one token would test little
    ours = runs[tp]
    assert _ids(ours[f"{model_name}:greedy"]) == _ids(ours[f"{model_name}:greedy_no_cache"]) == expected


@pytest.mark.parametrize("model_name", HF_MODELS)
def test_sampling_is_seeded_and_the_same_at_tp2(runs, model_name):
    tp1, tp2 = ({case.split(":")[1]: out for case, out in runs[tp].items() if case.startswith(model_name + ":")}
                for tp in ("tp1", "tp2"))
    seven = _ids(tp1["sample_7"])
    assert len(seven) == NEW
    assert seven == _ids(tp1["sample_7_no_cache"]) == _ids(tp2["sample_7"])
    assert _ids(tp1["sample_8"]) != seven
    assert _ids(tp1["top_1"]) == _ids(tp1["greedy"]) != seven


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.parametrize("model_name", HF_MODELS)
def test_eval_file_perplexity_equals_hugging_face(runs, model_name, tp):
    from gptpar.checkpoint.weights import read_weights

    hf_dir = runs["hf_dirs"][model_name]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(runs["tokdir"])
    window = read_weights(hf_dir)[1].seq_length  # generate.py's documented window: model.seq_length
    losses = []
    with torch.no_grad():
        for text in _eval_docs():
            ids = tok.encode(text)
            for start in range(0, len(ids) - 1, window):
                chunk = torch.tensor([ids[start:start + window + 1]])
                logits = model(chunk[:, :-1]).logits[0]
                losses.append(F.cross_entropy(logits, chunk[0, 1:], reduction="none"))
    losses = torch.cat(losses)
    rc, stdout = runs[tp][f"{model_name}:eval"]
    assert rc == 0, stdout
    line = stdout.strip().splitlines()[-1]
    assert line.startswith("eval: ") and f" 3 documents, {losses.numel()} tokens, " in line, line
    ppl = float(line.rsplit("perplexity ", 1)[1])
    assert_close(ppl, math.exp(losses.mean().item()), rtol=1e-5, atol=0)


def test_trained_checkpoint_generates_from_its_tokenizer_at_another_tp(runs):
    """Trained at pp = 2 (tp = 1) on Hugging Face-tokenized data; generate.py at tp = 1 and tp = 2 (pp = 1) reads it
    through read_weights, encodes the prompt and decodes with the run's data.tokenizer_model."""
    from gptpar.data.tokenizer import load_tokenizer
    from gptpar.checkpoint.weights import read_weights
    from gptpar.model.gpt import GPTModel
    from gptpar.model.sharding import load_full_state_dict

    assert runs["train"]["train"][0] == 0, runs["train"]["train"][1]
    rc, out = runs["train"]["train_small_vocab"]
    assert rc == 2 and f"data.tokenizer_model {runs['tokdir']} has 300 pieces but model.vocab_size is 299" in out
    state, config = read_weights(str(runs["dir"] / "ck"))
    model = GPTModel(config).eval()
    load_full_state_dict(model, state)
    tok = load_tokenizer(runs["tokdir"])
    ids = tok.encode("def main(")
    with torch.no_grad():  # a plain greedy loop over the full forward
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0, -1, :config.vocab_size].argmax()))
    expected = ids[len(tok.encode("def main(")):]
    for tp in ("tp1", "tp2"):
        assert _ids(runs[tp]["trained"]) == expected
        assert runs[tp]["trained"][1].splitlines()[0] == tok.decode(ids).splitlines()[0]


def test_kv_cache_logits_equal_the_full_forward():
    """Any split of a sequence into cached steps gives the logits of one full forward, position by position."""
    from gptpar.model.gpt import GPTModel, KVCache, forward_with_cache

    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=100,
                               init_method_std=0.3), seed=5).eval()
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
    cache, pieces, start = KVCache(2, 16), [], 0
    for size in (4, 1, 2, 1, 3):
        pieces.append(forward_with_cache(model, ids[:, start:start + size], cache))
        start += size
    assert cache.length == 11
    assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="KVCache holds 16 tokens; 17 were asked for"):
        forward_with_cache(model, torch.zeros(1, 6, dtype=torch.long), cache)


def test_top_k_top_p_filter_as_hugging_face_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from gptpar.model.generation import filter_logits

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 3
    for top_k, top_p in ((5, 1.0), (0, 0.8), (10, 0.5), (0, 0.05)):
        expected = logits
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        assert torch.equal(filter_logits(logits, top_k, top_p).isinf(), expected.isinf()), (top_k, top_p)


def test_bad_arguments_exit_2_before_reading_weights(runs, capsys):
    from gptpar.tools import generate

    hf = runs["hf_dirs"]["gpt2"]
    cases = [(["--prompt-ids", "5,x"], "--prompt-ids '5,x': give integers separated by commas"),
             (["--prompt-ids", "5", "--pp", "2"], "--pp 2: generation runs at pp = 1"),
             (["--prompt-ids", "5", "--temperature", "0"], "--temperature must be > 0"),
             (["--prompt-ids", "5", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
             (["--prompt-ids", "5", "--tp", "2"], "--tp 2 needs 2 ranks, this run has 1"),
             (["--prompt-ids", "5,300"], "prompt ids [300] are outside the model's vocabulary [0, 300)"),
             (["--prompt-ids", "5", "--max-new-tokens", "64"], "exceed the model's model.max_position_embeddings (64)"),
             (["--prompt", "x", "--tokenizer", str(runs["dir"] / "nowhere")], "tokenizer not found"),
             (["--eval-file", str(runs["dir"] / "short.jsonl")], "no document has 2 tokens or more")]
    with open(runs["dir"] / "short.jsonl", "w") as f:
        f.write(json.dumps({"text": ""}) + "\n")
    for argv, message in cases:
        with environ_kept():
            assert generate.main(["--load", hf] + argv) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_a_missing_eval_file_is_named_before_the_checkpoint_is_read(tmp_path, capsys):
    """--eval-file that is not there, or a folder, is named first (a checkpoint without a tokenizer made the
    tokenizer the complaint)."""
    from gptpar.tools import generate

    for path, what in ((tmp_path / "missing.jsonl", "not found"), (tmp_path, "is a folder")):
        with environ_kept():
            assert generate.main(["--load", str(tmp_path / "no_checkpoint"), "--eval-file", str(path)]) == 2
        err = capsys.readouterr().err
        assert err == f"generate.py: error: --eval-file {path} {what}: pass a jsonl file of documents\n"


def test_generation_stops_after_the_stop_id():
    from gptpar.model.gpt import GPTModel
    from gptpar.model.generation import Sampling, generate

    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=100,
                               init_method_std=0.3), seed=5)
    greedy = Sampling(greedy=True)
    free = generate(model, PROMPT, 20, greedy)
    stop = free[6]
    assert generate(model, PROMPT, 20, greedy, stop_id=stop) == free[:free.index(stop) + 1]


@pytest.mark.parametrize("position_embedding_type", ["learned", "alibi"])
def test_batch_generation_equals_each_prompt_alone(position_embedding_type):
    """Prompts of different lengths generated together (left-padded, one forward per step, with and without the
    KV cache) give each prompt's own greedy continuation; a row stops at the stop id or when `stop` says so,
    while the others go on."""
    from gptpar.model.gpt import GPTModel
    from gptpar.model.generation import Sampling, generate, generate_batch

    alibi = position_embedding_type == "alibi"
    # A random ALiBi model repeats one token sooner: its larger init keeps the continuations varied.
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=100,
                               init_method_std=0.8 if alibi else 0.3,
                               position_embedding_type=position_embedding_type, embed_layernorm=alibi), seed=5)
    greedy = Sampling(greedy=True)
    prompts = [[5, 17, 42, 7, 9, 11], [3], [8, 8, 1]]
    alone = [generate(model, p, 12, greedy) for p in prompts]
    assert len({tuple(a) for a in alone}) == 3 and all(len(set(a)) > 1 for a in alone)
    for use_cache in (True, False):
        assert generate_batch(model, prompts, 12, greedy, use_cache=use_cache) == alone
    stop_id = alone[0][3]
    stopped = generate_batch(model, prompts, 12, greedy, stop_id=stop_id, stop=lambda i, new: i == 2 and len(new) == 5)
    expected = [a[:a.index(stop_id) + 1] if stop_id in a else a for a in alone]
    expected[2] = expected[2][:5]
    assert stopped == expected
