"""The examples built from the public API run and agree with their tp=1 counterparts."""
import importlib
import os
import sys

from torch.testing import assert_close

from gptpar.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    # A plain import (not spec_from_file_location) so that spawned ranks can unpickle its functions:
    # spawn hands sys.path to the children.
    if os.path.join(ROOT, "examples") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "examples"))
    return importlib.import_module(name)


def test_tp_mlp_classifier_matches_tp1():
    ex = _load("tp_mlp_classifier")
    serial = ex.train()
    assert serial[-1] < 0.7 * serial[0]  # it learns
    ranks = run_distributed(ex._train_tp, 2, args=(2,), timeout=240)
    assert ranks[0] == ranks[1]  # tp ranks agree exactly
    assert_close(ranks[0], serial, rtol=1e-5, atol=1e-6)
