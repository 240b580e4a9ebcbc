"""The Megatron-DeepSpeed log line, the metrics JSONL file, TensorBoard, and Megatron's memory report.

One logged iteration is one *record*: a dict with exactly `METRIC_KEYS`. The same record is printed as
the log line (`format_log_line(**record)`), appended to the metrics file at full precision and sent to
TensorBoard (Megatron-DeepSpeed's tags, or `train/<key>` with logging.tensorboard_tags=gptpar), so they never
disagree. One evaluation of one validation set is one *eval record* (`eval_record`), written the same way.
The phase timers (logging.timers) go to the metrics file and TensorBoard beside them, the memory in use
(`memory_usage`) to TensorBoard and once as Megatron's `report_memory` line (`format_memory_line`), its peaks to the
record's memory fields (`peak_memory_fields`; not in the line). A write that fails raises LogWriteError naming the
key; `check_log_paths` finds unwritable log paths before a run starts (LogPathError).

The line is Megatron-DeepSpeed's `training_log` output: each field is ' name: value |', in this order,
with these formats (the iteration field is ' iteration {:8d}/{:8d} |'):

    consumed samples {:12d} · consumed tokens {:12d} · elapsed time per iteration (s) {:.2f} ·
    learning rate {:.3E} · global batch size {:5d} · lm loss {:.6E} · loss scale {:.1f} · grad norm {:.3f} ·
    num zeros {:.1f} · params norm {:.3f} · number of skipped iterations {:3d} ·
    number of nan iterations {:3d} · samples per second {:.3f} · tokens per second {:.0f} · TFLOPs {:.2f} ·
    time left H:MM:SS (Dd H:MM:SS past a day)

The trainer's line holds every field Megatron-DeepSpeed's does, as the planning notes' logs show it: the loss scale
always (1.0 in fp32 and bf16, where nothing is scaled, as Megatron-DeepSpeed prints it in bf16) and both iteration
counts always, 0 included, so that parsers of those logs read gptpar's; num zeros and params norm only when asked
for (logging.log_num_zeros, logging.log_params_norm), as in Megatron. Skipped and nan iterations are counted
honestly (the reference hard-codes them). A field given as None is left out (lines of other logs, which
`parse_log_line` reads back with that field None). Tokens per second (samples per second x
seq length, as torchtitan and nanoGPT show throughput) and the time left (the samples still to train at the
interval's time per sample; evaluations and saves not counted) are gptpar's, after Megatron's fields.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
from typing import Dict, Optional

METRIC_KEYS = ("iteration", "train_iters", "consumed_samples", "consumed_tokens", "elapsed_s", "lr",
               "global_batch_size", "lm_loss", "loss_scale", "grad_norm", "num_zeros", "params_norm",
               "skipped_iterations", "nan_iterations", "samples_per_second", "tokens_per_second", "tflops",
               "time_left_s", "max_allocated_bytes", "max_reserved_bytes")
# The record's memory fields (`peak_memory_fields`): in the metrics file, not in the line.
MEMORY_KEYS = ("max_allocated_bytes", "max_reserved_bytes")
# Keys a training record gained after metrics files were first written: older files lack them.
LATER_KEYS = ("params_norm", "tokens_per_second", "time_left_s") + MEMORY_KEYS

# (label in the line, record key, format) after the iteration field, in Megatron-DeepSpeed's order.
_FIELDS = (
    ("consumed samples", "consumed_samples", "{:12d}"),
    ("consumed tokens", "consumed_tokens", "{:12d}"),
    ("elapsed time per iteration (s)", "elapsed_s", "{:.2f}"),
    ("learning rate", "lr", "{:.3E}"),
    ("global batch size", "global_batch_size", "{:5d}"),
    ("lm loss", "lm_loss", "{:.6E}"),
    ("loss scale", "loss_scale", "{:.1f}"),
    ("grad norm", "grad_norm", "{:.3f}"),
    ("num zeros", "num_zeros", "{:.1f}"),
    ("params norm", "params_norm", "{:.3f}"),
    ("number of skipped iterations", "skipped_iterations", "{:3d}"),
    ("number of nan iterations", "nan_iterations", "{:3d}"),
    ("samples per second", "samples_per_second", "{:.3f}"),
    ("tokens per second", "tokens_per_second", "{:.0f}"),
    ("TFLOPs", "tflops", "{:.2f}"),
    ("time left", "time_left_s", None),  # format_duration
)
_INT_KEYS = {"iteration", "train_iters", "consumed_samples", "consumed_tokens", "global_batch_size",
             "skipped_iterations", "nan_iterations"}


def format_log_line(*, iteration: int, train_iters: int, consumed_samples: int, consumed_tokens: int,
                    elapsed_s: float, lr: float, global_batch_size: int, lm_loss: Optional[float],
                    loss_scale: Optional[float] = None, grad_norm: Optional[float] = None,
                    num_zeros: Optional[float] = None, params_norm: Optional[float] = None,
                    skipped_iterations: int = 0, nan_iterations: int = 0, samples_per_second: float,
                    tokens_per_second: Optional[float] = None, tflops: float, time_left_s: Optional[float] = None,
                    max_allocated_bytes: Optional[float] = None, max_reserved_bytes: Optional[float] = None) -> str:
    """The per-iteration line; `None` omits lm loss, loss scale, grad norm, num zeros, params norm, tokens per
    second or the time left (as Megatron omits its optional fields); the skipped and nan iteration counts are
    always printed, as Megatron does. The memory fields are not in the line (Megatron prints memory in its own
    report line)."""
    values = dict(consumed_samples=consumed_samples, consumed_tokens=consumed_tokens, elapsed_s=elapsed_s,
                  lr=lr, global_batch_size=global_batch_size, lm_loss=lm_loss, loss_scale=loss_scale,
                  grad_norm=grad_norm, num_zeros=num_zeros, params_norm=params_norm,
                  skipped_iterations=skipped_iterations, nan_iterations=nan_iterations,
                  samples_per_second=samples_per_second, tokens_per_second=tokens_per_second, tflops=tflops,
                  time_left_s=time_left_s)
    line = " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    for label, key, fmt in _FIELDS:
        value = values[key]
        if value is None:
            continue
        line += f" {label}: {format_duration(value) if fmt is None else fmt.format(value)} |"
    return line


def format_duration(seconds: float) -> str:
    """`0:02:31`, `13:05:00`, `195d 4:48:00` (whole seconds)."""
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    clock = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {clock}" if days else clock


def parse_duration(text: str) -> float:
    """`format_duration`'s text back into seconds."""
    days, _, clock = text.strip().rpartition("d ")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return float((int(days) if days else 0) * 86400 + hours * 3600 + minutes * 60 + seconds)


def parse_log_line(line: str, strict: bool = True) -> Dict[str, object]:
    """A log line (anything before ' iteration' is ignored) back into a record; omitted fields are None.

    `strict=False` reads other Megatron logs (tools/tflops.py --log): fields it does not know are skipped, and
    Megatron-LM's `elapsed time per iteration (ms)` is read into elapsed_s."""
    m = re.search(r"iteration\s+(\d+)/\s*(\d+)\s*\|(.*)$", line.rstrip("\n"))
    if m is None:
        raise ValueError(f"not a training log line: {line!r}")
    record: Dict[str, object] = {key: None for key in METRIC_KEYS}
    record["iteration"], record["train_iters"] = int(m.group(1)), int(m.group(2))
    by_label = {label: key for label, key, _ in _FIELDS}
    for part in m.group(3).split("|"):
        part = part.strip()
        if not part:
            continue
        label, _, value = part.partition(":")
        label = label.strip()
        if label == "elapsed time per iteration (ms)" and not strict:
            record["elapsed_s"] = float(value) / 1000.0
            continue
        key = by_label.get(label)
        if key is None:
            if strict:
                raise ValueError(f"unknown field {label!r} in log line")
            continue
        if key == "time_left_s":
            record[key] = parse_duration(value)
        else:
            record[key] = int(value) if key in _INT_KEYS else float(value)
    return record


def format_timers_line(phases_ms: Dict[str, float]) -> str:
    """Megatron's timing line: milliseconds per iteration of each phase, in the order given."""
    return " time (ms) |" + "".join(f" {name}: {ms:.2f} |" for name, ms in phases_ms.items())


def memory_usage(device) -> Dict[str, float]:
    """This process's memory in bytes, labelled as Megatron's `report_memory` labels it.

    On CUDA the caching allocator's `allocated`, `max allocated`, `reserved` and `max reserved`: what
    torch.cuda.memory_allocated / max_memory_allocated / memory_reserved / max_memory_reserved read, from one
    `torch.cuda.memory_stats` (each of those builds the whole statistics dict again). On CPU the
    process's `resident` memory and its peak, `max resident`: VmRSS and VmHWM of /proc/self/status (the kernel's
    own counters of resident pages now and at most so far, read together, so the peak is never below the
    resident). Empty where neither exists (a CPU without /proc: nothing is reported)."""
    import torch

    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {label: float(stats.get(key, 0)) for label, key in (
            ("allocated", "allocated_bytes.all.current"), ("max allocated", "allocated_bytes.all.peak"),
            ("reserved", "reserved_bytes.all.current"), ("max reserved", "reserved_bytes.all.peak"))}
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}
    kib = {key: float(status[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM") if key in status}
    if len(kib) < 2:
        return {}
    return {"resident": kib["VmRSS"], "max resident": kib["VmHWM"]}


def peak_memory_fields(usage: Optional[Dict[str, float]]) -> Dict[str, Optional[float]]:
    """A record's memory fields from `memory_usage`'s numbers (the largest over the ranks): the peaks since the
    process started, so the last record of a run holds the run's. On CUDA the allocator's max allocated and max
    reserved; on CPU the resident peak (VmHWM) stands for max allocated, and nothing is reserved. None where
    nothing was read."""
    usage = usage or {}
    return {"max_allocated_bytes": usage.get("max allocated", usage.get("max resident")),
            "max_reserved_bytes": usage.get("max reserved")}


def format_memory_line(rank: int, iteration: int, usage: Dict[str, float]) -> str:
    """Megatron's `report_memory` line for one rank: `[Rank r] (after N iterations) memory (MB) | allocated: ... |
    max allocated: ... | reserved: ... | max reserved: ...` (on CPU: resident, max resident), MB = 2**20 bytes,
    to one decimal (Megatron prints the raw float, e.g. `617.23828125`: noise past a tenth of a MB)."""
    return f"[Rank {rank}] (after {iteration} iterations) memory (MB)" + "".join(
        f" | {label}: {value / 2 ** 20:.1f}" for label, value in usage.items())


def format_eval_line(iteration: int, lm_loss: float, valid_set: Optional[str] = None) -> str:
    """Megatron's validation line (`evaluate_and_print_results`); PPL = exp(min(20, loss)). A named validation
    set says its name (`validation loss of en at iteration ...`)."""
    of = f" of {valid_set}" if valid_set is not None else ""
    return (f" validation loss{of} at iteration {iteration} | lm loss value: {lm_loss:.6E} | "
            f"lm loss PPL: {perplexity(lm_loss):.6E} | ")


def format_eval_block(iteration: int, lm_loss: float, per_set: Optional[Dict[str, float]] = None) -> str:
    """The validation lines between two rules of dashes, as Megatron prints them: one per named set, then the
    total (the plain line)."""
    lines = [format_eval_line(iteration, loss, name) for name, loss in (per_set or {}).items()]
    lines.append(format_eval_line(iteration, lm_loss))
    rule = "-" * (max(map(len, lines)) + 1)
    return "\n".join([rule, *lines, rule])


def eval_record(iteration: int, consumed_samples: int, consumed_tokens: int, lm_loss: float,
                valid_set: Optional[str] = None) -> dict:
    """One evaluation of one validation set (`valid_set` None: the only set, or the total over named sets), as
    the metrics file and TensorBoard take it."""
    record = {"eval": True, "iteration": iteration, "consumed_samples": consumed_samples,
              "consumed_tokens": consumed_tokens, "lm_loss": lm_loss, "ppl": perplexity(lm_loss)}
    if valid_set is not None:
        record["valid_set"] = valid_set
    return record


def perplexity(lm_loss: float) -> float:
    """exp(loss) capped at exp(20) as Megatron does; NaN for a NaN loss (min(20, nan) would read 20)."""
    if math.isnan(lm_loss):
        return math.nan
    return math.exp(min(20.0, lm_loss))


class IntervalStats:
    """Accumulates iterations between two log lines, with Megatron's interval semantics.

    `add` once per iteration; `pop` returns the interval's averages and starts a new interval:
    lm_loss is the mean over the iterations that were not skipped (None if all were), skipped_iterations
    counts overflow-skipped steps, nan_iterations counts iterations whose loss was NaN or inf (skipped or
    not: the reference only counts skipped ones), elapsed_s is the mean wall time per iteration.
    """

    def __init__(self):
        self.iterations = self.skipped = self.nans = 0
        self.loss_sum, self.loss_count, self.time_sum = 0.0, 0, 0.0

    def add(self, lm_loss: float, elapsed_s: float, skipped: bool = False) -> None:
        self.iterations += 1
        self.time_sum += elapsed_s
        if not math.isfinite(lm_loss):
            self.nans += 1
        if skipped:
            self.skipped += 1
        else:
            self.loss_sum += lm_loss
            self.loss_count += 1

    def pop(self) -> Dict[str, object]:
        out = {
            "lm_loss": self.loss_sum / self.loss_count if self.loss_count else None,
            "elapsed_s": self.time_sum / max(1, self.iterations),
            "skipped_iterations": self.skipped,
            "nan_iterations": self.nans,
        }
        self.__init__()
        return out


class LogPathError(Exception):
    """logging.metrics_file or logging.tensorboard_dir names a place no log can be written (found before the model
    is built)."""


class LogWriteError(Exception):
    """A write to the metrics file or TensorBoard failed during the run."""


def check_log_paths(metrics_file: Optional[str], tensorboard_dir: Optional[str],
                    diagnostics_dir: Optional[str] = None) -> None:
    """Raises LogPathError naming the key when a log cannot go where the config says: the metrics file a folder,
    the TensorBoard or diagnostics folder a regular file, a regular file among their parent folders, or the nearest
    existing folder (or the metrics file itself) not writable: a read-only mount or permissions, as access(2)
    answers them, or a file system that takes no new file (/proc; root passes access(2) there), as a probe file
    created and removed in that folder finds (its modification time put back; a full disk shows only when a write
    fails, LogWriteError)."""
    for key, path, is_folder in (("logging.metrics_file", metrics_file, False),
                                 ("logging.tensorboard_dir", tensorboard_dir, True),
                                 ("logging.diagnostics_dir", diagnostics_dir, True)):
        if path is not None:
            _check_log_path(key, os.path.abspath(path), is_folder)


def _check_log_path(key: str, path: str, is_folder: bool) -> None:
    if is_folder and os.path.exists(path) and not os.path.isdir(path):
        raise LogPathError(f"{key} {path} is a file, not a folder: point {key} at a folder for the event files")
    if not is_folder and os.path.isdir(path):
        raise LogPathError(f"{key} {path} is a folder: point {key} at a file in it (e.g. "
                           f"{os.path.join(path, 'metrics.jsonl')})")
    existing = path if is_folder else os.path.dirname(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise LogPathError(f"{key} {path} cannot be created: {existing} is a file, not a folder")
    appended = not is_folder and os.path.exists(path)
    where = path if appended else existing
    if not os.access(where, os.W_OK if appended else os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(where).f_flag & os.ST_RDONLY)
        why = "is on a read-only file system" if read_only else "is not writable for this user"
        raise LogPathError(f"{key} {path} cannot be written: {where} {why}: remount it, fix its permissions, or "
                           f"point {key} elsewhere")
    _probe_log_path(key, path, where, appended)


def _probe_log_path(key: str, path: str, where: str, appended: bool) -> None:
    """Open the existing file for appending (no byte written), or create and remove a probe file in the folder
    `where` and put its modification time back, so that a log folder inside checkpoint.save looks untouched."""
    try:
        if appended:
            open(where, "ab").close()
            return
        before = os.stat(where)
        probe = os.path.join(where, f".gptpar-log-probe-{os.getpid()}")
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as e:
        raise LogPathError(f"{key} {path} cannot be written: {'opening' if appended else 'creating a file in'} "
                           f"{where} failed ({e.strerror}): point {key} at a folder on a file system that takes "
                           "new files") from None
    os.remove(probe)
    with contextlib.suppress(OSError):
        os.utime(where, ns=(before.st_atime_ns, before.st_mtime_ns))


class MetricsWriter:
    """Appends JSONL records: one per logged iteration (exactly METRIC_KEYS), eval records with "eval": true
    (`eval_record`; a named validation set's with its "valid_set"), one per iteration of discarded data with
    "skipped_data": true (training.skip_train_iteration_range), timers with "timers": true.

    Floats are written with `json`'s shortest round-trip repr (full precision); NaN/inf as NaN/Infinity,
    which Python's json reads back. `path` None makes every call a no-op.
    """

    def __init__(self, path: Optional[str]):
        self.path = path
        if path is not None and os.path.dirname(path):
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            except OSError as e:
                raise LogWriteError(f"logging.metrics_file {path}: its folder could not be created "
                                    f"({e.strerror})") from None

    def write(self, record: Dict[str, object]) -> None:
        if set(record) != set(METRIC_KEYS):
            missing, extra = set(METRIC_KEYS) - set(record), set(record) - set(METRIC_KEYS)
            raise ValueError(f"metrics record keys differ from the contract: missing {sorted(missing)}, "
                             f"extra {sorted(extra)}")
        self._append({key: record[key] for key in METRIC_KEYS})

    def write_timers(self, iteration: int, phases_ms: Dict[str, float]) -> None:
        self._append({"timers": True, "iteration": iteration, "ms_per_iteration": phases_ms})

    def write_eval(self, record: dict) -> None:
        self._append(record)

    def write_skipped_data(self, iteration: int, consumed_samples: int, consumed_tokens: int,
                           global_batch_size: int, lr: float) -> None:
        """An iteration whose global batch was drawn and discarded (the counters after it)."""
        self._append({"skipped_data": True, "iteration": iteration, "consumed_samples": consumed_samples,
                      "consumed_tokens": consumed_tokens, "global_batch_size": global_batch_size, "lr": lr})

    def _append(self, obj: dict) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(obj) + "\n")
        except OSError as e:
            raise LogWriteError(f"logging.metrics_file {self.path} could not be written ({e.strerror})") from None


def read_metrics(path: str) -> list:
    """Every object of a metrics JSONL file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def is_training_record(record: dict) -> bool:
    """Whether a metrics-file object is a logged iteration: every key of METRIC_KEYS (but LATER_KEYS, which
    files written before them lack)."""
    return set(METRIC_KEYS) - set(LATER_KEYS) <= set(record)


# Megatron-DeepSpeed's training tags (megatron/training.py, training_log): record key -> (tag, the extra
# x-axes it also writes as "<tag> vs samples" / "<tag> vs tokens"). The plain tag's step is the iteration.
MEGATRON_TRAIN_TAGS = {
    "lr": ("learning-rate/learning-rate", ("samples", "tokens")),
    "global_batch_size": ("batch-size/batch-size", ("samples",)),
    "lm_loss": ("lm-loss-training/lm loss", ("samples", "tokens")),
    "loss_scale": ("loss-scale/loss-scale", ("samples", "tokens")),
    "grad_norm": ("grad-norm/grad-norm", ("samples", "tokens")),
    "num_zeros": ("num-zeros/num-zeros", ("samples", "tokens")),
    "params_norm": ("params-norm/params-norm", ("samples", "tokens")),
    "elapsed_s": ("iteration-time/iteration-time", ("samples", "tokens")),
}


def megatron_train_scalars(record: Dict[str, object]) -> list:
    """(tag, value, step) for one training record, as Megatron-DeepSpeed names them."""
    it, x = record["iteration"], {"samples": record["consumed_samples"], "tokens": record["consumed_tokens"]}
    out = [("steps-vs-samples/y=steps,x=samples", it, x["samples"]),
           ("steps-vs-samples/y=samples,x=steps", x["samples"], it),
           ("steps-vs-tokens/y=steps,x=tokens", it, x["tokens"]),
           ("steps-vs-tokens/y=tokens,x=steps", x["tokens"], it)]
    for key, (tag, axes) in MEGATRON_TRAIN_TAGS.items():
        if record.get(key) is not None:
            out.append((tag, record[key], it))
            out.extend((f"{tag} vs {axis}", record[key], x[axis]) for axis in axes)
    return out


def megatron_eval_scalars(record: Dict[str, object]) -> list:
    """(tag, value, step) for one eval record: `lm-loss-validation/lm loss validation` (+ ppl, each also vs
    samples and vs tokens); a named set's under `lm-loss-validation/NAME/...` (newer Megatron-DeepSpeed's
    per data group tags)."""
    base = "lm-loss-validation/" + (f"{record['valid_set']}/" if record.get("valid_set") else "")
    out = []
    for tag, value in ((f"{base}lm loss validation", record["lm_loss"]),
                       (f"{base}lm loss validation ppl", record["ppl"])):
        out += [(tag, value, record["iteration"]), (f"{tag} vs samples", value, record["consumed_samples"]),
                (f"{tag} vs tokens", value, record["consumed_tokens"])]
    return out


def gptpar_train_scalars(record: Dict[str, object]) -> list:
    """(tag, value, step): `train/<key>` per METRIC_KEYS (step = iteration), `train/lm_loss_vs_samples`."""
    out = [(f"train/{key}", record[key], record["iteration"]) for key in METRIC_KEYS
           if key not in ("iteration", "train_iters") + MEMORY_KEYS and record.get(key) is not None]
    if record.get("lm_loss") is not None:
        out.append(("train/lm_loss_vs_samples", record["lm_loss"], record["consumed_samples"]))
    return out


def gptpar_eval_scalars(record: Dict[str, object]) -> list:
    """(tag, value, step): `eval/lm_loss`, `eval/ppl`; a named set's `eval/NAME/lm_loss`, `eval/NAME/ppl`."""
    base = "eval/" + (f"{record['valid_set']}/" if record.get("valid_set") else "")
    return [(f"{base}lm_loss", record["lm_loss"], record["iteration"]),
            (f"{base}ppl", record["ppl"], record["iteration"])]


# The trainer's phases (logging.timers) under the names of Megatron's timers that measure the same thing
# (pretrain_gpt.py's `batch-generator`, schedules.py's `forward-compute` / `backward-compute`, training.py's
# `optimizer`); `micro-step` and `other` have no Megatron twin and keep their own names.
MEGATRON_TIMER_NAMES = {"batch": "batch-generator", "forward": "forward-compute", "backward": "backward-compute",
                        "optimizer": "optimizer"}


def megatron_timer_scalars(iteration: int, phases_ms: Dict[str, float]) -> list:
    """(tag, value, step) as Megatron-DeepSpeed's `Timers.write`: `<timer>-time`, seconds per iteration."""
    return [(f"{MEGATRON_TIMER_NAMES.get(name, name)}-time", ms / 1e3, iteration) for name, ms in phases_ms.items()]


def gptpar_timer_scalars(iteration: int, phases_ms: Dict[str, float]) -> list:
    """(tag, value, step): `timers/<phase>_ms`, milliseconds per iteration."""
    return [(f"timers/{name}_ms", ms, iteration) for name, ms in phases_ms.items()]


def megatron_memory_scalars(iteration: int, usage: Dict[str, float]) -> list:
    """(tag, value, step): Megatron-LM's `mem-allocated-bytes`, `mem-max-allocated-bytes`, `mem-reserved-bytes`,
    `mem-max-reserved-bytes` (on CPU `mem-resident-bytes`, `mem-max-resident-bytes`), in bytes."""
    return [(f"mem-{label.replace(' ', '-')}-bytes", value, iteration) for label, value in usage.items()]


def gptpar_memory_scalars(iteration: int, usage: Dict[str, float]) -> list:
    """(tag, value, step): `memory/<label>_bytes` (`memory/max_resident_bytes`, ...)."""
    return [(f"memory/{label.replace(' ', '_')}_bytes", value, iteration) for label, value in usage.items()]


# Each tag style's functions for training records, eval records, timers and memory.
TAG_STYLES = {"megatron": (megatron_train_scalars, megatron_eval_scalars, megatron_timer_scalars,
                           megatron_memory_scalars),
              "gptpar": (gptpar_train_scalars, gptpar_eval_scalars, gptpar_timer_scalars, gptpar_memory_scalars)}


class TensorBoardWriter:
    """Scalars of the training and eval records, the timers and the memory, under logging.tensorboard_tags'
    names (`TAG_STYLES`).

    Imports TensorBoard only when `log_dir` is given; `log_dir` None makes every call a no-op.
    """

    def __init__(self, log_dir: Optional[str], tags: str = "megatron"):
        self.writer, self.log_dir = None, log_dir
        self.train_scalars, self.eval_scalars, self.timer_scalars, self.memory_scalars = TAG_STYLES[tags]
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            _quiet_tensorboard_writer_thread()
            with self._failing():
                self.writer = SummaryWriter(log_dir=log_dir)

    def add_metrics(self, record: Dict[str, object]) -> None:
        self._add(self.train_scalars(record))

    def add_eval(self, record: Dict[str, object]) -> None:
        self._add(self.eval_scalars(record))

    def add_timers(self, iteration: int, phases_ms: Dict[str, float]) -> None:
        self._add(self.timer_scalars(iteration, phases_ms))

    def add_memory(self, iteration: int, usage: Dict[str, float]) -> None:
        self._add(self.memory_scalars(iteration, usage))

    def add_rank_compute(self, iteration: int, seconds) -> None:
        """Each rank's compute seconds per iteration (gptpar.training.straggler): `rank-compute-time/rank R`."""
        self._add([(f"rank-compute-time/rank {rank}", value, iteration) for rank, value in enumerate(seconds)])

    def _add(self, scalars: list) -> None:
        if self.writer is None:
            return
        with self._failing():
            for tag, value, step in scalars:
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            with self._failing():
                writer.close()

    @contextlib.contextmanager
    def _failing(self):
        """An OSError of TensorBoard's writer (its thread's, raised again at the next flush) as LogWriteError; the
        writer is dropped then (it would raise the same error again when closed)."""
        try:
            yield
        except OSError as e:
            writer, self.writer = self.writer, None
            if writer is not None:
                with contextlib.suppress(OSError):
                    writer.close()
            raise LogWriteError(f"logging.tensorboard_dir {self.log_dir} could not be written ({e.strerror})") \
                from None


def _quiet_tensorboard_writer_thread() -> None:
    """TensorBoard writes from a thread that keeps its OSError for the next flush to raise (then LogWriteError) and
    also lets it print a traceback as it dies: that print is left out (every other thread's error is printed)."""
    import threading

    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # another tensorboard: its thread's print stays
        return
    previous = threading.excepthook
    if getattr(previous, "gptpar_quiet_tensorboard", False):
        return

    def hook(args):
        if not (isinstance(args.thread, _AsyncWriterThread) and issubclass(args.exc_type, OSError)):
            previous(args)
    hook.gptpar_quiet_tensorboard = True
    threading.excepthook = hook


__all__ = ["METRIC_KEYS", "LATER_KEYS", "format_log_line", "format_duration", "parse_duration", "parse_log_line",
           "format_timers_line", "memory_usage",
           "format_memory_line", "format_eval_line", "format_eval_block", "eval_record", "perplexity",
           "IntervalStats", "MetricsWriter", "read_metrics", "is_training_record", "MEGATRON_TRAIN_TAGS",
           "MEGATRON_TIMER_NAMES", "TAG_STYLES", "megatron_train_scalars", "megatron_eval_scalars",
           "gptpar_train_scalars", "gptpar_eval_scalars", "megatron_timer_scalars", "gptpar_timer_scalars",
           "megatron_memory_scalars", "gptpar_memory_scalars", "TensorBoardWriter",
           "LogPathError", "LogWriteError", "check_log_paths", "MEMORY_KEYS", "peak_memory_fields"]
