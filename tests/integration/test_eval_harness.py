"""tools/eval_harness.py against the harness's own Hugging Face model (lm_eval.models.huggingface.HFLM) on the same
weights: a random GPT2LMHeadModel and a random BloomForCausalLM imported with `convert_checkpoint.py --from-hf` (laid
out at tp 2 x pp 2, read at the eval's tp), and a tiny model trained here at pp 2 and exported with `--to hf`. Three
local tasks, one per request type (multiple choice, rolling perplexity, generation; jsonl files written here), run
through the tool at tp 1 and tp 2 and through HFLM at batch size 1: every document's log-likelihoods equal to 1e-4
relative, the generated text and every metric equal. The batched path equals batch size 1, identical requests get
bit-identical scores, and a --limit few-shot run equals HFLM's with the same seed.

One 2-rank spawn trains and runs the tp = 2 evaluations; tp = 1 and HFLM run in the test process. Nothing is
downloaded: the tokenizer is trained here (gptpar.testing.tiny_tokenizer), the models are random or trained here.
"""
import contextlib
import io
import json
import math
import os

import pytest
import torch
from torch.testing import assert_close

from gptpar.testing import run_distributed
from gptpar.testing.tiny_tokenizer import source_texts, train_hf_tokenizer
from gptpar.testing.runs import ROOT, environ_kept, run_mains, write_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

TASKS = "t_mc,t_ppl,t_gen"
BATCH = 3  # divides no task's request count: batches mix lengths and documents
BLOOM_MAX_LENGTH = 48  # the BLOOM tokenizer's model_max_length: HFLM's window for a model without positions
BLOOM_SEQ_LENGTH = 32  # the BLOOM config's seq_length, which the import takes for model.max_position_embeddings
LONG_PROMPT = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n   "  # past 32 tokens with 6 new, within 48
GEN_TOKENS = 6  # t_gen's max_gen_toks
# Random models from local configs. initializer_range well above the default 0.02 so that scores and greedy
# continuations differ from document to document (a model that says the same everywhere would test little).
HF_MODELS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                                   initializer_range=0.3)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=32, n_layer=2, n_head=4, initializer_range=0.5,
                                                      seq_length=BLOOM_SEQ_LENGTH)),
}
MODELS = ("gpt2", "bloom", "trained")


def _mc_docs():
    """Multiple choice: a Python line to complete. Document 2 repeats document 0 and every document offers one
    answer twice (choices 0 and 3): identical requests, whose tie acc must break as HFLM breaks it."""
    stems = ["def area(r):\n    return", "for i in range(10):\n   ", "import os\npath = os.path.join(",
             "class Point:\n    def __init__(self, x, y):\n        self.x =", "if x is None:\n    x =",
             "with open(path) as f:\n    lines = f.", "print(", "result = [n * n for n in"]
    answers = [[" 3.14 * r * r", " r", " None", " 3.14 * r * r"], [" print(i)", " pass", " i += 1", " print(i)"],
               [" root, name)", " 1, 2)", "'a')", " root, name)"], [" x", " y", " 0", " x"],
               [" 0", " []", " x", " 0"], ["readlines()", "close()", "read()", "readlines()"],
               ["x)", "'hello')", ")", "x)"], [" range(5)]", " n]", " []]", " range(5)]"]]
    docs = [{"question": q, "choices": a, "label": i % 3} for i, (q, a) in enumerate(zip(stems, answers))]
    docs.insert(2, dict(docs[0]))
    return docs


def _ppl_docs():
    """Rolling perplexity: short and long documents (several windows of every model's max length)."""
    text = source_texts()[1]
    return [{"text": t} for t in ("x = 1\n", "import os\nprint(os.getcwd())\n", text[:400], text[400:1400],
                                  "def f():\n    return 2\n")]


def _gen_docs():
    """Short prompts, and one longer than an ALiBi model's max_position_embeddings leaves room for (BLOOM's: its
    window is the tokenizer's; the trained model's 16 positions cut it from the left, as HFLM does)."""
    return [{"question": q, "answer": a} for q, a in (("x = 1\ny =", " 2"), ("def f(a):\n   ", " return a"),
                                                      ("import", " os"), ("# a comment\nfor", " i"),
                                                      (LONG_PROMPT, " return a * b"))]


def _write_tasks(d):
    """The three task YAMLs under d/tasks, reading jsonl files under d (absolute paths; the datasets cache in d)."""
    for name, docs in (("mc", _mc_docs()), ("mc_train", _mc_docs()[3:]), ("ppl", _ppl_docs()), ("gen", _gen_docs())):
        with open(d / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in docs)
    data = "dataset_path: json\ndataset_kwargs:\n  cache_dir: {d}/hf_datasets\n  data_files:\n".format(d=d)
    tasks = {
        "mc": f"""task: t_mc
{data}    train: {d}/mc_train.jsonl
    test: {d}/mc.jsonl
training_split: train
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
fewshot_delimiter: "\\n\\n"
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
""",
        "ppl": f"""task: t_ppl
{data}    test: {d}/ppl.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - {{metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}}
""",
        "gen": f"""task: t_gen
{data}    test: {d}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
""",
    }
    os.makedirs(d / "tasks", exist_ok=True)
    for name, text in tasks.items():
        with open(d / "tasks" / f"{name}.yaml", "w") as f:
            f.write(text)
    return str(d / "tasks")


def _hf_dir(d, name, tokdir):
    """A random Hugging Face model directory holding the tokenizer too; generation ends at the tokenizer's eos, as
    the tool's does. The BLOOM tokenizer declares model_max_length, the window HFLM takes for a model without
    positions."""
    model_cls, config_cls, kw = HF_MODELS[name]
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(tokdir)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(
        vocab_size=len(tok), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **kw))
    out = str(d / name)
    model.save_pretrained(out)
    if name == "bloom":
        tok.model_max_length = BLOOM_MAX_LENGTH
    tok.save_pretrained(out)
    return out


def _convert(argv):
    from gptpar.tools import convert_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        assert convert_checkpoint.main(argv) == 0, argv


def _train_config(d, tokdir):
    """pp = 2 training on a corpus preprocessed with the Hugging Face tokenizer (the run names it as its
    data.tokenizer_model, which the tool then reads)."""
    from gptpar.data.preprocess import preprocess

    with open(d / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in source_texts())
    preprocess(str(d / "corpus.jsonl"), ["text"], tokdir, str(d / "corpus"), append_eod=True, progress=False)
    vocab = len(transformers.PreTrainedTokenizerFast.from_pretrained(tokdir))
    return write_config(d / "train.json", model=dict(vocab_size=vocab, init_method_std=0.3),
                        parallel=dict(pipeline_model_parallel_size=2, data_parallel_size=1),
                        training=dict(train_iters=2, lr_warmup_iters=1, lr=1e-3),
                        data=dict(synthetic=False, data_path=str(d / "corpus_text_document"), split="90,10,0",
                                  tokenizer_model=tokdir),
                        checkpoint=dict(save=str(d / "ck")), logging=dict(metrics_file=str(d / "m.jsonl")))


def run_evals(runs):
    """eval_harness.main(argv) for each (name, argv) on this rank: {name: (exit code, stdout + stderr)}."""
    from gptpar.tools import eval_harness

    out = {}
    for name, argv in runs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), environ_kept():
            rc = eval_harness.main(argv)
        out[name] = (rc, buf.getvalue())
    return out


@contextlib.contextmanager
def no_env_report():
    """Without the harness's environment report in its results (torch's collect_env, a `pip list` per
    evaluation): the tests' runs take seconds each, and compare no part of it."""
    import lm_eval.evaluator

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
        yield


def _on_two_ranks(train_runs, eval_runs, failing_argv):
    """Train (gptpar.training.pretrain.main), then evaluate at tp = 2, in the same two ranks; last, one evaluation whose rank 0
    fails right after its model server is built (`_failing_on_rank_0`)."""
    with no_env_report():
        return run_mains(train_runs), run_evals(eval_runs), _failing_on_rank_0(failing_argv)


def _failing_on_rank_0(argv):
    """eval_harness.main(argv) with an error injected on rank 0 where it builds the harness's model, after the
    other ranks started serving: ("raised", its message) on rank 0, (exit code, output) on the other ranks, which
    must have been released (a rank left serving would wait for the process group's 30-minute timeout)."""
    import torch.distributed as dist

    from gptpar.tools import eval_harness

    def fail(*args, **kwargs):
        raise RuntimeError("injected on rank 0")

    with pytest.MonkeyPatch.context() as patch:
        if dist.get_rank() == 0:
            patch.setattr(eval_harness, "harness_model", fail)
        try:
            return run_evals([("failing", argv)])["failing"]
        except RuntimeError as e:
            return ("raised", str(e))


def _eval_argv(sources, model, tp, batch, out, *extra):
    load, tokenizer = sources[model]
    return (["--load", load, "--tasks", TASKS, "--include-path", sources["tasks"], "--tp", str(tp),
             "--batch-size", str(batch), "--bootstrap-iters", "0", "--log-samples", "--output", out]
            + (["--tokenizer", tokenizer] if tokenizer else []) + list(extra))


FEWSHOT = ["--limit", "4", "--num-fewshot", "2"]


def hflm_results(hf_dir, tasks_dir, **kwargs):
    """HFLM's simple_evaluate on the Hugging Face directory (batch size 1, CPU), with the tool's defaults."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(hf_dir)
    model.generation_config.eos_token_id = tok.eos_token_id  # the exported model's config says 0
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")
    manager = TaskManager(include_path=tasks_dir, include_defaults=False)
    with contextlib.redirect_stderr(io.StringIO()):
        return simple_evaluate(model=lm, tasks=TASKS.split(","), task_manager=manager, bootstrap_iters=0,
                               log_samples=True, **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval_harness")
    tokdir = train_hf_tokenizer(d / "tok")
    tasks = _write_tasks(d)
    hf = {name: _hf_dir(d, name, tokdir) for name in HF_MODELS}
    for name in HF_MODELS:  # imported laid out at tp 2 x pp 2: the tool reads them at its own tp
        _convert(["--from-hf", hf[name], "--to", "gptpar", "--output", str(d / f"{name}_tp2pp2"), "--tp", "2",
                  "--pp", "2"])
    # The gptpar checkpoints name no tokenizer: each evaluation is given the one HFLM reads.
    sources = {"gpt2": (str(d / "gpt2_tp2pp2"), hf["gpt2"]), "bloom": (str(d / "bloom_tp2pp2"), hf["bloom"]),
               "trained": (str(d / "ck"), None), "tasks": tasks}
    out = {tp: {m: str(d / f"{m}_tp{tp}.json") for m in MODELS} for tp in (1, 2)}
    train_runs = [("train", ["--config", _train_config(d, tokdir)])]
    tp2_runs = [(m, _eval_argv(sources, m, 2, BATCH, out[2][m])) for m in MODELS]
    failing = ["--load", sources["gpt2"][0], "--tokenizer", sources["gpt2"][1], "--tasks", "t_mc", "--include-path",
               tasks, "--tp", "2", "--limit", "1"]
    (trained, tp2, failed0), (_, _, failed1) = run_distributed(_on_two_ranks, 2, args=(train_runs, tp2_runs, failing),
                                                               timeout=600)
    assert trained["train"][0] == 0, trained["train"][1]
    hf["trained"] = str(d / "trained_hf")
    _convert(["--load", str(d / "ck"), "--to", "hf", "--output", hf["trained"]])
    transformers.PreTrainedTokenizerFast.from_pretrained(tokdir).save_pretrained(hf["trained"])

    bs1 = {m: str(d / f"{m}_bs1.json") for m in ("gpt2", "bloom")}
    fewshot = str(d / "gpt2_fewshot.json")
    tp1_runs = ([(m, _eval_argv(sources, m, 1, BATCH, out[1][m])) for m in MODELS]
                + [(f"{m}_bs1", _eval_argv(sources, m, 1, 1, bs1[m])) for m in bs1]
                + [("fewshot", _eval_argv(sources, "gpt2", 1, BATCH, fewshot, *FEWSHOT))])
    with no_env_report():
        tp1 = run_evals(tp1_runs)
        reference = {m: hflm_results(hf[m], tasks) for m in MODELS}
        reference["fewshot"] = hflm_results(hf["gpt2"], tasks, limit=4, num_fewshot=2)
    for name, (rc, text) in list(tp1.items()) + list(tp2.items()):
        assert rc == 0, f"{name}:\n{text}"

    def read(path):
        with open(path) as f:
            return json.load(f)

    return dict(dir=d, hf=hf, tp1=tp1, tp2=tp2, failed=(failed0, failed1), reference=reference,
                ours={tp: {m: read(out[tp][m]) for m in MODELS} for tp in (1, 2)},
                bs1={m: read(p) for m, p in bs1.items()}, fewshot=read(fewshot))


def _by_doc(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def _scores(sample):
    """A document's (log-likelihood, is_greedy) per request; a rolling document's log-likelihood as (ll, None)."""
    return [(r[0][0], r[0][1]) if isinstance(r[0], (list, tuple)) else (r[0], None) for r in sample["resps"]]


def assert_same_documents(ours, reference, rtol):
    """Every document: the same requests, log-likelihoods within rtol, the same greedy flags and generated text,
    the same per-document metrics; and every aggregated metric equal (perplexities within rtol)."""
    for task in TASKS.split(","):
        mine, theirs = _by_doc(ours, task), _by_doc(reference, task)
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in theirs] and mine, task
        for a, b in zip(mine, theirs):
            assert [list(x) for x in a["arguments"]] == [json.loads(json.dumps(list(x))) for x in b["arguments"]]
            if task == "t_gen":
                assert a["resps"] == b["resps"], (task, a["doc_id"])
            else:
                sa, sb = _scores(a), _scores(b)
                assert_close(torch.tensor([s[0] for s in sa], dtype=torch.float64),
                             torch.tensor([s[0] for s in sb], dtype=torch.float64), rtol=rtol, atol=0)
                assert [s[1] for s in sa] == [s[1] for s in sb], (task, a["doc_id"])
            for metric in a["metrics"]:
                if task == "t_ppl":  # (log-likelihood, words or bytes) per document
                    assert_close(a[metric][0], b[metric][0], rtol=rtol, atol=0)
                    assert a[metric][1] == b[metric][1]
                else:
                    assert a[metric] == b[metric], (task, a["doc_id"], metric)
        for key, value in reference["results"][task].items():
            if key.endswith(",none") and "stderr" not in key:
                if task == "t_ppl":
                    assert_close(ours["results"][task][key], value, rtol=rtol, atol=0)
                else:
                    assert ours["results"][task][key] == value, (task, key)
    assert ours["n-shot"] == reference["n-shot"]
    assert set(ours["configs"]) == set(reference["configs"]) and set(ours["versions"]) == set(reference["versions"])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", MODELS)
def test_every_document_equals_hflm(runs, model, tp):
    ours, reference = runs["ours"][tp][model], runs["reference"][model]
    assert_same_documents(ours, reference, rtol=1e-4)
    # The random models are not degenerate: scores differ between answers, and some text stops at "\n".
    lls = [s[0] for doc in _by_doc(reference, "t_mc") for s in _scores(doc)]
    assert len(set(lls)) > len(lls) // 2
    assert len({r[0][0] for r in (s["resps"] for s in _by_doc(reference, "t_gen"))}) > 1


def test_rolling_windows_are_hflms(runs):
    """The long documents span several windows: of 64 positions for GPT-2, of the BLOOM tokenizer's
    model_max_length 48 for BLOOM, of 16 positions for the trained model (its seq_length)."""
    ours = runs["ours"][1]
    assert [ours[m]["gptpar"]["max_length"] for m in MODELS] == [64, BLOOM_MAX_LENGTH, 16]
    from gptpar.data.tokenizer import load_tokenizer

    longest = max(len(load_tokenizer(runs["hf"]["gpt2"]).encode(d["text"])) for d in _ppl_docs())
    assert longest > 2 * 64


def test_batched_path_equals_batch_size_1(runs):
    for model, bs1 in runs["bs1"].items():
        assert_same_documents(runs["ours"][1][model], bs1, rtol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_identical_requests_score_bit_identically(runs, tp):
    """Document 2 repeats document 0 and choice 3 repeats choice 0: the same bits wherever their batches fell,
    so the tie between choices 0 and 3 breaks as HFLM's does (argmax takes the first)."""
    for model in MODELS:
        docs = _by_doc(runs["ours"][tp][model], "t_mc")
        assert _scores(docs[0]) == _scores(docs[2])
        for doc in docs:
            assert _scores(doc)[0] == _scores(doc)[3], (model, doc["doc_id"])
    reference = {d["doc_id"]: d["acc"] for d in _by_doc(runs["reference"]["gpt2"], "t_mc")}
    assert {d["doc_id"]: d["acc"] for d in _by_doc(runs["ours"][tp]["gpt2"], "t_mc")} == reference


def test_limit_and_fewshot_equal_hflm(runs):
    ours, reference = runs["fewshot"], runs["reference"]["fewshot"]
    assert ours["n-shot"] == {"t_gen": 2, "t_mc": 2, "t_ppl": 2}
    assert all(len(_by_doc(ours, t)) == 4 for t in TASKS.split(","))
    assert "\n\n" in _by_doc(ours, "t_mc")[0]["arguments"][0][0]  # two examples precede the question
    assert_same_documents(ours, reference, rtol=1e-4)


def test_output_holds_harness_json_and_provenance(runs):
    """The trained checkpoint: iteration and consumed tokens from its counters, tp, the harness's own keys; the
    table printed."""
    cfg = json.load(open(runs["dir"] / "train.json"))
    seq, gbs, iters = (cfg["model"]["seq_length"], cfg["training"]["global_batch_size"],
                       cfg["training"]["train_iters"])
    for tp in (1, 2):
        out = runs["ours"][tp]["trained"]
        assert {"results", "configs", "versions", "n-shot", "samples", "gptpar"} <= set(out)
        prov = out["gptpar"]
        assert prov["checkpoint"] == os.path.join(str(runs["dir"] / "ck"), "iter_0000002")
        assert (prov["iteration"], prov["consumed_samples"], prov["consumed_tokens"], prov["tp"]) == (
            iters, iters * gbs, iters * gbs * seq, tp)
        rc, text = runs[f"tp{tp}"]["trained"]
        assert "|Tasks|" in text and "|t_mc |" in text and "acc_norm" in text and "bits_per_byte" in text
    assert runs["ours"][1]["gpt2"]["gptpar"]["iteration"] is None  # a weights-only import has no counters
    assert not math.isnan(runs["ours"][1]["trained"]["results"]["t_ppl"]["word_perplexity,none"])


def test_bad_input_exits_2_before_reading_weights(runs, monkeypatch, capsys):
    from gptpar.tools import eval_harness

    import gptpar.checkpoint.model_loading as inference

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(inference, "read_weights", no_weights)
    d, tasks = runs["dir"], str(runs["dir"] / "tasks")
    big_tok = train_hf_tokenizer(d / "big_tok", vocab_size=400)
    gpt2 = str(d / "gpt2_tp2pp2")
    base = ["--load", gpt2, "--tokenizer", runs["hf"]["gpt2"], "--include-path", tasks]
    cases = [
        (base + ["--tasks", "t_mc,t_ppll"], {}, "--tasks: unknown task 't_ppll' (close: t_ppl"),
        (["--load", gpt2, "--tokenizer", big_tok, "--include-path", tasks, "--tasks", "t_mc"],
         {}, "the tokenizer has 400 tokens but the model's model.vocab_size is 300"),
        (base + ["--tasks", "t_mc", "--tp", "3"], {"WORLD_SIZE": "3"},
         "model.num_attention_heads (4) must divide by parallel.tensor_model_parallel_size (3)"),
        (base + ["--tasks", "t_mc", "--tp", "2"], {}, "--tp 2 needs 2 ranks, this run has 1"),
        (base + ["--tasks", "t_mc", "--batch-size", "0"], {}, "--batch-size must be >= 1, got 0"),
        (base + ["--tasks", "t_mc", "--limit", "2.5"], {}, "--limit must be a whole number of documents"),
        (base + ["--tasks", "t_mc", "--max-length", "65"], {},
         "--max-length 65 exceeds the model's model.max_position_embeddings (64)"),
        (["--load", gpt2, "--tasks", "t_mc"], {}, "names no tokenizer to encode the tasks' text with"),
        (base + ["--tasks", "t_mc", "--output", str(d / "nowhere" / "r.json")], {}, "its folder does not exist"),
        (base + ["--tasks", "t_mc", "--output", str(d)], {}, f"--output {d} is a folder: give the results file's path"),
        (base + ["--tasks", "t_mc", "--log-samples"], {}, "--log-samples needs --output FILE"),
        # lm-eval draws the examples from t_mc's train split (6 documents), from t_ppl's only split (5)
        (base + ["--tasks", "t_mc", "--num-fewshot", "100"], {},
         f"--num-fewshot 100: task t_mc has {len(_mc_docs()[3:])} documents to draw examples from: use "
         f"--num-fewshot {len(_mc_docs()[3:])} or fewer"),
        (base + ["--tasks", "t_ppl,t_gen", "--num-fewshot", "6"], {},
         f"--num-fewshot 6: task t_ppl has {len(_ppl_docs())} documents to draw examples from"),
        (["--load", gpt2, "--tokenizer", runs["hf"]["gpt2"], "--include-path", _malformed_task(d), "--tasks",
          "t_bad"], {}, f"--tasks: {d}/bad.jsonl line 3 is not valid JSON ("),
    ]
    for argv, env, message in cases:
        with environ_kept():
            os.environ.update(env)
            assert eval_harness.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("error:") == 1 and "Traceback" not in err, (argv, err)
    assert not [name for name in os.listdir(d) if ".tmp-" in name or ".probe-" in name]  # nothing left behind


def _malformed_task(d):
    """A task folder whose task reads a jsonl file with a malformed third line; its path."""
    good = json.dumps({"question": "x =", "answer": " 1"})
    (d / "bad.jsonl").write_text(f"{good}\n{good}\n{{\"question\": \"y =\" \"answer\": \" 2\"}}\n{good}\n")
    os.makedirs(d / "bad_tasks", exist_ok=True)
    (d / "bad_tasks" / "bad.yaml").write_text(f"""task: t_bad
dataset_path: json
dataset_kwargs:
  cache_dir: {d}/hf_datasets_bad
  data_files:
    test: {d}/bad.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
""")
    return str(d / "bad_tasks")


def test_output_into_a_folder_that_takes_no_file_exits_2_before_reading_weights(runs, monkeypatch, capsys, tmp_path):
    """A read-only folder (a read-only mount behaves alike; mounting needs root) is found before the evaluation,
    and nothing is left in it. Root writes into a chmod-ed folder anyway: skipped there."""
    from gptpar.tools import eval_harness

    import gptpar.checkpoint.model_loading as inference

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        try:
            (locked / "probe").write_text("")
            os.remove(locked / "probe")
            pytest.skip("this user writes into a read-only folder (root): the case cannot be made here")
        except PermissionError:
            pass
        monkeypatch.setattr(inference, "read_weights", lambda *a, **k: pytest.fail("weights were read"))
        argv = ["--load", str(runs["dir"] / "gpt2_tp2pp2"), "--tokenizer", runs["hf"]["gpt2"], "--include-path",
                str(runs["dir"] / "tasks"), "--tasks", "t_mc", "--output", str(locked / "r.json")]
        with environ_kept():
            assert eval_harness.main(argv) == 2
        err = capsys.readouterr().err
        assert f"--output {locked}/r.json: its folder {locked} takes no new file (Permission denied)" in err, err
        assert os.listdir(locked) == []
    finally:
        locked.chmod(0o755)


def test_results_that_cannot_be_written_leave_no_temporary_file(tmp_path):
    """A write that fails after the check (a disk filling up meanwhile; here a value whose conversion raises the
    disk's error half-way through the JSON) removes its temporary file and ends in one line, exit 1."""
    import errno
    import types

    from gptpar.tools import eval_harness

    class FullDisk:
        def __str__(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    args = types.SimpleNamespace(output=str(tmp_path / "r.json"), batch_size=1, limit=None, num_fewshot=None)
    results = {"results": {"t": {"acc,none": 0.5, "alias": "t"}}, "versions": {"t": 1}, "n-shot": {"t": 0},
               "higher_is_better": {"t": {"acc": True}}, "config": {"odd": FullDisk()}}
    provenance = {"checkpoint": "ck", "iteration": None, "tp": 1, "dtype": "float32", "max_length": 16}
    with pytest.raises(eval_harness.OutputError, match=r"could not write --output .*r.json \(No space left"):
        eval_harness.report(args, results, provenance, log=lambda *a: None)
    assert os.listdir(tmp_path) == []


def test_an_error_on_rank_0_releases_the_other_ranks(runs):
    """tp 2: rank 0 fails after the other rank began serving its model calls; the other rank is told to stop at
    once and returns (exit 0: rank 0 reports the error), instead of waiting for calls that never come."""
    failed0, failed1 = runs["failed"]
    assert failed0 == ("raised", "injected on rank 0")
    assert failed1[0] == 0, failed1


def test_alibi_generation_is_bounded_by_the_harness_length_alone(runs):
    """An ALiBi model has no position table: the long prompt with its new tokens passes the imported BLOOM's
    model.max_position_embeddings (its config's seq_length) but fits the harness's window (the tokenizer's
    model_max_length, as HFLM resolves it), and is generated as HFLM generates it, at tp 1 and tp 2."""
    from gptpar.checkpoint.weights import read_weights_config
    from gptpar.data.tokenizer import load_tokenizer

    prompt = len(load_tokenizer(runs["hf"]["bloom"]).encode(LONG_PROMPT))
    assert read_weights_config(str(runs["dir"] / "bloom_tp2pp2")).max_position_embeddings == BLOOM_SEQ_LENGTH
    assert BLOOM_SEQ_LENGTH < prompt + GEN_TOKENS <= BLOOM_MAX_LENGTH
    reference = {s["doc"]["question"]: s["resps"] for s in _by_doc(runs["reference"]["bloom"], "t_gen")}
    for tp in (1, 2):
        ours = {s["doc"]["question"]: s["resps"] for s in _by_doc(runs["ours"][tp]["bloom"], "t_gen")}
        assert ours[LONG_PROMPT] == reference[LONG_PROMPT]


def test_demo_tasks_run_offline_from_the_repository(runs, monkeypatch):
    """`make demo`'s evaluation: the three tasks tagged demo_python (tools/eval_tasks, data_files relative to the
    repository root) load from their jsonl and run; here on the imported GPT-2 with --limit 3."""
    import datasets

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(runs["dir"] / "demo_datasets"))
    out = runs["dir"] / "demo_eval.json"
    argv = ["--load", str(runs["dir"] / "gpt2_tp2pp2"), "--tokenizer", runs["hf"]["gpt2"], "--tasks", "demo_python",
            "--include-path", "tools/eval_tasks", "--limit", "3", "--batch-size", "4", "--bootstrap-iters", "0",
            "--output", str(out)]
    with no_env_report():
        (rc, text), = run_evals([("demo", argv)]).values()
    assert rc == 0, text
    results = json.load(open(out))["results"]
    assert set(results) == {"demo_python_mc", "demo_python_ppl", "demo_python_gen"}
    assert {"acc,none", "acc_norm,none"} <= set(results["demo_python_mc"])
    assert {"word_perplexity,none", "bits_per_byte,none"} <= set(results["demo_python_ppl"])
    assert "exact_match,none" in results["demo_python_gen"]


def test_universal_checkpoint_carries_provenance_and_tokenizer(runs, monkeypatch):
    """The trained checkpoint converted to its universal form: the tool reads the same counters and the run's
    tokenizer from it, and its model config without its weights."""
    import gptpar.checkpoint.weights as convert
    import gptpar.checkpoint.model_loading as inference

    universal_dir = str(runs["dir"] / "universal")
    _convert(["--load", str(runs["dir"] / "ck"), "--to", "universal", "--output", universal_dir])
    prov, trained = inference.checkpoint_provenance(universal_dir), runs["ours"][1]["trained"]["gptpar"]
    assert prov["checkpoint"] == universal_dir
    assert [prov[k] for k in ("iteration", "consumed_samples", "consumed_tokens")] == [
        trained[k] for k in ("iteration", "consumed_samples", "consumed_tokens")]
    assert inference.tokenizer_path(universal_dir) == trained["tokenizer"]

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(convert, "read_weights", no_weights)
    assert convert.read_weights_config(universal_dir) == convert.read_weights_config(str(runs["dir"] / "ck"))


def test_a_task_that_needs_the_hub_offline_is_one_line_naming_it(tmp_path, monkeypatch):
    """A task whose dataset lives on the Hugging Face Hub, with the Hub out of reach (offline mode: no retries):
    UsageError naming the task and the dataset, not the datasets library's traceback."""
    import datasets
    import huggingface_hub.constants

    from gptpar.tools import eval_harness
    from lm_eval.tasks import TaskManager

    (tmp_path / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: gptpar-tests/not-on-this-machine\ntest_split: test\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - {metric: word_perplexity, higher_is_better: false}\n")
    for module in (datasets.config, huggingface_hub.constants):
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    with pytest.raises(eval_harness.UsageError) as refused:
        eval_harness.load_tasks(manager, ["hub_task"], None)
    message = str(refused.value)
    assert message.startswith("--tasks: task hub_task needs the dataset gptpar-tests/not-on-this-machine from the "
                              "Hugging Face Hub, which cannot be reached") and "\n" not in message
