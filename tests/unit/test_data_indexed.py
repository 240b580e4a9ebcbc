"""MMIDIDX files: byte compatibility with an independent implementation of the format, and clear errors."""
import pickle
import struct

import numpy as np
import pytest

from gptpar.data.indexed import (DataError, IndexedDataset, IndexedDatasetBuilder, best_dtype,
                                 merge_datasets)
from gptpar.testing.indexed_reference import ref_read, ref_write


def random_docs(rng, n, vocab, max_len=40):
    # Empty documents included on purpose: the format allows them.
    return [rng.integers(0, vocab, size=rng.integers(0, max_len)) for _ in range(n)]


def write_with_gptpar(prefix, docs, vocab):
    with IndexedDatasetBuilder(prefix, best_dtype(vocab), vocab) as b:
        for d in docs:
            b.add_document(d)
        b.finalize()


@pytest.mark.parametrize("vocab", [1000, 70000])
def test_gptpar_files_read_by_independent_reader(tmp_path, vocab):
    docs = random_docs(np.random.default_rng(0), 50, vocab)
    write_with_gptpar(str(tmp_path / "a"), docs, vocab)
    dtype, seqs, doc_idx = ref_read(str(tmp_path / "a"))
    assert dtype == (np.uint16 if vocab < 65500 else np.int32)
    assert doc_idx == list(range(len(docs) + 1))
    assert all(np.array_equal(s, d) for s, d in zip(seqs, docs)) and len(seqs) == len(docs)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_independent_files_read_by_gptpar(tmp_path, dtype):
    seqs = random_docs(np.random.default_rng(1), 30, 200)
    doc_idx = [0, 3, 3, 10, 30]  # several sequences per document, and an empty document
    ref_write(str(tmp_path / "b"), seqs, dtype, doc_idx)
    ds = IndexedDataset(str(tmp_path / "b"))
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(seqs) and ds.num_documents == len(doc_idx) - 1
    assert ds.doc_idx.tolist() == doc_idx
    assert all(np.array_equal(ds[i], s) for i, s in enumerate(seqs))
    longest = int(np.argmax([len(s) for s in seqs]))
    assert np.array_equal(ds.get(longest, 2, 5), seqs[longest][2:7])
    assert ds.num_tokens == sum(len(s) for s in seqs)


def test_reader_is_memory_mapped(tmp_path):
    write_with_gptpar(str(tmp_path / "m"), [np.arange(10)], 100)
    ds = IndexedDataset(str(tmp_path / "m"))
    view = ds.get(0)
    assert isinstance(ds._bin, np.memmap) and not view.flags.owndata and not view.flags.writeable


def test_pickles_by_reference(tmp_path):
    docs = random_docs(np.random.default_rng(6), 200, 1000, max_len=400)
    write_with_gptpar(str(tmp_path / "p"), docs, 1000)
    ds = IndexedDataset(str(tmp_path / "p"))
    blob = pickle.dumps(ds)
    assert len(blob) < ds.num_tokens  # the prefix travels, not the tokens
    again = pickle.loads(blob)
    assert all(np.array_equal(again[i], d) for i, d in enumerate(docs))


def test_megatron_core_reads_gptpar_files(tmp_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    docs = random_docs(np.random.default_rng(2), 20, 500)
    write_with_gptpar(str(tmp_path / "c"), docs, 500)
    theirs = indexed.IndexedDataset(str(tmp_path / "c"))
    assert all(np.array_equal(theirs[i], d) for i, d in enumerate(docs))


def test_gptpar_reads_megatron_core_files(tmp_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    torch = pytest.importorskip("torch")
    docs = random_docs(np.random.default_rng(7), 20, 500)
    prefix = str(tmp_path / "mc")
    builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in docs:
        builder.add_item(torch.tensor(d))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    ours = IndexedDataset(prefix)
    assert len(ours) == len(docs) and all(np.array_equal(ours[i], d) for i, d in enumerate(docs))


def test_merge_concatenates(tmp_path):
    rng = np.random.default_rng(3)
    parts = [random_docs(rng, n, 300) for n in (5, 0, 8)]
    for i, docs in enumerate(parts):
        write_with_gptpar(str(tmp_path / f"p{i}"), docs, 300)
    merge_datasets([str(tmp_path / f"p{i}") for i in range(3)], str(tmp_path / "merged"))
    _, seqs, doc_idx = ref_read(str(tmp_path / "merged"))
    expected = [d for docs in parts for d in docs]
    assert doc_idx == list(range(len(expected) + 1))
    assert all(np.array_equal(s, d) for s, d in zip(seqs, expected)) and len(seqs) == len(expected)


# --- bad inputs: one clear error naming the file and the problem ---

@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    write_with_gptpar(prefix, random_docs(np.random.default_rng(4), 10, 1000), 1000)
    return prefix


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nothere\.idx.*not found"):
        IndexedDataset(str(tmp_path / "nothere"))


def test_truncated_bin(good):
    with open(good + ".bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 2)
    with pytest.raises(DataError, match=r"good\.bin.*truncated"):
        IndexedDataset(good)


def test_truncated_idx(good):
    with open(good + ".idx", "r+b") as f:
        f.truncate(f.seek(0, 2) - 8)
    with pytest.raises(DataError, match=r"good\.idx.*truncated"):
        IndexedDataset(good)


def test_wrong_magic(good):
    with open(good + ".idx", "r+b") as f:
        f.write(b"TNTIDX\x00\x00")
    with pytest.raises(DataError, match=r"good\.idx.*magic"):
        IndexedDataset(good)


def test_wrong_version(good):
    with open(good + ".idx", "r+b") as f:
        f.seek(9)
        f.write(struct.pack("<Q", 2))
    with pytest.raises(DataError, match=r"good\.idx.*version 2"):
        IndexedDataset(good)


def test_dtype_mismatch(tmp_path):
    # An .idx that says uint16 next to a .bin that holds int32 tokens (files from two different runs).
    seqs = random_docs(np.random.default_rng(5), 10, 1000)
    ref_write(str(tmp_path / "u16"), seqs, np.uint16)
    ref_write(str(tmp_path / "i32"), seqs, np.int32)
    (tmp_path / "u16.bin").write_bytes((tmp_path / "i32.bin").read_bytes())
    with pytest.raises(DataError, match=r"u16\.bin.*dtype mismatch"):
        IndexedDataset(str(tmp_path / "u16"))
    # Merging datasets of different dtypes (tokenised with different vocabularies) is refused.
    ref_write(str(tmp_path / "u16b"), seqs, np.uint16)
    with pytest.raises(DataError, match=r"i32.*dtype int32 differs from uint16"):
        merge_datasets([str(tmp_path / "u16b"), str(tmp_path / "i32")], str(tmp_path / "merged"))
    assert not (tmp_path / "merged.bin").exists() and not (tmp_path / "merged.idx").exists()


def test_token_ids_beyond_vocab(tmp_path):
    with pytest.raises(DataError, match=r"token id 100 outside \[0, 100\)"):
        with IndexedDatasetBuilder(str(tmp_path / "w"), np.uint16, vocab_size=100) as b:
            b.add_document([1, 100])
    assert not list(tmp_path.iterdir())  # the failed build left nothing behind
    ref_write(str(tmp_path / "r"), [[1, 2], [3, 99, 4]], np.uint16)
    IndexedDataset(str(tmp_path / "r")).check_token_ids(100)
    with pytest.raises(DataError, match=r"r\.bin: token id 99 in sequence 1 .*vocabulary \[0, 50\)"):
        IndexedDataset(str(tmp_path / "r")).check_token_ids(50)
