"""tools/plot_metrics.py: the PNG it writes, and every plotted series (the figure's Line2D data) against the
metrics files it read, for eval records of older files and for named validation sets (`valid_set`, with consumed
tokens, written by the trainer's MetricsWriter), two runs overlaid. Errors: one line, exit 2."""
import json
import math
import os

import pytest

from gptpar.training.reporting import METRIC_KEYS, MetricsWriter, eval_record, read_metrics

pytest.importorskip("matplotlib", reason="tools/plot_metrics.py needs matplotlib")
from gptpar.tools import plot_metrics  # noqa: E402 (after the skip: it imports matplotlib)

SEQ, GBS = 16, 8


def train_record(iteration, grad_norm):
    """A logged iteration with every key of the metrics contract."""
    samples = iteration * GBS
    record = {key: None for key in METRIC_KEYS}
    record.update(iteration=iteration, train_iters=12, consumed_samples=samples, consumed_tokens=samples * SEQ,
                  elapsed_s=0.5, lr=1e-3 * iteration / 12, global_batch_size=GBS, lm_loss=6.0 - 0.1 * iteration,
                  loss_scale=2.0 ** (16 - iteration), grad_norm=grad_norm, skipped_iterations=0, nan_iterations=0,
                  samples_per_second=GBS / 0.5, tflops=0.01 * iteration)
    return record


def write_jsonl(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    return [r for r in records]


@pytest.fixture(scope="module")
def plotted(tmp_path_factory):
    d = tmp_path_factory.mktemp("plot")
    # run "plain": eval records as files written before named sets had them (consumed samples only, one set), an
    # overflow-skipped step's None grad norm, a timers record
    plain = write_jsonl(str(d / "plain" / "metrics.jsonl"),
                        [train_record(i, None if i == 6 else 1.0 / i) for i in range(1, 13)]
                        + [{"eval": True, "iteration": i, "consumed_samples": i * GBS, "lm_loss": 5.0 + 1 / i,
                            "ppl": math.exp(5.0 + 1 / i)} for i in (4, 8, 12)]
                        + [{"timers": True, "iteration": 12, "ms_per_iteration": {"forward": 1.0}}])
    # run "named": written by the trainer's own MetricsWriter: named validation sets and their weighted total
    # (eval records carrying their set and consumed tokens), and an iteration of skipped data
    path = str(d / "named.jsonl")
    writer = MetricsWriter(path)
    for i in range(2, 13, 2):
        writer.write(train_record(i, 0.5))
        if i % 6 == 0:
            for name, loss in (("en", 4.0 + 1 / i), ("fr", 4.5 + 1 / i), (None, 4.25 + 1 / i)):
                writer.write_eval(eval_record(i, i * GBS, i * GBS * SEQ, loss, valid_set=name))
    writer.write_skipped_data(13, 13 * GBS, 13 * GBS * SEQ, GBS, 1e-3)
    named = read_metrics(path)
    out = str(d / "out" / "curves.png")
    fig = plot_metrics.write_plot([str(d / "plain"), str(d / "named.jsonl")], out)
    return fig, out, {"plain": plain, "named": named}


def lines(fig, title):
    """{label: (x, y)} of the panel titled `title`."""
    (ax,) = [ax for ax in fig.axes if ax.get_title() == title]
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_the_output_is_a_png(plotted):
    from PIL import Image

    _, out, _ = plotted
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with Image.open(out) as image:
        image.verify()
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1600, 850)


def test_loss_series_equal_the_metrics_files(plotted):
    fig, _, runs = plotted
    train = lambda run: [r for r in runs[run] if "train_iters" in r]
    evals = lambda run, name: [r for r in runs[run] if r.get("eval") and r.get("valid_set") == name]
    expected = {
        "plain train": ([r["consumed_tokens"] for r in train("plain")], [r["lm_loss"] for r in train("plain")]),
        # no consumed_tokens in today's eval records: samples x the run's tokens per sample
        "plain validation": ([r["consumed_samples"] * SEQ for r in evals("plain", None)],
                             [r["lm_loss"] for r in evals("plain", None)]),
        "named train": ([r["consumed_tokens"] for r in train("named")], [r["lm_loss"] for r in train("named")]),
    }
    for name in ("en", "fr", None):
        expected[f"named {name or 'validation total'}"] = ([r["consumed_tokens"] for r in evals("named", name)],
                                                     [r["lm_loss"] for r in evals("named", name)])
    assert lines(fig, "lm loss") == expected


@pytest.mark.parametrize("title, key", [(title, key) for title, key, _ in plot_metrics.PANELS])
def test_other_panels_equal_the_metrics_files(plotted, title, key):
    fig, _, runs = plotted
    expected = {run: ([r["consumed_tokens"] for r in records if "train_iters" in r and r[key] is not None],
                      [r[key] for r in records if "train_iters" in r and r[key] is not None])
                for run, records in runs.items()}
    assert lines(fig, title) == expected
    if key == "grad_norm":  # the overflow-skipped step has no norm: left out, not drawn as 0
        assert len(expected["plain"][0]) == 11


def test_errors_name_the_argument_and_the_fix(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "evals.jsonl").write_text(json.dumps({"eval": True, "iteration": 1, "consumed_samples": 8,
                                                      "lm_loss": 5.0, "ppl": 148.4}) + "\n")
    for args, words in ((["missing.jsonl"], "missing.jsonl: no such file"),
                        ([str(tmp_path / "empty")], "holds no metrics.jsonl"),
                        ([str(tmp_path / "evals.jsonl")], "no training records")):
        assert plot_metrics.main(args + ["--output", str(tmp_path / "x.png")]) == 2
        assert words in capsys.readouterr().err
    assert plot_metrics.main([str(tmp_path / "evals.jsonl"), "--output", str(tmp_path / "x.jpg")]) == 2
    assert "FILE.png" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
