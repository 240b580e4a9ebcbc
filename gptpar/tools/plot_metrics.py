"""Loss curves as a picture: the metrics files of one or more runs, overlaid, against consumed tokens.

    python tools/plot_metrics.py runs/demo --output runs/demo/metrics.png
    python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --output compare.png

Each argument is a metrics file (`logging.metrics_file`, JSONL) or a run folder holding `metrics.jsonl`. Five
panels, each against consumed tokens: lm loss (training, and every validation set: an eval record's
`valid_set` names its set; one without is the only set, "validation", or the weighted total over named ones,
"validation total"), learning rate, grad norm, loss scale and TFLOPs per GPU. A run is labelled by its folder
(its file name when that is not `metrics.jsonl`). matplotlib (`pip install matplotlib`) is imported here only,
with the headless Agg backend. Exit 2, with one line naming the argument and the fix, for a path that holds no
metrics.
"""
import argparse
import os
import sys


from gptpar.config import package_installed
from gptpar.training.reporting import is_training_record, read_metrics

# (panel title, record key, y scale) for the panels after lm loss; each against consumed tokens.
PANELS = (("learning rate", "lr", "linear"), ("grad norm", "grad_norm", "linear"),
          ("loss scale", "loss_scale", "log"), ("TFLOPs per GPU", "tflops", "linear"))


def metrics_path(arg: str) -> str:
    """The metrics file an argument names: the file itself, or `metrics.jsonl` in a run folder."""
    path = os.path.join(arg, "metrics.jsonl") if os.path.isdir(arg) else arg
    if not os.path.isfile(path):
        where = f"{arg} holds no metrics.jsonl" if os.path.isdir(arg) else f"{arg}: no such file"
        raise ValueError(f"{where}: give a metrics file (logging.metrics_file) or the run folder holding it")
    return path


def run_label(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.basename(folder) if name == "metrics.jsonl" else os.path.splitext(name)[0]


def split_records(records: list, path: str = "metrics"):
    """(training records, {validation set label: eval records}), each with its x value "tokens" added.

    Training records are the logged iterations (`is_training_record`). Eval records written before they
    carried consumed_tokens get consumed_samples x the run's tokens per sample (from its training records)."""
    train = [dict(r, tokens=r["consumed_tokens"]) for r in records if is_training_record(r)]
    if not train:
        raise ValueError(f"{path}: no training records (logged iterations): is it a gptpar metrics file?")
    per_sample = next((r["consumed_tokens"] / r["consumed_samples"] for r in train if r["consumed_samples"]), 0)
    valid = {}
    for r in records:
        if r.get("eval"):
            tokens = r.get("consumed_tokens", r["consumed_samples"] * per_sample)
            valid.setdefault(r.get("valid_set"), []).append(dict(r, tokens=tokens))
    total = "validation total" if len(valid) > 1 else "validation"  # beside named sets it is their weighted total
    return train, {name or total: evals for name, evals in valid.items()}


def series(records: list, key: str):
    """(x, y) of the records that carry a value for `key` (grad norm is None after an overflow, ...)."""
    points = [(r["tokens"], r[key]) for r in records if r.get(key) is not None]
    return [x for x, _ in points], [y for _, y in points]


def plot_runs(runs: dict):
    """A matplotlib Figure of `runs` ({label: metrics records}) overlaid; one colour per run."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    loss_ax, *value_axes = axes.flat
    for index, (label, records) in enumerate(runs.items()):
        color = f"C{index % 10}"
        train, valid = split_records(records, label)
        loss_ax.plot(*series(train, "lm_loss"), color=color, label=f"{label} train")
        for k, (name, evals) in enumerate(valid.items()):
            loss_ax.plot(*series(evals, "lm_loss"), color=color, marker="os^vD*"[k % 6], linestyle="--",
                         label=f"{label} {name}")
        for ax, (_, key, _) in zip(value_axes, PANELS):
            ax.plot(*series(train, key), color=color, label=label)
    loss_ax.set_title("lm loss")
    loss_ax.legend(fontsize="small")
    for ax, (title, _, scale) in zip(value_axes, PANELS):
        ax.set_title(title)
        ax.set_yscale(scale)
    key_ax = axes.flat[-1]   # the sixth cell: which colour is which run
    key_ax.axis("off")
    key_ax.legend(*value_axes[0].get_legend_handles_labels(), loc="center", title="runs")
    for ax in axes.flat[:-1]:
        ax.set_xlabel("consumed tokens")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_plot(paths, output: str):
    """Read the metrics files or run folders `paths`, draw them overlaid into the PNG `output`; returns the
    Figure."""
    if not package_installed("matplotlib"):
        raise ValueError("tools/plot_metrics.py needs matplotlib, which is not installed: pip install matplotlib")
    runs = {}
    for arg in paths:
        path = metrics_path(arg)
        label = run_label(path)
        while label in runs:  # two runs of the same name: keep both, told apart
            label += "'"
        runs[label] = read_metrics(path)
    fig = plot_runs(runs)
    if os.path.dirname(output):
        os.makedirs(os.path.dirname(output), exist_ok=True)
    fig.savefig(output, format="png", dpi=100)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR_OR_JSONL")
    parser.add_argument("--output", required=True, metavar="FILE.png")
    args = parser.parse_args(argv)
    if not args.output.lower().endswith(".png"):
        print(f"error: --output {args.output}: the plot is a PNG; name it FILE.png", file=sys.stderr)
        return 2
    try:
        write_plot(args.runs, args.output)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(args.output)
    return 0
