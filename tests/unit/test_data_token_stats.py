"""Token ids against the model's vocabulary before training (gptpar.training.preflight.check_data), and the
`.stats.json` cache beside a dataset: ids and checksum recomputed from the `.bin` itself, a swapped `.bin`
refused. Reference: numpy over the documents written (and an independent MMIDIDX writer)."""
import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from gptpar.data.indexed import DataError, IndexedDataset, IndexedDatasetBuilder, merge_datasets
from gptpar.data.token_stats import read_stats, stats_path, token_stats
from gptpar.testing.indexed_reference import ref_write
from gptpar.testing import ROOT
from gptpar.testing.runs import tiny_config

LOG = []


def _docs(seed, vocab, n=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(1, 50)) for _ in range(n)]


def _build(prefix, docs):
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for doc in docs:
            b.add_document(doc)
        b.finalize()


def _expected(docs, dtype=np.uint16):
    flat = np.concatenate(docs).astype(dtype)
    return {"num_tokens": len(flat), "min_id": int(flat.min()), "max_id": int(flat.max()),
            "bin_sha1": hashlib.sha1(flat.tobytes()).hexdigest()}


def test_builder_writes_the_stats_a_scan_finds(tmp_path):
    docs = _docs(0, 1000)
    prefix = str(tmp_path / "a")
    _build(prefix, docs)
    cached = read_stats(prefix)
    assert {k: cached[k] for k in _expected(docs)} == _expected(docs)
    os.remove(stats_path(prefix))  # as for data preprocessed elsewhere (Megatron): scanned, then cached
    assert {k: v for k, v in token_stats(IndexedDataset(prefix), log=LOG.append).items()
            if k in _expected(docs)} == _expected(docs)
    assert read_stats(prefix)["max_id"] == _expected(docs)["max_id"]


def test_merge_writes_the_stats_of_the_merged_data(tmp_path):
    a, b = _docs(1, 500), _docs(2, 900)
    _build(str(tmp_path / "a"), a)
    _build(str(tmp_path / "b"), b)
    merge_datasets([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "ab"))
    assert {k: read_stats(str(tmp_path / "ab"))[k] for k in _expected(a + b)} == _expected(a + b)


def test_a_bin_of_another_dataset_with_the_same_size_is_refused(tmp_path):
    ours, theirs = _docs(3, 1000), _docs(4, 1000)
    sizes = [len(d) for d in ours]
    theirs = [np.resize(t, n) for t, n in zip(theirs, sizes)]  # the same document sizes, other tokens
    _build(str(tmp_path / "ours"), ours)
    ref_write(str(tmp_path / "theirs"), theirs, np.uint16)
    assert os.path.getsize(tmp_path / "ours.bin") == os.path.getsize(tmp_path / "theirs.bin")
    shutil.copyfile(tmp_path / "theirs.bin", tmp_path / "ours.bin")  # a new mtime: the .bin is read again
    ds = IndexedDataset(str(tmp_path / "ours"))  # the size matches the index: opening cannot tell
    with pytest.raises(DataError, match=r"ours.bin is not the .bin that was first used with .*ours.idx"):
        token_stats(ds, log=LOG.append)
    # Unchanged content under a new modification time (e.g. `cp` without -p) is accepted.
    _build(str(tmp_path / "same"), ours)
    shutil.copyfile(tmp_path / "same.bin", tmp_path / "copy.bin")
    os.replace(tmp_path / "copy.bin", tmp_path / "same.bin")
    assert token_stats(IndexedDataset(str(tmp_path / "same")), log=LOG.append)["max_id"] == _expected(ours)["max_id"]


def _cfg(prefix, vocab_size, tokenizer=None):
    return tiny_config(model={"vocab_size": vocab_size},
                       data={"synthetic": False, "data_path": prefix, "tokenizer_model": tokenizer})


def test_largest_token_id_against_the_real_vocab(tmp_path):
    from gptpar.training.preflight import check_data

    docs = _docs(5, 210)  # ids up to 209: inside the padded vocab (256) of a 200-token model, outside the real
    prefix = str(tmp_path / "d")
    _build(prefix, docs)
    top = _expected(docs)["max_id"]
    with pytest.raises(DataError, match=f"dataset {prefix}: its largest token id is {top}, but model.vocab_size "
                                        rf"is 200 .* \(at least {top + 1}\)"):
        check_data(_cfg(prefix, 200), LOG.append)
    check_data(_cfg(prefix, top + 1), LOG.append)  # fits exactly
    # A blend: the dataset that does not fit is the one named.
    _build(str(tmp_path / "small"), _docs(6, 100))
    with pytest.raises(DataError, match=f"dataset {prefix}: "):
        check_data(_cfg(["0.5", str(tmp_path / "small"), "0.5", prefix], 150), LOG.append)


def test_tokenizer_vocab_larger_than_the_model(tmp_path):
    from gptpar.tools import train_tokenizer
    from gptpar.training.preflight import check_data
    
    corpus = tmp_path / "c.jsonl"
    with open(corpus, "w") as f:
        for path in sorted(os.listdir(os.path.join(ROOT, "gptpar")))[:6]:
            if path.endswith(".py"):
                f.write(json.dumps({"text": open(os.path.join(ROOT, "gptpar", path)).read()}) + "\n")
    train_tokenizer.train([str(corpus)], 300, "bpe", str(tmp_path / "tok"), byte_fallback=False)
    prefix = str(tmp_path / "d")
    _build(prefix, _docs(7, 100))
    with pytest.raises(DataError, match="tok.model has 300 pieces but model.vocab_size is 256: set "
                                        "model.vocab_size=300"):
        check_data(_cfg(prefix, 256, str(tmp_path / "tok.model")), LOG.append)
    check_data(_cfg(prefix, 300, str(tmp_path / "tok.model")), LOG.append)
