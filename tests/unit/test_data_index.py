"""The fast data index equals gptpar's first one (gptpar.testing.data_index_reference) bit for bit: the blending
index on many weight vectors, and the document order, sample starts and shuffle on several corpora and seeds."""
import numpy as np
import pytest

from gptpar.data import blending
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


@pytest.mark.parametrize("num_samples", [0, 1, 2, 7, 3001])
def test_blending_index_equals_the_python_loop(num_samples):
    for weights in weight_vectors():
        got = build_blending_indices(weights, num_samples)
        want = reference.build_blending_indices(weights, num_samples)
        assert all(g.dtype == w.dtype and np.array_equal(g, w) for g, w in zip(got, want)), weights


def test_the_compiled_helper_is_built_here_and_the_python_fallback_agrees(monkeypatch):
    # This machine has a C compiler: the fast path must be the one tested above.
    assert blending._compiled_helper()
    monkeypatch.setattr(blending, "_helper", False)
    weights = [0.05, 0.2, 0.2, 0.55]
    assert all(np.array_equal(g, w) for g, w in zip(build_blending_indices(weights, 5000),
                                                      reference.build_blending_indices(weights, 5000)))


def test_no_compiler_falls_back_to_python_with_a_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(blending, "_helper", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    got = build_blending_indices([1, 2, 3], 500)
    assert "no compiled blending helper" in capsys.readouterr().err
    assert all(np.array_equal(g, w) for g, w in zip(got, reference.build_blending_indices([1, 2, 3], 500)))
