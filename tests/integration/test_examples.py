"""The examples built from the public API run and agree with their tp=1 counterparts."""
import os

from torch.testing import assert_close

from gptpar.testing import load_script, run_distributed
from gptpar.testing.runs import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "tp_mlp_classifier.py")


def _train_tp(tp):
    """On each rank: the example's own tp training (the example is loaded in the rank from its path)."""
    return load_script(EXAMPLE)._train_tp(tp)


def test_tp_mlp_classifier_matches_tp1():
    ex = load_script(EXAMPLE)
    serial = ex.train()
    assert serial[-1] < 0.7 * serial[0]  # it learns
    ranks = run_distributed(_train_tp, 2, args=(2,), timeout=240)
    assert ranks[0] == ranks[1]  # tp ranks agree exactly
    assert_close(ranks[0], serial, rtol=1e-5, atol=1e-6)
