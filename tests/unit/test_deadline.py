"""Test deadlines on a busy machine (gptpar.testing.deadline): seconds of an idle machine, stretched by the load
measured while waiting, within [1, MAX_STRETCH]; GPTPAR_TEST_TIMEOUT_SCALE fixes the factor."""
import os

import pytest

from gptpar.testing import deadline


@pytest.fixture
def machine(monkeypatch):
    """A machine of 2 cores whose load and clock the test sets."""
    state = {"load": 0.0, "now": 0.0}
    monkeypatch.delenv("GPTPAR_TEST_TIMEOUT_SCALE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (state["load"], 0.0, 0.0))
    monkeypatch.setattr(deadline.time, "monotonic", lambda: state["now"])
    return state


@pytest.mark.parametrize("load, factor", [(0.5, 1.0), (2.0, 1.0), (8.0, 4.0), (100.0, deadline.MAX_STRETCH)])
def test_the_factor_is_the_load_per_core_within_its_bounds(machine, load, factor):
    machine["load"] = load
    assert deadline.load_factor() == factor
    assert deadline.stretched(60) == 60 * factor


def test_a_deadline_counts_idle_seconds_at_the_load_measured_while_waiting(machine):
    d = deadline.Deadline(10)
    machine["load"], machine["now"] = 2.0, 6.0   # idle: 6 s count 6
    assert not d.expired()
    machine["load"], machine["now"] = 8.0, 20.0  # 4 times busier: 14 s count 3.5
    assert not d.expired()
    machine["now"] = 22.0                        # 2 s count 0.5: 10 in all, not past
    assert not d.expired()
    machine["now"] = 24.0
    assert d.expired()


def test_the_environment_fixes_the_factor(machine, monkeypatch):
    machine["load"] = 100.0
    monkeypatch.setenv("GPTPAR_TEST_TIMEOUT_SCALE", "1")
    assert deadline.stretched(30) == 30
