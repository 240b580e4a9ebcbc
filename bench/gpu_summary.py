"""The figures of `bash bench/gpu.sh speed` in one place: the rounds' ratios (bench/rounds.py), each run's tokens/s
and memory peaks, the loss checks, the tree that ran and the call's wall time.

    python bench/gpu_summary.py --out gpu_out          # -> gpu_out/summary.{json,txt}
    python bench/gpu_summary.py --tree --out gpu_out   # the tree that runs here: one line, and gpu_out/tree.json

**The rounds** (OUT/rounds/, bench/rounds.py): the peer, the trainer in bf16 and in fp8 (and any other run given
turns) took turns on one device, each turn `warmup` untimed then `timed` timed iterations. A turn's seconds per
iteration are the median of its timed iterations, read from the run's own numbers: the peer's own timings
(between device synchronisations) in its `done` record, the trainer's log-line time per iteration (its metrics file,
one record per iteration) at the iterations its `done` record names. A ratio (`RATIOS`: tokens/s of one run over
another's, the same tokens per iteration asserted) is taken within each round, between turns seconds apart; the
summary gives each round's, their median and the worst round, against the targets. Memory: each run's peaks over
the whole run (its last `done` record: the caching allocator's max allocated and max reserved on CUDA), and the
largest of any `max`/`peak` ... `allocated`/`reserved` field the trainer's metrics records carry.

The tree that ran: tree.json, which `--tree --out` records before the runs (the git tree id of the files as they
are, the commit the copy's .git names, the paths that differ from it). Also read when present (earlier calls'
layouts): peer_compiled.json (bench_peer_loop.py), trainer_*.jsonl and
.log (one run each; the Megatron memory line gives its peak), layer_{bf16,fp8}.json (bench_layer.py). A missing
file is left out, not fatal. A single trainer run's seconds per iteration are the median over its iterations after
the first `SKIP` (the compile, allocator growth, autotuning).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gptpar.training.reporting import is_training_record, read_metrics  # noqa: E402

SKIP = 3
TARGETS = {"trainer_compiled_vs_peer_compiled": 1.05,   # tokens/s, same shape, batch and GPU
           "layer_fp8_vs_bf16": 1.3,                     # forward + backward of one 200B tp-8 layer
           "trainer_fp8_vs_compiled": 1.0}               # fp8 faster than bf16 at 1.3B
# Last logged loss of fp8 against bf16's (fp8's accuracy bound), and of the compiled run against the eager one
# (dropout 0.1 draws other masks under compile, and bf16 GEMMs differ run to run: the same bound as gpu_trainer.py).
LOSS_BOUNDS = {"fp8_vs_bf16": 0.02, "compiled_vs_eager": 0.02, "as_before": 1e-3, "as_unfused": 1e-3}
TRAINERS = ("trainer_compiled", "trainer_fp8", "trainer_eager", "trainer_compiled_before", "trainer_compiled_unfused")
# Rounds: ratio name -> (run, the run it is over, median target, target for every round); None: no target.
RATIOS = {"bf16_vs_peer": ("bf16", "peer", 1.08, 1.03), "fp8_vs_bf16": ("fp8", "bf16", 1.20, None),
          "bf16_vs_before": ("bf16", "before", None, None)}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def peak_memory_gib(records, key="max_allocated_bytes"):
    """The run's peak: the largest of its records' memory field `key` (each the peak so far, the largest over the
    ranks), in GiB; None when the records have none."""
    peaks = [r[key] for r in records if r.get(key) is not None]
    return max(peaks) / 2 ** 30 if peaks else None


def compile_seconds(log_path):
    try:
        with open(log_path, errors="replace") as f:
            found = re.findall(r"compil\w* [^\n]*?([0-9.]+) ?s\b", f.read())
    except OSError:
        return None
    return float(found[0]) if found else None


def trainer_figures(out_dir, name):
    """Median s/iteration, tokens/s and TFLOPs of a trainer run (train records after the first SKIP), its losses
    and the peak memory its log reports."""
    try:
        recs = [r for r in read_metrics(os.path.join(out_dir, name + ".jsonl")) if is_training_record(r)]
    except OSError:
        return None
    if not recs:
        return None
    timed = [r for r in recs if r["iteration"] > SKIP] or recs
    sec = statistics.median(r["elapsed_s"] for r in timed)
    tokens_per_sample = recs[-1]["consumed_tokens"] // recs[-1]["consumed_samples"]
    log = os.path.join(out_dir, name + ".log")
    return {"iterations": len(recs), "timed_iterations": len(timed), "sec_per_iter_median": sec,
            "global_batch_size": timed[-1]["global_batch_size"],
            "tokens_per_s": timed[-1]["global_batch_size"] * tokens_per_sample / sec,
            "tflops_median": statistics.median(r["tflops"] for r in timed),
            "lm_loss": [r["lm_loss"] for r in recs], "peak_memory_gib": peak_memory_gib(recs),
            "peak_reserved_gib": peak_memory_gib(recs, "max_reserved_bytes"), "compile_s": compile_seconds(log)}


def layer_figures(path):
    cal = _load_json(path)
    if not cal:
        return None
    mode = cal["modes"].get("none") or next(iter(cal["modes"].values()))
    return {"sec_per_layer": mode["sec_per_layer"], "tflops": mode["tflops"], "gpu": cal.get("gpu"),
            "sec_per_layer_uncached": mode.get("sec_per_layer_uncached"),
            "cached_vs_uncached_max_abs_diff": mode.get("cached_vs_uncached_max_abs_diff"),
            "peak_memory_gib": mode.get("peak_memory_gib"), "shape": cal.get("shape"), "gemms": cal.get("float8_gemms")}


def _ratio(a, b):
    return a / b if a and b else None


def _git(root, *args, env=None):
    out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise OSError(out.stderr.strip() or f"git {' '.join(args)} failed")
    return out.stdout


def tree_state(root):
    """What tree runs in `root`: {"commit": its .git's HEAD, "tree": the git tree id of the files as they are
    (tracked and untracked but not ignored: what a commit of them would hold, so the commit whose tree this is can
    be found later with `git rev-parse COMMIT^{tree}`), "changed": the paths that differ from the commit}. A copy
    whose .git is older than its files shows as that commit with changes. {"error": why} without git."""
    try:
        commit = _git(root, "rev-parse", "HEAD").strip()
        changed = [line[3:] for line in _git(root, "status", "--porcelain", "--untracked-files=all",
                                             env=dict(os.environ, GIT_OPTIONAL_LOCKS="0")).splitlines()]
        git_dir = os.path.abspath(os.path.join(root, _git(root, "rev-parse", "--git-common-dir").strip()))
        with tempfile.TemporaryDirectory() as scratch:  # nothing written into the repository
            os.makedirs(os.path.join(scratch, "objects"))
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(scratch, "index"),
                       GIT_OBJECT_DIRECTORY=os.path.join(scratch, "objects"),
                       GIT_ALTERNATE_OBJECT_DIRECTORIES=os.path.join(git_dir, "objects"))
            _git(root, "read-tree", "HEAD", env=env)
            _git(root, "add", "-A", env=env)
            tree = _git(root, "write-tree", env=env).strip()
    except (OSError, FileNotFoundError) as e:
        return {"error": str(e)}
    return {"commit": commit, "tree": tree, "changed": changed}


def describe_tree(state):
    """One line for `tree_state`'s answer."""
    if "error" in state:
        return f"tree unknown ({state['error']})"
    changed = state["changed"]
    shown = ", ".join(changed[:8]) + (f", ... ({len(changed)} in all)" if len(changed) > 8 else "")
    return (f"tree {state['tree'][:12]} = commit {state['commit'][:12]}" if not changed else
            f"tree {state['tree'][:12]} = commit {state['commit'][:12]} with changes to {len(changed)} path(s): "
            f"{shown}")


def _peak(t):
    if t["peak_memory_gib"] is None:
        return "peak memory not recorded"
    reserved = f" ({t['peak_reserved_gib']:.1f} reserved)" if t["peak_reserved_gib"] is not None else ""
    return f"peak {t['peak_memory_gib']:.1f} GiB allocated{reserved} over the run"


def _trainer_turn(record: dict, out_dir: str):
    """(seconds per timed iteration, tokens per iteration, losses by iteration, memory fields) of a trainer's turn,
    from its metrics file at the iterations the turn names."""
    path = record["metrics_file"]
    path = path if os.path.isabs(path) else os.path.join(ROOT, path)
    recs = {r["iteration"]: r for r in read_metrics(path) if "lm_loss" in r and not r.get("eval")
            and not r.get("timers")}
    timed = [recs[i] for i in record["timed_iterations"]]
    tokens = timed[-1]["global_batch_size"] * (timed[-1]["consumed_tokens"] // timed[-1]["consumed_samples"])
    memory = {}
    for r in recs.values():
        for key, value in r.items():
            low = key.lower()
            peak = ("max" in low or "peak" in low) and ("alloc" in low or "reserv" in low)
            if peak and isinstance(value, (int, float)):
                memory[key] = max(memory.get(key, value), value)
    return [r["elapsed_s"] for r in timed], tokens, {i: r["lm_loss"] for i, r in recs.items()}, memory


def rounds_figures(out_dir: str):
    """Per round and run: the turn's median seconds per iteration and tokens/s; per ratio of RATIOS: each round's,
    the median and the worst; per run: memory peaks, losses. None when the call ran no rounds."""
    directory = os.path.join(out_dir, "rounds")
    try:
        with open(os.path.join(directory, "turns.jsonl")) as f:
            turns = [json.loads(line) for line in f if line.strip()]
    except OSError:
        return None
    runs, rounds = {}, {}
    for turn in turns:
        name, r = turn["name"], turn["round"]
        record = _load_json(os.path.join(directory, f"done.{name}.{r}"))
        run = runs.setdefault(name, {"turns": {}, "memory_bytes": None, "metrics_memory": {}, "lm_loss": None})
        if "metrics_file" in record:
            secs, tokens, losses, memory = _trainer_turn(record, out_dir)
            run["lm_loss"] = losses
            run["metrics_memory"] = memory
        else:
            secs, tokens = record["sec_per_iter"], record["tokens_per_iteration"]
        if record.get("memory_bytes"):
            run["memory_bytes"] = record["memory_bytes"]
        sec = statistics.median(secs)
        run["turns"][r] = {"sec_per_iter": secs, "sec_per_iter_median": sec, "tokens_per_iteration": tokens,
                           "tokens_per_s": tokens / sec, "place": turn["place"],
                           "turn_s": turn["end_s"] - turn["start_s"]}
        rounds.setdefault(r, {})[name] = run["turns"][r]
    ratios = {}
    for key, (a, b, median_target, every_target) in RATIOS.items():
        per_round = {r: by[a]["tokens_per_s"] / by[b]["tokens_per_s"] for r, by in sorted(rounds.items())
                     if a in by and b in by}
        if not per_round:
            continue
        same_tokens = all(by[a]["tokens_per_iteration"] == by[b]["tokens_per_iteration"] for by in rounds.values()
                          if a in by and b in by)
        values = list(per_round.values())
        ratio = {"per_round": per_round, "median": statistics.median(values), "worst": min(values),
                 "spread": max(values) - min(values), "same_tokens_per_iteration": same_tokens,
                 "median_target": median_target, "every_round_target": every_target}
        every_round = every_target is None or ratio["worst"] >= every_target
        met = same_tokens and ratio["median"] >= median_target and every_round if median_target is not None else None
        ratio["met"] = met
        ratios[key] = ratio
    return {"runs": runs, "rounds": rounds, "ratios": ratios}


def rounds_lines(fig: dict) -> list:
    lines = []
    names = list(fig["runs"])
    for r, by in sorted(fig["rounds"].items()):
        order = sorted(by, key=lambda n: by[n]["place"])
        lines.append(f"round {r}: " + ", ".join(f"{n} {by[n]['sec_per_iter_median']:.4f} s/iter "
                                                 f"({by[n]['tokens_per_s']:,.0f} tokens/s)" for n in order))
    for name in names:
        secs = [t["sec_per_iter_median"] for t in fig["runs"][name]["turns"].values()]
        lines.append(f"{name}: rounds' medians {min(secs):.4f}-{max(secs):.4f} s/iter "
                     f"(spread {(max(secs) - min(secs)) / min(secs) * 100:.2f}%)")
    for key, ratio in fig["ratios"].items():
        target = ""
        if ratio["median_target"] is not None:
            target = (f" (target median >= {ratio['median_target']}"
                      + (f", every round >= {ratio['every_round_target']}" if ratio["every_round_target"] else "")
                      + f": {'met' if ratio['met'] else 'NOT met'})")
        tokens = "" if ratio["same_tokens_per_iteration"] else " (NOT the same tokens per iteration)"
        lines.append(f"ratio {key} (tokens/s): median {ratio['median']:.3f}, worst round {ratio['worst']:.3f}, rounds "
                     + " ".join(f"{v:.3f}" for v in ratio["per_round"].values()) + target + tokens)
    for name in names:
        run = fig["runs"][name]
        peaks = ", ".join(f"{label} {value / 2 ** 30:.2f} GiB" for label, value in (run["memory_bytes"] or {}).items()
                          if label.startswith("max"))
        metrics = ", ".join(f"{k} {v}" for k, v in run["metrics_memory"].items())
        lines.append(f"{name}: memory peaks over the run: {peaks or 'not reported'}"
                     + (f"; in its metrics records: {metrics}" if metrics else ""))
    return lines


def summarize(out_dir, call_start=None):
    """Every figure the call's files hold (see the module's docstring), as {..., "lines": the text summary}.
    `call_start`: the call's start (epoch seconds), for its wall time up to this summary."""
    res = {"tree": _load_json(os.path.join(out_dir, "tree.json")),  # recorded before the runs (--tree --out)
           "call_seconds_to_summary": None if call_start is None else time.time() - call_start}
    lines = [describe_tree(res["tree"]) if res["tree"] is not None else "tree: not recorded (no tree.json)"]
    if call_start is not None:
        lines.append(f"call wall time up to the summary: {res['call_seconds_to_summary']:.0f} s")
    checks = {}
    fig = res["rounds"] = rounds_figures(out_dir)
    if fig is not None:
        lines += rounds_lines(fig)
        checks.update(rounds_loss_checks(fig, lines))
    legacy_lines, legacy_checks = legacy_summary(out_dir, res)
    lines += legacy_lines
    checks.update(legacy_checks)
    res["checks"], res["lines"] = checks, lines
    return res


def rounds_loss_checks(fig: dict, lines: list) -> dict:
    """The trainers' losses at the same iterations: fp8's last against bf16's (LOSS_BOUNDS["fp8_vs_bf16"]), bf16's
    at every iteration against an earlier tree's (`before`, LOSS_BOUNDS["as_before"]), and bf16's falling."""
    checks = {}
    losses = {name: run["lm_loss"] for name, run in fig["runs"].items() if run["lm_loss"]}
    bf16 = losses.get("bf16")
    for name, key, every in (("fp8", "fp8_vs_bf16", False), ("before", "as_before", True)):
        other = losses.get(name)
        if not bf16 or not other or set(bf16) != set(other):
            continue
        iters = sorted(bf16) if every else [max(bf16)]
        diff = max(abs(other[i] - bf16[i]) / abs(bf16[i]) for i in iters)
        checks[f"losses_{key}"] = {"largest_relative_difference": diff, "iterations": len(iters),
                                   "bound": LOSS_BOUNDS[key], "within": diff <= LOSS_BOUNDS[key]}
        lines.append(f"losses {name} vs bf16 ({'every iteration' if every else 'the last iteration'}): relative "
                     f"difference {diff:.2g} (bound {LOSS_BOUNDS[key]}: "
                     f"{'within' if diff <= LOSS_BOUNDS[key] else 'NOT within'})")
    if bf16:
        checks["bf16_loss_falls"] = bf16[max(bf16)] < bf16[min(bf16)]
    return checks


def legacy_summary(out_dir, res):
    """The figures of single runs (earlier calls' layout), for the files present: (lines, checks); fills `res`."""
    peer = _load_json(os.path.join(out_dir, "peer_compiled.json"))
    if peer and "peer" in peer:  # bench_peer_loop.py --gptpar: the peer and gptpar's model alone, same process
        res.update({"peer_compiled": peer["peer"], "model_alone_compiled": peer["gptpar"]})
    else:
        res.update({"peer_compiled": peer, "model_alone_compiled": None})
    res.update({name: trainer_figures(out_dir, name) for name in TRAINERS})
    res.update({f"layer_{kind}": layer_figures(os.path.join(out_dir, f"layer_{kind}.json"))
                for kind in ("bf16", "fp8")})
    lines = []
    peer = res["peer_compiled"]
    if peer:
        lines.append(f"peer_compiled: {peer['sec_per_iter_median']:.3f} s/iter, {peer['tokens_per_s']:,.0f} tokens/s, "
                     f"{peer['tflops']:.1f} TFLOPs, peak {peer.get('peak_memory_gib') or float('nan'):.1f} GiB "
                     f"({peer['device']})")
    alone = res["model_alone_compiled"]
    if alone:
        lines.append(f"model_alone_compiled: {alone['sec_per_iter_median']:.3f} s/iter, {alone['tokens_per_s']:,.0f} "
                     "tokens/s (gptpar's GPTModel in the peer's loop: fp32 parameters, bf16 autocast, no DeepSpeed)")
    for name in TRAINERS:
        t = res[name]
        if t:
            lines.append(f"{name}: {t['sec_per_iter_median']:.3f} s/iter (median of {t['timed_iterations']}), "
                         f"{t['tokens_per_s']:,.0f} tokens/s, {t['tflops_median']:.1f} TFLOPs (log line), {_peak(t)}, "
                         f"compile {t['compile_s'] if t['compile_s'] is not None else '-'} s, last loss "
                         f"{t['lm_loss'][-1]:.4f}")
    for kind in ("bf16", "fp8"):
        lay = res[f"layer_{kind}"]
        if lay:
            lines.append(f"layer_{kind}: {lay['sec_per_layer'] * 1e3:.2f} ms fwd+bwd, {lay['tflops']:.0f} TFLOPs")
        if lay and lay.get("sec_per_layer_uncached"):
            lines.append(f"layer_{kind} with the weights cast every micro-batch: "
                         f"{lay['sec_per_layer_uncached'] * 1e3:.2f} ms (cached vs uncached max abs differences "
                         f"{lay['cached_vs_uncached_max_abs_diff']})")
    tc, te, t8 = res["trainer_compiled"], res["trainer_eager"], res["trainer_fp8"]
    same_batch = bool(tc and peer and tc["global_batch_size"] == peer["global_batch_size"])
    ratios = {"trainer_compiled_vs_peer_compiled": _ratio(tc and tc["tokens_per_s"], peer and same_batch
                                                          and peer["tokens_per_s"]),
              "model_alone_vs_peer_compiled": _ratio(alone and alone["tokens_per_s"], peer and peer["tokens_per_s"]),
              "trainer_compiled_vs_before": _ratio(tc and tc["tokens_per_s"], res["trainer_compiled_before"]
                                                   and res["trainer_compiled_before"]["tokens_per_s"]),
              "trainer_compiled_vs_unfused": _ratio(tc and tc["tokens_per_s"], res["trainer_compiled_unfused"]
                                                    and res["trainer_compiled_unfused"]["tokens_per_s"]),
              "trainer_compiled_vs_eager": _ratio(tc and tc["tokens_per_s"], te and te["tokens_per_s"]),
              "trainer_fp8_vs_compiled": _ratio(t8 and t8["tokens_per_s"], tc and tc["tokens_per_s"]),
              "layer_fp8_vs_bf16": _ratio(res["layer_bf16"] and res["layer_bf16"]["sec_per_layer"],
                                          res["layer_fp8"] and res["layer_fp8"]["sec_per_layer"]),
              "layer_fp8_uncached_vs_bf16": _ratio(res["layer_bf16"] and res["layer_bf16"]["sec_per_layer"],
                                                   res["layer_fp8"] and res["layer_fp8"]["sec_per_layer_uncached"])}
    res["ratios"] = ratios
    for key, value in ratios.items():
        if value is None:
            continue
        target = TARGETS.get(key)
        verdict = "" if target is None else f" (target >= {target}: {'met' if value >= target else 'NOT met'})"
        lines.append(f"ratio {key}: {value:.3f}{verdict}")
    checks = {}
    for key, other in (("as_before", "trainer_compiled_before"), ("as_unfused", "trainer_compiled_unfused")):
        tb = res[other]
        if tc and tb and len(tc["lm_loss"]) == len(tb["lm_loss"]):
            # A speed change trains the same model on the same data with the same dropout masks: only rounding may
            # differ (inductor fuses differently; the fused gradient accumulation rounds less).
            diff = max(abs(a - b) / abs(b) for a, b in zip(tc["lm_loss"], tb["lm_loss"]))
            checks[f"losses_{key}"] = {"largest_relative_difference": diff, "bound": LOSS_BOUNDS[key],
                                       "within": diff <= LOSS_BOUNDS[key]}
            lines.append(f"losses of trainer_compiled vs {other}, every iteration: largest relative "
                         f"difference {diff:.2g} (bound {LOSS_BOUNDS[key]}: "
                         f"{'within' if diff <= LOSS_BOUNDS[key] else 'NOT within'})")
    for key, (a, b) in {"fp8_vs_bf16": (t8, tc), "compiled_vs_eager": (tc, te)}.items():
        if a and b and len(a["lm_loss"]) == len(b["lm_loss"]):
            diff = abs(a["lm_loss"][-1] - b["lm_loss"][-1]) / abs(b["lm_loss"][-1])
            checks[f"last_loss_{key}"] = {"relative_difference": diff, "bound": LOSS_BOUNDS[key],
                                          "within": diff <= LOSS_BOUNDS[key]}
            lines.append(f"last loss {key}: relative difference {diff:.4f} (bound {LOSS_BOUNDS[key]}: "
                         f"{'within' if diff <= LOSS_BOUNDS[key] else 'NOT within'})")
    if tc:
        checks["trainer_loss_falls"] = tc["lm_loss"][-1] < tc["lm_loss"][0]
    return lines, checks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="the folder bench/gpu.sh speed wrote")
    p.add_argument("--call-start", type=float, default=None, help="the call's start, epoch seconds (its wall time)")
    p.add_argument("--tree", action="store_true", help="print the tree that runs here (commit and changes; with --out "
                                                       "also OUT/tree.json) and exit")
    p.add_argument("--root", default=ROOT, help="the repository whose tree is recorded (default: this one)")
    args = p.parse_args(argv)
    if args.tree:
        state = tree_state(args.root)
        print(describe_tree(state))
        if args.out:
            with open(os.path.join(args.out, "tree.json"), "w") as f:
                json.dump(state, f, indent=1)
        return
    if not args.out:
        p.error("--out is required (or --tree)")
    res = summarize(args.out, args.call_start)
    text = "\n".join(res["lines"])
    print(text)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
