"""GPT samples: token coverage per epoch, seeding, resumability, split, caching and blending proportions."""
import collections
import os

import numpy as np
import pytest

from gptpar.data.blending import build_blending_indices
from gptpar.data.gpt_dataset import (GPTDataset, build_train_valid_test_datasets, parse_data_path,
                                     split_ranges)
from gptpar.data.indexed import DataError, IndexedDataset, IndexedDatasetBuilder


def write_unique_token_dataset(prefix, num_docs, seed, first_token=0, max_len=30):
    """Documents whose token ids are all distinct and consecutive inside a document: a token names its place.

    Returns the list of documents (some empty)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, max_len, size=num_docs)
    bounds = first_token + np.concatenate([[0], np.cumsum(sizes)])
    docs = [np.arange(bounds[i], bounds[i + 1]) for i in range(num_docs)]
    with IndexedDatasetBuilder(prefix, np.int32) as b:
        for d in docs:
            b.add_document(d)
        b.finalize()
    return docs


def samples(ds, start, stop):
    return [ds[i]["text"] for i in range(start, stop)]


def check_epoch_coverage(texts, docs, seq_length, epochs):
    """The samples starting in the first `epochs` epochs see every token as a target `epochs` times.

    Exceptions, and only these: the very first token of the stream is never a target (it has no predecessor),
    and the last sample runs at most `seq_length` tokens into the next epoch (the remainder).
    """
    all_tokens = np.concatenate(docs)
    counts = collections.Counter(np.concatenate([t[1:] for t in texts]).tolist())
    per_token = np.array([counts.get(t, 0) for t in all_tokens.tolist()])
    assert sum(counts.values()) == len(texts) * seq_length
    assert set(counts) <= set(all_tokens.tolist())
    assert np.count_nonzero(per_token < epochs) <= 1 and per_token.min() >= epochs - 1
    assert per_token.max() <= epochs + 1 and np.count_nonzero(per_token > epochs) <= seq_length
    # Samples are made of whole documents in order: inside a sample a token is followed by its successor in
    # the same document, or a document ends and another (non-empty) one begins.
    doc_of = {int(t): i for i, d in enumerate(docs) for t in d}
    for t in texts:
        for a, b in zip(t[:-1].tolist(), t[1:].tolist()):
            same_doc = b == a + 1 and doc_of[a] == doc_of[b]
            assert same_doc or (a == docs[doc_of[a]][-1] and b == docs[doc_of[b]][0])
    # Consecutive samples share one token: the first tokens and the last tokens match up but for one each.
    firsts = collections.Counter(int(t[0]) for t in texts)
    lasts = collections.Counter(int(t[-1]) for t in texts)
    assert sum((firsts - lasts).values()) == 1 and sum((lasts - firsts).values()) == 1


def samples_starting_in_epochs(tokens_per_epoch, seq_length, epochs):
    # Sample j starts at stream token j * seq_length; count those starting before epochs * T.
    return -(-epochs * tokens_per_epoch // seq_length)


@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_every_token_is_a_target_once_per_epoch(tmp_path, seq_length):
    docs = write_unique_token_dataset(str(tmp_path / "u"), 40, seed=0)
    tokens_per_epoch = sum(len(d) for d in docs)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "u")), np.arange(len(docs)), seq_length, seed=3,
                    num_samples=3 * tokens_per_epoch // seq_length, name="train")
    assert len(ds) >= 3 * tokens_per_epoch // seq_length
    for epochs in (1, 2):
        n = samples_starting_in_epochs(tokens_per_epoch, seq_length, epochs)
        texts = samples(ds, 0, n)
        assert all(t.shape == (seq_length + 1,) and t.dtype == np.int64 for t in texts)
        check_epoch_coverage(texts, docs, seq_length, epochs)


def test_seed_changes_order_and_repeats(tmp_path):
    docs = write_unique_token_dataset(str(tmp_path / "u"), 60, seed=1)
    indexed = IndexedDataset(str(tmp_path / "u"))

    def first(seed, cache):
        ds = GPTDataset(indexed, np.arange(len(docs)), 16, seed, 200, cache_dir=str(tmp_path / cache))
        return np.stack(samples(ds, 0, 50))

    a, a_again, b = first(1, "c1"), first(1, "c2"), first(2, "c3")  # separate caches: built three times
    assert np.array_equal(a, a_again)
    assert not np.array_equal(a, b)
    assert sorted(map(tuple, a.tolist())) != sorted(map(tuple, b.tolist()))  # different documents order too
    # Samples are shuffled: neighbours in the dataset are rarely neighbours in the token stream.
    chained = sum(int(a[i][-1] == a[i + 1][0]) for i in range(len(a) - 1))
    assert chained < len(a) // 4


def test_sample_i_does_not_depend_on_num_samples_and_cache_is_reused(tmp_path):
    docs = write_unique_token_dataset(str(tmp_path / "u"), 30, seed=2)
    indexed = IndexedDataset(str(tmp_path / "u"))
    short = GPTDataset(indexed, np.arange(len(docs)), 8, 5, 10)
    long = GPTDataset(indexed, np.arange(len(docs)), 8, 5, 5000)
    assert all(np.array_equal(short[i]["text"], long[i]["text"]) for i in range(len(short)))
    cached = sorted(f for f in os.listdir(tmp_path) if f.endswith(".npy"))
    assert cached, "the index should be cached next to the data"
    mtimes = {f: os.path.getmtime(tmp_path / f) for f in cached}
    again = GPTDataset(indexed, np.arange(len(docs)), 8, 5, 5000)
    assert {f: os.path.getmtime(tmp_path / f) for f in cached} == mtimes
    assert all(np.array_equal(again[i]["text"], long[i]["text"]) for i in range(0, len(long), 97))


def test_split_ranges_cover_documents():
    for n in (0, 1, 7, 1000, 12345):
        for split in ("949,50,1", "80,20", "1,1,1", "100"):
            ranges = split_ranges(split, n)
            weights = [float(x) for x in split.split(",")] + [0.0] * (3 - len(split.split(",")))
            assert ranges[0][0] == 0 and ranges[2][1] == n
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(2))
            for (lo, hi), w in zip(ranges, weights):
                assert abs((hi - lo) - w / sum(weights) * n) <= 2


def test_parse_data_path_forms():
    assert parse_data_path("a") == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path("0.3 a 0.7 b") == parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(DataError, match="alternate weight and prefix"):
        parse_data_path("0.3 a b")
    # A weight slot holding a word: named, not read as four prefixes ("abc.idx: index file not found").
    with pytest.raises(DataError, match=r"'abc' stand\(s\) where a weight belongs but is not a number"):
        parse_data_path(["abc", "A", "0.7", "B"])
    with pytest.raises(DataError, match="look like weights but do not alternate"):
        parse_data_path(["A", "0.7", "B"])


def test_train_valid_test_split(tmp_path):
    docs = write_unique_token_dataset(str(tmp_path / "u"), 100, seed=4)
    train, valid, test = build_train_valid_test_datasets(str(tmp_path / "u"), "80,20,0", 8, 1, (100, 20, 5))
    assert test is None
    tokens_of = lambda ds: set(np.concatenate(samples(ds, 0, len(ds))).tolist())  # noqa: E731
    lo, hi = split_ranges("80,20,0", 100)[1]
    assert tokens_of(valid) <= set(np.concatenate(docs[lo:hi]).tolist())
    assert not tokens_of(valid) & tokens_of(train)


def reference_blending(weights, n):
    """Megatron's helpers.cpp build_blending_indices, transcribed loop for loop."""
    weights = np.asarray(weights, float) / sum(weights)
    current = np.zeros(len(weights))
    out = []
    for i in range(n):
        errors = weights * max(i, 1.0) - current
        d = int(np.argmax(errors))   # first maximum, as the C++ strict '>' comparison
        out.append(d)
        current[d] += 1
    return out


def test_blending_index_matches_megatron_rule():
    for weights in ([0.3, 0.7], [1, 2, 3, 4], [0.5, 0.25, 0.25]):
        dataset_index, sample_index = build_blending_indices(weights, 2000)
        assert dataset_index.tolist() == reference_blending(weights, 2000)
        for d in range(len(weights)):   # each dataset's samples are used in order 0, 1, 2, ...
            assert sample_index[dataset_index == d].tolist() == list(range(np.count_nonzero(dataset_index == d)))


def test_blended_datasets_reproduce_weights(tmp_path):
    weights, n = [0.2, 0.3, 0.5], 10_000
    token_ranges, path = [], []
    for d, w in enumerate(weights):
        # Disjoint token ids per dataset so every sample reveals where it came from.
        docs = write_unique_token_dataset(str(tmp_path / f"d{d}"), 80, seed=10 + d, first_token=100_000 * d)
        token_ranges.append((100_000 * d, 100_000 * d + sum(len(x) for x in docs)))
        path += [str(w), str(tmp_path / f"d{d}")]
    train, _, _ = build_train_valid_test_datasets(path, "1", 16, 7, (n, 0, 0))
    sources = []
    for i in range(n):
        text = train[i]["text"]
        source = [d for d, (lo, hi) in enumerate(token_ranges) if lo <= text[0] < hi]
        assert len(source) == 1 and token_ranges[source[0]][0] <= text.min() <= text.max() < token_ranges[source[0]][1]
        sources.append(source[0])
    fractions = np.bincount(sources, minlength=3) / n
    assert np.all(np.abs(fractions - weights) < 0.01)
    # The string form builds the same blend.
    same, _, _ = build_train_valid_test_datasets(" ".join(path), "1", 16, 7, (n, 0, 0))
    assert all(np.array_equal(same[i]["text"], train[i]["text"]) for i in range(0, n, 101))


def test_vocab_check_and_empty_split(tmp_path):
    write_unique_token_dataset(str(tmp_path / "u"), 10, seed=5)
    with pytest.raises(DataError, match=r"u\.bin: token id .* outside the vocabulary \[0, 10\)"):
        build_train_valid_test_datasets(str(tmp_path / "u"), "1", 8, 1, (10, 0, 0), vocab_size=10)
    with IndexedDatasetBuilder(str(tmp_path / "empty"), np.uint16) as b:
        b.add_document([])
        b.finalize()
    with pytest.raises(DataError, match=r"empty: the train split has no tokens"):
        build_train_valid_test_datasets(str(tmp_path / "empty"), "1", 8, 1, (10, 0, 0))
    with IndexedDatasetBuilder(str(tmp_path / "nodocs"), np.uint16) as b:
        b.finalize()
    with pytest.raises(DataError, match=r"nodocs: split '1' leaves the train split no documents"):
        build_train_valid_test_datasets(str(tmp_path / "nodocs"), "1", 8, 1, (10, 0, 0))
