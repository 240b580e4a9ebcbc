"""Tokenizer training, jsonl -> .bin/.idx preprocessing and the command-line tools, including bad inputs."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gptpar.data.indexed import DataError, IndexedDataset
from gptpar.data.preprocess import preprocess
from gptpar.data.tokenizer import load_tokenizer
from gptpar.testing import ROOT as REPO
from gptpar.tools import merge_datasets, train_tokenizer

WORDS = ("the model reads tokens from memory mapped files while workers encode lines of text in parallel and "
         "the trainer resumes from consumed samples def return class import numpy array shape batch").split()


def make_texts(n, seed):
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        lines = [" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) for _ in range(rng.integers(1, 4))]
        texts.append("\n".join(lines) + rng.choice(["", ".", "!\n", " é ü 中"]))
    return texts


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_jsonl(d / "train.jsonl", [{"text": t} for t in make_texts(300, seed=0)])
    train_tokenizer.train([str(d / "train.jsonl")], 120, "bpe", str(d / "tok"), byte_fallback=False)
    return str(d / "tok.model")


@pytest.fixture
def corpus(tmp_path):
    records = [{"text": t, "title": f"doc {i}"} for i, t in enumerate(make_texts(200, seed=1))]
    records[7]["text"] = ""    # empty documents are skipped and counted
    records[50]["text"] = ""
    write_jsonl(tmp_path / "corpus.jsonl", records)
    return str(tmp_path / "corpus.jsonl"), records


def test_tokenizer_interface(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    assert tok.vocab_size == 120 and tok.pad == 0 and tok.eod == 3
    text = "the model reads\ntokens  from\tmemory"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids) and tok.decode(ids) == text


def test_hf_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 0, "<unk>": 1, "<|endoftext|>": 2, "hello": 3, "world": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    loaded = load_tokenizer(str(tmp_path / "tok.json"))
    assert (loaded.vocab_size, loaded.eod, loaded.pad) == (5, 2, 0)
    assert loaded.encode("hello world") == [3, 4]


@pytest.mark.parametrize("append_eod", [False, True])
def test_round_trip_and_workers_identical(tmp_path, tokenizer_path, corpus, append_eod):
    path, records = corpus
    tok = load_tokenizer(tokenizer_path)
    summaries = {}
    for workers in (1, 2):
        summaries[workers] = preprocess(path, ["text", "title"], tokenizer_path, str(tmp_path / f"w{workers}"),
                                        workers=workers, append_eod=append_eod, progress=False)
    for key in ("text", "title"):
        # Expected: encoding each record directly, EOD appended, empty documents dropped.
        expected = [tok.encode(r[key]) + ([tok.eod] if append_eod else []) for r in records if r[key]]
        ds = IndexedDataset(str(tmp_path / f"w1_{key}_document"))
        assert len(ds) == len(expected)
        assert all(ds[i].tolist() == e for i, e in enumerate(expected))
        for suffix in (".bin", ".idx"):
            a = (tmp_path / f"w1_{key}_document{suffix}").read_bytes()
            assert a == (tmp_path / f"w2_{key}_document{suffix}").read_bytes()
    assert summaries[1]["empty_skipped"] == {"text": 2, "title": 0}
    assert summaries[1]["docs"] == len(records) and summaries[2]["tokens"] == summaries[1]["tokens"]


def check_fails_cleanly(tmp_path, tokenizer_path, lines, match, keys=("text",)):
    """The corpus made of `lines` must fail with `match`, leaving no output file (final or temporary)."""
    (tmp_path / "bad.jsonl").write_bytes(b"".join(lines))
    os.makedirs(tmp_path / "out", exist_ok=True)
    for workers in (1, 2):
        with pytest.raises(DataError, match=match):
            preprocess(str(tmp_path / "bad.jsonl"), list(keys), tokenizer_path, str(tmp_path / "out" / "o"),
                       workers=workers, progress=False)
        assert os.listdir(tmp_path / "out") == []


def good_lines(n):
    return [json.dumps({"text": t}).encode() + b"\n" for t in make_texts(n, seed=2)]


def test_invalid_utf8_names_the_line(tmp_path, tokenizer_path):
    lines = good_lines(300)
    lines[299] = b'{"text": "caf\xe9"}\n'  # latin-1, deep enough to be found by a worker, not the pre-check
    check_fails_cleanly(tmp_path, tokenizer_path, lines, r"bad\.jsonl:300: invalid UTF-8")


def test_missing_key_names_the_line(tmp_path, tokenizer_path):
    lines = good_lines(5)
    lines[3] = b'{"body": "x"}\n'
    check_fails_cleanly(tmp_path, tokenizer_path, lines, r"bad\.jsonl:4: missing json key 'text'")
    check_fails_cleanly(tmp_path, tokenizer_path, good_lines(3), r"bad\.jsonl:1: missing json key 'body'",
                        keys=("body",))


def test_invalid_json_and_non_string_field(tmp_path, tokenizer_path):
    lines = good_lines(5)
    lines[2] = b'{"text": "unterminated\n'
    check_fails_cleanly(tmp_path, tokenizer_path, lines, r"bad\.jsonl:3: not valid JSON")
    lines[2] = b'{"text": 42}\n'
    check_fails_cleanly(tmp_path, tokenizer_path, lines, r"bad\.jsonl:3: field 'text' is int")


def test_missing_inputs(tmp_path, tokenizer_path, corpus):
    with pytest.raises(DataError, match=r"nope\.jsonl: input file not found"):
        preprocess(str(tmp_path / "nope.jsonl"), ["text"], tokenizer_path, str(tmp_path / "o"), progress=False)
    with pytest.raises(DataError, match=r"nope\.model: tokenizer not found"):
        preprocess(corpus[0], ["text"], str(tmp_path / "nope.model"), str(tmp_path / "o"), progress=False)
    with pytest.raises(DataError, match=r"output directory .*missing_dir does not exist"):
        preprocess(corpus[0], ["text"], tokenizer_path, str(tmp_path / "missing_dir" / "o"), progress=False)


def test_tools_run_from_repo_root(tmp_path, tokenizer_path, corpus):
    """`python tools/X.py` works without installing gptpar; errors exit non-zero with one clear line."""
    run = dict(cwd=REPO, capture_output=True, text=True)
    ok = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", corpus[0], "--json-keys", "text",
                         "--tokenizer-model", tokenizer_path, "--output-prefix", str(tmp_path / "cli"),
                         "--workers", "2", "--append-eod", "--no-progress"], **run)
    assert ok.returncode == 0, ok.stderr
    assert "2 empty documents skipped" in ok.stdout
    bad = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "nope.jsonl"),
                          "--tokenizer-model", tokenizer_path, "--output-prefix", str(tmp_path / "x")], **run)
    assert bad.returncode != 0 and "nope.jsonl: input file not found" in bad.stderr
    demo = subprocess.run([sys.executable, "tools/make_demo_corpus.py", "--output", str(tmp_path / "demo.jsonl"),
                           "--max-docs", "5"], **run)
    assert demo.returncode == 0, demo.stderr
    docs = [json.loads(line) for line in open(tmp_path / "demo.jsonl", encoding="utf-8")]
    assert len(docs) == 5 and all(d["text"].strip() for d in docs)


def test_merge_tool(tmp_path, tokenizer_path, corpus):
    preprocess(corpus[0], ["text"], tokenizer_path, str(tmp_path / "a"), progress=False)
    preprocess(corpus[0], ["title"], tokenizer_path, str(tmp_path / "b"), progress=False)
    merge_datasets.main(["--input", str(tmp_path / "a_text_document"), str(tmp_path / "b_title_document.idx"),
                         "--output-prefix", str(tmp_path / "ab")])
    a, b = IndexedDataset(str(tmp_path / "a_text_document")), IndexedDataset(str(tmp_path / "b_title_document"))
    ab = IndexedDataset(str(tmp_path / "ab"))
    assert [x.tolist() for x in ab] == [x.tolist() for x in list(a) + list(b)]
    with pytest.raises(SystemExit, match="nothere.idx.*not found"):
        merge_datasets.main(["--input", str(tmp_path / "nothere"), "--output-prefix", str(tmp_path / "c")])


def test_train_tokenizer_bad_input(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(SystemExit, match=r"t\.jsonl:1: missing json key 'text'"):
        train_tokenizer.main(["--input", str(tmp_path / "t.jsonl"), "--vocab-size", "100",
                              "--output-prefix", str(tmp_path / "tok")])
    assert not (tmp_path / "tok.model").exists()


def test_train_tokenizer_reports_bad_line_mid_file(tmp_path):
    lines = good_lines(50)
    lines[40] = b'{"text": "caf\xe9"}\n'
    (tmp_path / "t.jsonl").write_bytes(b"".join(lines))
    with pytest.raises(SystemExit, match=r"t\.jsonl:41: invalid UTF-8"):
        train_tokenizer.main(["--input", str(tmp_path / "t.jsonl"), "--vocab-size", "100",
                              "--output-prefix", str(tmp_path / "tok")])
    assert not list(tmp_path.glob("tok.model*"))


def test_not_a_tokenizer_file(tmp_path):
    (tmp_path / "x.model").write_text("hello")
    with pytest.raises(DataError, match=r"x\.model: not a SentencePiece model"):
        load_tokenizer(str(tmp_path / "x.model"))
