"""The fast data index equals gptpar's first one (gptpar.testing.data_index_reference) bit for bit: the blending
index on many weight vectors, and the document order, sample starts and shuffle on several corpora and seeds."""
import numpy as np
import pytest

from gptpar.data import blending, gpt_dataset
from gptpar.data.blending import build_blending_indices
from gptpar.testing import data_index_reference as reference


def weight_vectors():
    rng = np.random.default_rng(2024)
    yield from ([1.0], [0.3, 0.7], [1, 1], [1, 1, 1], [5, 5, 5, 5, 5, 5, 5], [1, 2, 3, 4], [2, 1, 1],
                [1, 2, 2, 1], [0.1] * 3 + [0.2] * 3,           # equal weights: every step a tie
                [1e-12, 1.0], [1.0, 1e-9, 1e-9], [1e-300, 1e-300, 2e-300],  # tiny weights
                [1 / 3, 1 / 3, 1 / 3], [0.1, 0.2, 0.3, 0.4], [1 / 7] * 7)    # weights with rounding in the sum
    for _ in range(40):
        d = int(rng.integers(1, 25))
        kind = rng.integers(3)
        if kind == 0:
            yield (rng.random(d) + 1e-3).tolist()
        elif kind == 1:   # a few distinct small integers: many exact ties
            yield rng.integers(1, 4, size=d).astype(float).tolist()
        else:             # spread over many orders of magnitude
            yield (10.0 ** rng.uniform(-8, 0, size=d)).tolist()


def same_blend(got, want):
    """Equal values; the dataset numbers are int16 now (int64 in the first implementation), the rest int64."""
    return (got[0].dtype == np.int16 and got[1].dtype == want[1].dtype == np.int64
            and all(np.array_equal(g, w) for g, w in zip(got, want)))


@pytest.mark.parametrize("num_samples", [0, 1, 2, 7, 3001])
def test_blending_index_equals_the_python_loop(monkeypatch, num_samples):
    monkeypatch.setattr(blending, "_CHUNK", 5)   # the helper is called per chunk: chunk edges inside every case
    for weights in weight_vectors():
        got = build_blending_indices(weights, num_samples)
        assert same_blend(got, reference.build_blending_indices(weights, num_samples)), weights


def test_blending_index_in_one_chunk():
    weights = [0.05, 0.2, 0.2, 0.55]
    assert same_blend(build_blending_indices(weights, 20_000), reference.build_blending_indices(weights, 20_000))


def test_the_compiled_helper_is_built_here_and_the_python_fallback_agrees(monkeypatch):
    # This machine has a C compiler: the fast path must be the one tested above.
    assert blending._compiled_helper()
    monkeypatch.setattr(blending, "_helper", False)
    weights = [0.05, 0.2, 0.2, 0.55]
    assert same_blend(build_blending_indices(weights, 5000), reference.build_blending_indices(weights, 5000))


def test_no_compiler_falls_back_to_python_with_a_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(blending, "_helper", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    got = build_blending_indices([1, 2, 3], 500)
    assert "no compiled blending helper" in capsys.readouterr().err
    assert same_blend(got, reference.build_blending_indices([1, 2, 3], 500))


def corpus(seed, num_docs, max_size, empty_fraction):
    """Document sizes (int32, as read from an .idx) with some empty documents, and a split's document ids."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_size, size=num_docs).astype(np.int32)
    sizes[rng.random(num_docs) < empty_fraction] = 0
    return sizes, np.arange(num_docs // 10, num_docs - num_docs // 7)


# (corpus, seq_length, seed, num_samples): part of an epoch, many epochs, samples longer than the corpus,
# seq_length 1, and a sample count that ends exactly on an epoch boundary.
CASES = [((0, 300, 50, 0.1), 7, 1, 500), ((1, 4000, 900, 0.02), 64, 2, 100_000), ((2, 12, 40, 0.3), 1, 3, 3000),
         ((3, 50, 20, 0.0), 2048, 4, 9), ((4, 1000, 10, 0.5), 5, 5, 0), ((5, 200, 30, 0.2), 3, 6, 1)]


@pytest.mark.parametrize("block", [1 << 20, 7])
@pytest.mark.parametrize("case", CASES)
def test_indices_equal_the_first_implementation(monkeypatch, case, block):
    (seed, num_docs, max_size, empty), seq_length, index_seed, num_samples = case
    sizes, documents = corpus(seed, num_docs, max_size, empty)
    monkeypatch.setattr(gpt_dataset, "_BLOCK", block)   # 7: many blocks per epoch, samples across block edges
    got = gpt_dataset.build_indices(sizes, documents, seq_length, index_seed, num_samples)
    want = reference.build_indices(sizes, documents, seq_length, index_seed, num_samples)
    for name, g, w in zip(("doc_order", "doc_pos", "offset", "shuffle"), got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w), name


def test_one_sample_more_than_megatron_the_one_that_ends_in_the_next_epoch():
    # Megatron-Core builds floor((E * T - 1) / s) samples for E epochs of T tokens (its last sample ends inside
    # epoch E); gptpar keeps every sample starting in those epochs, ceil(E * T / s): one more, whose last tokens come
    # from the next epoch's order (docs/data.md says why). Its tokens are the stream's, like any other sample's.
    sizes, documents = corpus(7, 500, 60, 0.1)
    tokens_per_epoch, seq_length = int(sizes[documents].sum()), 64
    for epochs in (1, 3):
        requested = (epochs * tokens_per_epoch - 1) // seq_length   # Megatron's count for `epochs` epochs
        doc_order, doc_pos, offset, shuffle = gpt_dataset.build_indices(sizes, documents, seq_length, 1, requested)
        assert len(shuffle) == requested + 1 == -(-epochs * tokens_per_epoch // seq_length)
        last_start = doc_order.size and int(sizes[doc_order[:doc_pos[-1]]].sum()) + int(offset[-1])
        assert last_start == requested * seq_length < epochs * tokens_per_epoch < last_start + seq_length + 1
        assert len(doc_order) == (epochs + 1) * len(documents)   # the next epoch's order is there to finish it


def test_the_blending_cache_file_is_the_first_implementations(tmp_path):
    # The first implementation saved np.stack of its two int64 rows: the same bytes, chunk edges or not.
    rows = build_blending_indices([0.2, 0.5, 0.3], 1001)
    np.save(str(tmp_path / "stacked.npy"), np.stack(reference.build_blending_indices([0.2, 0.5, 0.3], 1001)))
    for chunk in (7, 1 << 22):
        gpt_dataset._save_rows(str(tmp_path / "rows.npy"), *rows, chunk=chunk)
        assert (tmp_path / "rows.npy").read_bytes() == (tmp_path / "stacked.npy").read_bytes()
