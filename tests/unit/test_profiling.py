"""logging.profile's idle-gap report (gptpar.training.profiling.idle_gaps): where a GPU waited for the host.

The report runs on a GPU only (the CPU has no kernels to wait between); here its arithmetic is checked against
gaps worked out by hand from a made-up timeline (times in us)."""
from gptpar.training.profiling import format_idle_gaps, idle_gaps

# Kernels on two streams: [0, 100] and [50, 120] overlap (one busy span), then [125, 200] (a 5 us gap: under the
# threshold), [700, 900], [910, 1000] (10 us: under), [1300, 1400].
KERNELS = [(700, 900), (0, 100), (50, 120), (125, 200), (1300, 1400), (910, 1000)]
HOST = [(0, 1500, "iteration"), (150, 800, "optimizer.step"), (300, 600, "aten::item"),
        (1000, 1290, "data"), (1100, 1200, "aten::copy_"), (1250, 1290, "forward")]


def test_idle_gaps_against_the_timeline_by_hand():
    gaps = idle_gaps(KERNELS, HOST, min_us=20)
    assert gaps["count"] == 2 and gaps["total_us"] == 500 + 300  # 200 -> 700 and 1000 -> 1300
    first, second = gaps["longest"]
    assert (first["us"], first["start_us"]) == (500, 200)
    assert first["host"] == ["iteration", "optimizer.step", "aten::item"]  # spanning 450, outermost first
    assert (second["us"], second["start_us"]) == (300, 1000)
    assert second["host"] == ["iteration", "data", "aten::copy_"]  # at 1150 the copy runs: innermost last
    assert idle_gaps(KERNELS, HOST, min_us=20, top=1)["longest"] == [first]
    assert idle_gaps(KERNELS, HOST, min_us=1)["count"] == 4  # the 5 and 10 us gaps too


def test_idle_gap_lines():
    text = format_idle_gaps(idle_gaps(KERNELS, HOST, min_us=20), depth=2)
    assert text.splitlines() == [
        "device idle between kernels: 0.80 ms in 2 gaps of >= 20 us; the longest:",
        "     0.500 ms at +0.2 ms, host in: iteration > optimizer.step",
        "     0.300 ms at +1.0 ms, host in: iteration > data"]


def test_a_run_stopping_inside_the_range_still_reports():
    """`finish` at the run's end: a stop after iteration 3 of a "2-4" range reports iterations 2-3, once; a run
    that never reached the range, or that finished it, reports nothing more."""
    import torch

    from gptpar.training.profiling import IterationProfiler

    said = []
    profiler = IterationProfiler("2-4", None, 0, torch.device("cpu"), said.append)
    x = torch.randn(64, 64)
    for iteration in (1, 2, 3):
        profiler.before(iteration)
        x = x @ x.T / 64
        profiler.after(iteration)
    assert said == []
    profiler.finish(3)
    profiler.finish(3)
    assert len(said) == 1 and said[0].startswith(
        "logging.profile: iterations 2-3 on rank 0 (the run stopped before iteration 4): ") and "aten::mm" in said[0]
    early = IterationProfiler("5-6", None, 0, torch.device("cpu"), said.append)
    early.before(1)
    early.finish(1)
    done = IterationProfiler("1-1", None, 0, torch.device("cpu"), said.append)
    done.before(1)
    done.after(1)
    done.finish(1)
    assert len(said) == 2 and said[1].startswith("logging.profile: iterations 1-1 on rank 0: ")
