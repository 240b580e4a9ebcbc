"""LR schedule and batch-size ramp-up against formulas written out here, independently of the library."""
import math

import pytest

from gptpar.config import config_from_dict
from gptpar.schedules import BatchSizeRampup, LearningRateSchedule, train_iters


def training_cfg(**training):
    d = {"training": {"micro_batch_size": 1, "global_batch_size": 8, "lr": 6e-4, "min_lr": 6e-5, **training},
         "data": {"synthetic": True}}
    return config_from_dict(d).training


def megatron_lr_by_iteration(k, max_lr, min_lr, warmup_iters, decay_iters, style):
    """LR used by the iteration after k completed ones (Megatron steps the scheduler after the optimizer)."""
    if warmup_iters > 0 and k <= warmup_iters:
        return max_lr * k / warmup_iters
    if style == "constant":
        return max_lr
    if k > decay_iters:
        return min_lr
    progress = (k - warmup_iters) / (decay_iters - warmup_iters)
    if style == "linear":
        return max_lr - (max_lr - min_lr) * progress
    return min_lr + (max_lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_iteration_based_schedule_matches_megatron_formula(style):
    t = training_cfg(train_iters=100, lr_warmup_iters=10, lr_decay_iters=80, lr_decay_style=style)
    sched = LearningRateSchedule.from_config(t)
    for k in range(0, 101):
        expected = megatron_lr_by_iteration(k, t.lr, t.min_lr, 10, 80, style)
        assert sched.lr_at(k, k * t.global_batch_size) == pytest.approx(expected, rel=1e-12, abs=1e-18), k
    assert sched.lr_at(0, 0) == 0.0  # Megatron trains the first warmup iteration at LR 0
    assert sched.lr_at(10, 80) == pytest.approx(t.lr)
    if style != "constant":
        assert sched.lr_at(80, 640) == pytest.approx(t.min_lr)
        assert sched.lr_at(95, 760) == t.min_lr
    # the cosine midpoint is the mean of max and min
    if style == "cosine":
        assert sched.lr_at(45, 360) == pytest.approx((t.lr + t.min_lr) / 2)


def test_decay_defaults_to_train_length():
    t = training_cfg(train_iters=50, lr_warmup_iters=0, lr_decay_style="linear")
    sched = LearningRateSchedule.from_config(t)
    assert sched.lr_at(25, 200) == pytest.approx((t.lr + t.min_lr) / 2)
    assert sched.lr_at(0, 0) == t.lr  # no warmup: the first iteration uses the peak LR


def test_sample_based_schedule_through_rampup():
    """Megatron's loop: the scheduler advances by each iteration's batch; the LR used is the one before."""
    t = training_cfg(train_samples=4000, global_batch_size=32, lr_warmup_samples=500, lr_decay_samples=3000,
                     lr_decay_style="cosine", rampup_batch_size=[8, 8, 600])
    sched = LearningRateSchedule.from_config(t)
    rampup = BatchSizeRampup.from_config(t, dp_size=2)
    consumed = 0
    for k in range(train_iters(t, 2)):
        if consumed <= 500:
            expected = t.lr * consumed / 500
        elif consumed > 3000:
            expected = t.min_lr
        else:
            expected = t.min_lr + (t.lr - t.min_lr) * (1 + math.cos(math.pi * (consumed - 500) / 2500)) / 2
        # the iteration argument is ignored in sample-based mode
        assert sched.lr_at(k, consumed) == pytest.approx(expected, rel=1e-12, abs=1e-18)
        consumed += rampup.global_batch_size(consumed)


def test_state_is_a_function_of_counters():
    t = training_cfg(train_iters=30, lr_warmup_iters=3, lr_decay_style="cosine")
    a, b = LearningRateSchedule.from_config(t), LearningRateSchedule.from_config(t)
    values = [a.lr_at(k, 8 * k) for k in range(30)]
    assert [b.lr_at(k, 8 * k) for k in reversed(range(30))] == list(reversed(values))


def direct_rampup_sizes(start, increment, ramp_samples, final, consumed):
    """Exact integer form of the ramp-up, valid when ramp_samples divides by the number of increments."""
    n = (final - start) // increment
    assert ramp_samples % n == 0
    if consumed > ramp_samples:
        return final
    return start + increment * (consumed // (ramp_samples // n))


@pytest.mark.parametrize("start, increment, ramp, final, mbs, dp", [
    (32, 32, 6300, 2048, 2, 4),
    (16, 16, 1200, 256, 1, 16),
    (4, 4, 300, 16, 2, 2),
])
def test_rampup_sequence_vs_direct_simulation(start, increment, ramp, final, mbs, dp):
    r = BatchSizeRampup(final, mbs, dp, start, increment, ramp)
    consumed, sizes = 0, []
    while consumed < 2 * ramp + 10 * final:
        gbs = r.global_batch_size(consumed)
        assert gbs == direct_rampup_sizes(start, increment, ramp, final, consumed), consumed
        assert r.num_micro_batches(consumed) * mbs * dp == gbs
        sizes.append(gbs)
        consumed += gbs
    assert sizes[0] == start and sizes[-1] == final
    assert sizes == sorted(sizes)
    assert set(sizes) <= set(range(start, final + 1, increment))


def test_rampup_boundary_follows_megatron_float_arithmetic():
    # 9 ramp samples over 7 increments: Megatron divides by the float 9 / 7, and at exactly 9 consumed
    # samples (not > 9) int(9 / (9 / 7)) == 6 where exact arithmetic gives 7: keep Megatron's batch size.
    assert int(9 / (9 / 7)) == 6
    r = BatchSizeRampup(8, 1, 1, 1, 1, 9)
    assert r.global_batch_size(9) == 1 + 6
    assert r.global_batch_size(10) == 8


def test_train_iters_vs_simulation():
    t = training_cfg(train_samples=5000, global_batch_size=64, rampup_batch_size=[16, 16, 1000])
    r = BatchSizeRampup.from_config(t, dp_size=4)
    consumed = iters = 0
    while consumed + r.global_batch_size(consumed) <= t.train_samples:  # whole batches only
        consumed += r.global_batch_size(consumed)
        iters += 1
    assert train_iters(t, 4) == iters
    constant = training_cfg(train_samples=5000, global_batch_size=64)
    assert train_iters(constant, 4) == 5000 // 64
    assert train_iters(training_cfg(train_iters=7), 4) == 7


@pytest.mark.parametrize("start, increment, ramp, final, mbs, dp", [(16, 16, 1200, 64, 1, 4), (4, 4, 300, 16, 2, 2),
                                                                    (None, 0, 0, 64, 1, 4)])
def test_samples_after_vs_direct_simulation(start, increment, ramp, final, mbs, dp):
    """The samples the first k iterations consume (the trainer's time left counts what is still to train)."""
    r = BatchSizeRampup(final, mbs, dp, start, increment, ramp)
    consumed = 0
    for k in range(200):
        assert r.samples_after(k) == consumed, k
        consumed += direct_rampup_sizes(start, increment, ramp, final, consumed) if start else final


def test_rampup_rejects_bad_arithmetic():
    with pytest.raises(ValueError):
        BatchSizeRampup(16, 2, 2, 6, 2, 100)  # start not a multiple of micro x dp
    with pytest.raises(ValueError):
        BatchSizeRampup(16, 2, 2, 4, 8, 100)  # 16 - 4 does not divide by 8
