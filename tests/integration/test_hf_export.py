"""A Hugging Face export that carries its tokenizer: a run trained with a SentencePiece tokenizer (as the demo's),
exported with tools/convert_checkpoint.py --to hf, is read by `AutoTokenizer` into the same ids as the run's own
tokenizer, declares the tokenizer's own bos/eos/pad ids, runs the README's transformers snippet to the greedy ids
gptpar's generation gives, and serves tools/generate.py without --tokenizer."""
import contextlib
import io
import json
import os
import re

import pytest

from gptpar.testing import run_distributed
from gptpar.testing.runs import ROOT, environ_kept, run_mains, write_config

transformers = pytest.importorskip("transformers")

TEXTS = ["def parse(text):\n    return text.split(',')\n", "  two leading spaces\n\tand a tab", "x = 12345 + 6"]


def _tool(module, argv):
    buf = io.StringIO()
    with environ_kept(), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = module.main(argv)
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(folder, the SentencePiece model, the export): a tokenizer trained on gptpar's sources, a 1-rank run that
    records it, and that run exported to Hugging Face."""
    from gptpar.tools import convert_checkpoint
    from gptpar.tools import train_tokenizer

    d = tmp_path_factory.mktemp("hf_export")
    with open(d / "corpus.jsonl", "w") as f:
        for path in sorted(os.listdir(os.path.join(ROOT, "gptpar", "checkpoint"))):
            if path.endswith(".py"):
                f.write(json.dumps({"text": open(os.path.join(ROOT, "gptpar", "checkpoint", path)).read()}) + "\n")
    pieces = train_tokenizer.train([str(d / "corpus.jsonl")], 400, "bpe", str(d / "tok"))
    config = write_config(d / "run.json", model=dict(vocab_size=pieces), parallel=dict(data_parallel_size=1),
                          training=dict(train_iters=2, lr_warmup_iters=0),
                          data=dict(tokenizer_model=str(d / "tok.model")), checkpoint=dict(save=str(d / "ck")))
    out, = run_distributed(run_mains, 1, ([("run", ["--config", config])],), timeout=300)
    assert out["run"][0] == 0, out["run"][1]
    rc, text = _tool(convert_checkpoint, ["--load", str(d / "ck"), "--to", "hf", "--output", str(d / "hf")])
    assert rc == 0, text
    return d, str(d / "tok.model"), str(d / "hf")


def test_auto_tokenizer_reads_the_runs_tokenizer_and_its_special_ids(exported):
    import sentencepiece as spm

    _, model_file, hf = exported
    sp = spm.SentencePieceProcessor(model_file=model_file)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    for text in TEXTS:
        ids = sp.encode(text)
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids, text
        if sp.unk_id() not in ids:  # SentencePiece decodes <unk> as " ⁇ ", transformers as "<unk>"
            # The export keeps the dummy prefix's space, which SentencePiece's decode strips (docs/evaluation.md)
            assert tokenizer.decode(ids) == " " + sp.decode(ids)
    config = json.load(open(os.path.join(hf, "config.json")))
    generation = json.load(open(os.path.join(hf, "generation_config.json")))
    assert config["eos_token_id"] == generation["eos_token_id"] == sp.eos_id() == tokenizer.eos_token_id == 3
    assert config["pad_token_id"] == sp.pad_id() == tokenizer.pad_token_id and config["bos_token_id"] == sp.bos_id()


def test_the_readme_snippet_generates_gptpars_greedy_ids(exported, monkeypatch):
    """The README's transformers lines, run on the export, give the ids tools/generate.py --greedy gives from the
    checkpoint itself; generate.py on the export needs no --tokenizer."""
    from gptpar.tools import generate

    d, _, hf = exported
    readme = open(os.path.join(ROOT, "README.md")).read()
    snippet = re.search(r"```python\n(from transformers import AutoModelForCausalLM, AutoTokenizer\n.*?)```", readme,
                        re.S).group(1)
    assert 'from_pretrained("exported/demo_hf")' in snippet
    code = snippet.replace('"exported/demo_hf"', repr(hf)).replace("max_new_tokens=32", "max_new_tokens=8")
    scope = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, "README.md", "exec"), scope)
    prompt = scope["inputs"]["input_ids"][0].tolist()
    theirs = scope["out"][0].tolist()[len(prompt):]
    rc, text = _tool(generate, ["--load", str(d / "ck"), "--prompt-ids", ",".join(map(str, prompt)),
                                "--max-new-tokens", "8", "--greedy", "--print-ids"])
    assert rc == 0, text
    ours = [int(i) for i in re.search(r"^ids: (.*)$", text, re.M).group(1).split(",")]
    eos = scope["tokenizer"].eos_token_id  # transformers stops there; gptpar's generate.py without --stop-at-eod not
    assert theirs == ours[:len(theirs)] and (len(theirs) == 8 or theirs[-1] == eos), (theirs, ours)
    rc, text = _tool(generate, ["--load", hf, "--prompt", "def parse(", "--max-new-tokens", "4", "--greedy"])
    assert rc == 0 and text.lstrip().startswith("def parse("), text  # the export keeps the dummy prefix's space
