"""The Megatron-DeepSpeed log line vs the lines quoted in the 176B prequel log, the metrics file, TensorBoard tags."""
import math
import os

import pytest

import torch

from gptpar.training.reporting import (MEMORY_KEYS, METRIC_KEYS, IntervalStats, LogPathError, LogWriteError,
                                     MetricsWriter, TensorBoardWriter, check_log_paths, eval_record,
                                     format_eval_block, format_eval_line, format_log_line, format_memory_line,
                                     is_training_record, memory_usage, parse_log_line, peak_memory_fields,
                                     read_metrics)
from gptpar.testing.runs import read_tensorboard

# Quoted verbatim from /work/shared/seeds/003_c1a2cf81af8065a2.txt (Megatron-DeepSpeed output, fp16 and bf16).
PREQUEL_LINES = [
    " iteration        2/   95367 | consumed samples:         4096 | consumed tokens:      8388608 | elapsed time per iteration (s): 769.99 | learning rate: 3.787E-06 | global batch size:  2048 | lm loss: 6.384045E+01 | loss scale: 4096.0 | grad norm: 15906.210 | num zeros: 0.0 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 2.660 | TFLOPs: 108.47 |",  # noqa: E501
    " iteration        2/   95367 | consumed samples:         4096 | consumed tokens:      8388608 | elapsed time per iteration (s): 844.81 | learning rate: 3.787E-06 | global batch size:  2048 | lm loss: 6.373861E+01 | loss scale: 4096.0 | grad norm: 34132.119 | num zeros: 0.0 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 2.424 | TFLOPs: 98.87 |",  # noqa: E501
    " iteration        2/   95367 | consumed samples:         4096 | consumed tokens:      8388608 | elapsed time per iteration (s): 430.21 | learning rate: 3.787E-06 | global batch size:  2048 | lm loss: 6.373876E+01 | loss scale: 4096.0 | grad norm: 34027.311 | num zeros: 0.0 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 4.761 | TFLOPs: 97.07 |",  # noqa: E501
    " iteration        2/   95367 | consumed samples:         4096 | consumed tokens:      8388608 | elapsed time per iteration (s): 777.09 | learning rate: 3.787E-06 | global batch size:  2048 | lm loss: 6.381926E+01 | loss scale: 1.0 | grad norm: 2.763 | num zeros: 0.0 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 2.635 | TFLOPs: 107.48 |",  # noqa: E501
    " iteration        2/   95367 | consumed samples:         4096 | consumed tokens:      8388608 | elapsed time per iteration (s): 853.81 | learning rate: 3.787E-06 | global batch size:  2048 | lm loss: 6.369443E+01 | loss scale: 1.0 | grad norm: 4.461 | num zeros: 0.0 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 2.399 | TFLOPs: 97.82 |",  # noqa: E501
]


def test_rebuild_seed_line_from_its_values():
    # the 20B fp16 row: 2 iterations of 2048 samples of 2048 tokens, 769.99 s per iteration
    gbs, seq, iteration, sec = 2048, 2048, 2, 769.99
    line = format_log_line(
        iteration=iteration, train_iters=95367, consumed_samples=iteration * gbs,
        consumed_tokens=iteration * gbs * seq, elapsed_s=sec, lr=3.787e-6, global_batch_size=gbs,
        lm_loss=63.84045, loss_scale=4096.0, grad_norm=15906.21, num_zeros=0.0, skipped_iterations=0,
        nan_iterations=0, samples_per_second=gbs / sec, tflops=108.47)
    assert line == PREQUEL_LINES[0]


@pytest.mark.parametrize("line", PREQUEL_LINES)
def test_parse_format_round_trip_on_seed_lines(line):
    record = parse_log_line(line)
    assert set(record) == set(METRIC_KEYS)
    assert record["consumed_tokens"] == record["consumed_samples"] * 2048
    assert format_log_line(**record) == line


def test_lenient_parse_reads_other_megatron_logs():
    """tools/tflops.py --log reads with the trainer's parser: a field it does not know is skipped (strict mode
    refuses it), and Megatron-LM's milliseconds become seconds."""
    line = PREQUEL_LINES[0]
    other = line.replace("elapsed time per iteration (s): 769.99", "elapsed time per iteration (ms): 769990.0")
    other = other.replace(" TFLOPs:", " curriculum seqlen: 2048 | TFLOPs:")
    with pytest.raises(ValueError, match="unknown field"):
        parse_log_line(other)
    lenient, reference = parse_log_line(other, strict=False), parse_log_line(line)
    assert lenient.pop("elapsed_s") == pytest.approx(reference.pop("elapsed_s"), rel=1e-12)
    assert lenient == reference


def test_loss_scale_and_num_zeros_omitted_when_none_and_counts_always_printed():
    """A field given as None (loss scale of another log, num zeros not counted) is left out; the skipped and nan
    counts are printed always, 0 included, as Megatron-DeepSpeed prints them."""
    record = dict(iteration=10, train_iters=100, consumed_samples=160, consumed_tokens=160 * 64, elapsed_s=0.1234,
                  lr=1e-3, global_batch_size=16, lm_loss=5.5, grad_norm=1.25, skipped_iterations=1,
                  nan_iterations=0, samples_per_second=129.66, tflops=0.001)
    line = format_log_line(**record)
    assert "loss scale" not in line and "num zeros" not in line
    assert " number of skipped iterations:   1 | number of nan iterations:   0 |" in line  # Megatron's: always
    assert line.endswith(" TFLOPs: 0.00 |") and line.startswith(" iteration       10/     100 |")
    parsed = parse_log_line("[rank 1] " + line)
    assert parsed["num_zeros"] is None and parsed["loss_scale"] is None
    assert parsed["elapsed_s"] == 0.12 and parsed["consumed_samples"] == 160
    zeros = format_log_line(**dict(record, skipped_iterations=0))
    assert " number of skipped iterations:   0 | number of nan iterations:   0 |" in zeros
    assert "| loss scale: 1.0 |" in format_log_line(**record, loss_scale=1.0)



@pytest.mark.parametrize("seconds, text", [(0, "0:00:00"), (59.6, "0:01:00"), (151, "0:02:31"), (47100, "13:05:00"),
                                           (195 * 86400 + 4 * 3600 + 48 * 60, "195d 4:48:00")])
def test_tokens_per_second_and_time_left(seconds, text):
    """The fields after Megatron's: tokens per second (whole tokens) before TFLOPs, the time left last, as
    H:MM:SS past which days are counted; both read back by parse_log_line."""
    record = dict(iteration=10, train_iters=100, consumed_samples=160, consumed_tokens=160 * 64, elapsed_s=0.5,
                  lr=1e-3, global_batch_size=16, lm_loss=5.5, samples_per_second=32.0, tokens_per_second=32.0 * 64,
                  tflops=0.001, time_left_s=seconds)
    line = format_log_line(**record)
    assert line.endswith(f" samples per second: 32.000 | tokens per second: 2048 | TFLOPs: 0.00 | time left: {text} |")
    assert parse_log_line(line)["time_left_s"] == round(seconds)
    assert parse_log_line(line)["tokens_per_second"] == 2048.0


def test_order_of_fields_matches_anchor():
    """Megatron-DeepSpeed's training_log order; `params norm: {:.3f}` right after num zeros, as it prints it."""
    line = format_log_line(iteration=1, train_iters=2, consumed_samples=3, consumed_tokens=4, elapsed_s=5.0, lr=6.0,
                           global_batch_size=7, lm_loss=8.0, loss_scale=9.0, grad_norm=10.0, num_zeros=11.0,
                           params_norm=11.5, skipped_iterations=12, nan_iterations=13, samples_per_second=14.0,
                           tflops=15.0)
    labels = [part.split(":")[0].strip() for part in line.strip(" |").split(" | ")[1:]]
    assert labels == ["consumed samples", "consumed tokens", "elapsed time per iteration (s)", "learning rate",
                      "global batch size", "lm loss", "loss scale", "grad norm", "num zeros", "params norm",
                      "number of skipped iterations", "number of nan iterations", "samples per second", "TFLOPs"]
    more = format_log_line(iteration=1, train_iters=2, consumed_samples=3, consumed_tokens=4, elapsed_s=5.0, lr=6.0,
                           global_batch_size=7, lm_loss=8.0, loss_scale=9.0, grad_norm=10.0, num_zeros=11.0,
                           params_norm=11.5, skipped_iterations=12, nan_iterations=13, samples_per_second=14.0,
                           tokens_per_second=14.5, tflops=15.0, time_left_s=16.0)
    labels_more = [part.split(":")[0].strip() for part in more.strip(" |").split(" | ")[1:]]
    # gptpar's two fields leave Megatron's in their order
    assert [label for label in labels_more if label not in ("tokens per second", "time left")] == labels
    assert labels_more[-3:] == ["tokens per second", "TFLOPs", "time left"]
    assert "| num zeros: 11.0 | params norm: 11.500 | number of skipped" in line
    assert parse_log_line(line)["params_norm"] == 11.5


def test_cuda_memory_usage_reads_what_torch_cuda_reads_from_one_stats_call(monkeypatch):
    """On CUDA the four figures are torch.cuda.memory_allocated / max_memory_allocated / memory_reserved /
    max_memory_reserved, read from one `memory_stats` (checked on any machine with a stand-in allocator: the
    torch functions and memory_usage read the same fake statistics)."""
    import torch.cuda.memory as cuda_memory

    stats = {"allocated_bytes.all.current": 11, "allocated_bytes.all.peak": 12, "reserved_bytes.all.current": 13,
             "reserved_bytes.all.peak": 14, "active_bytes.all.current": 99}
    calls = []
    fake = lambda device=None: calls.append(device) or dict(stats)  # noqa: E731
    monkeypatch.setattr(cuda_memory, "memory_stats", fake)
    monkeypatch.setattr(torch.cuda, "memory_stats", fake)
    device = torch.device("cuda", 0)
    expected = {"allocated": torch.cuda.memory_allocated(device),
                "max allocated": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device), "max reserved": torch.cuda.max_memory_reserved(device)}
    assert len(calls) == 4 and sorted(expected.values()) == [11, 12, 13, 14]
    assert memory_usage(device) == expected and len(calls) == 5


def test_memory_line_is_megatrons_report_memory():
    """`[Rank r] (after N iterations) memory (MB) | allocated: ... |` with Megatron's labels (utils.report_memory,
    written out here), MB = 2**20 bytes to one decimal; on CPU this process's VmRSS / VmHWM."""
    usage = {"allocated": 3 * 2 ** 20, "max allocated": 617.23828125 * 2 ** 20, "reserved": 8 * 2 ** 20,
             "max reserved": 9 * 2 ** 20}
    assert format_memory_line(3, 10, usage) == ("[Rank 3] (after 10 iterations) memory (MB) | allocated: 3.0 | "
                                                 "max allocated: 617.2 | reserved: 8.0 | max reserved: 9.0")
    cpu = memory_usage(torch.device("cpu"))
    with open("/proc/self/status") as f:
        status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith(("VmRSS", "VmHWM"))}
    assert list(cpu) == ["resident", "max resident"]
    assert cpu["max resident"] >= cpu["resident"] > 0
    assert cpu["max resident"] <= status["VmHWM"] and cpu["resident"] == pytest.approx(status["VmRSS"], rel=0.1)


def test_eval_line_megatron_format():
    line = format_eval_line(100, 2.0)
    assert line == f" validation loss at iteration 100 | lm loss value: 2.000000E+00 | lm loss PPL: {math.exp(2):.6E} | "
    block = format_eval_block(100, 30.0).split("\n")
    assert block[0] == block[2] == "-" * (len(block[1]) + 1)
    assert f"{math.exp(20):.6E}" in block[1]  # Megatron caps the perplexity exponent at 20
    # A NaN loss is a NaN perplexity, not the cap (min(20, nan) is 20).
    assert "lm loss value: NAN | lm loss PPL: NAN |" in format_eval_line(7, float("nan"))
    # Named validation sets: one line each, then the total as the plain line, all between the rules.
    block = format_eval_block(100, 2.5, {"en": 2.0, "fr": 3.0}).split("\n")
    assert block[1:4] == [format_eval_line(100, 2.0, "en"), format_eval_line(100, 3.0, "fr"),
                          format_eval_line(100, 2.5)]
    assert block[1].startswith(" validation loss of en at iteration 100 | lm loss value: 2.000000E+00 |")
    assert block[0] == block[4] == "-" * (len(block[2]) + 1)


def test_interval_stats():
    stats = IntervalStats()
    stats.add(2.0, 0.5)
    stats.add(float("nan"), 0.7, skipped=True)
    stats.add(4.0, 0.9)
    out = stats.pop()
    assert out == {"lm_loss": 3.0, "elapsed_s": pytest.approx(0.7), "skipped_iterations": 1, "nan_iterations": 1}
    assert stats.pop()["skipped_iterations"] == 0  # a new interval


def test_metrics_writer_full_precision_and_append(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    record = dict(zip(METRIC_KEYS, [5, 10, 80, 80 * 64, 0.123456789012345, 1.234567890123e-4, 16,
                                    3.14159265358979, 1.0, 0.987654321, None, 12.3456789012345, 0, 0, 129.870129870,
                                    129.870129870 * 64, 1.2e-6, 3599.5, 2.5e9, None]))
    assert len(record) == len(METRIC_KEYS)
    MetricsWriter(str(path)).write(record)
    writer = MetricsWriter(str(path))  # a resumed run appends
    writer.write_eval(eval_record(5, 80, 80 * 64, 3.0))
    writer.write_eval(eval_record(5, 80, 80 * 64, 2.0, "en"))
    objects = read_metrics(str(path))
    assert objects[0] == record and list(objects[0]) == list(METRIC_KEYS)
    assert objects[1] == {"eval": True, "iteration": 5, "consumed_samples": 80, "consumed_tokens": 80 * 64,
                          "lm_loss": 3.0, "ppl": math.exp(3.0)}
    assert objects[2] == dict(objects[1], lm_loss=2.0, ppl=math.exp(2.0), valid_set="en")
    line = parse_log_line(format_log_line(**record))
    assert line["lm_loss"] == float(f"{record['lm_loss']:.6E}")  # the line rounds, the file does not
    with pytest.raises(ValueError, match="missing"):
        writer.write({k: v for k, v in record.items() if k != "tflops"})
    MetricsWriter(None).write(record)  # no file: a no-op


def test_tensorboard_tags_gptpar(tmp_path):
    pytest.importorskip("tensorboard")
    record = dict(zip(METRIC_KEYS, [3, 10, 48, 48 * 64, 0.5, 1e-3, 16, 4.5, 1.0, 2.0, None, 6.5, 0, 0, 32.0, 32.0 * 64,
                                    0.0, 65.0, 2e9, 3e9]))
    tb = TensorBoardWriter(str(tmp_path), tags="gptpar")
    tb.add_metrics(record)
    tb.add_eval(eval_record(3, 48, 48 * 64, 4.0))
    tb.add_eval(eval_record(3, 48, 48 * 64, 3.0, "en"))
    tb.close()
    scalars = read_tensorboard(tmp_path)
    # the memory fields go under memory/ (add_memory), not train/
    expected = {f"train/{k}" for k in METRIC_KEYS if k not in ("iteration", "train_iters", "num_zeros") + MEMORY_KEYS}
    assert expected | {"train/lm_loss_vs_samples", "eval/lm_loss", "eval/ppl", "eval/en/lm_loss",
                       "eval/en/ppl"} == set(scalars)
    assert scalars["train/lm_loss"] == [(3, pytest.approx(4.5))]
    assert scalars["train/lm_loss_vs_samples"][0][0] == 48
    assert scalars["eval/en/ppl"] == [(3, pytest.approx(math.exp(3.0)))]
    TensorBoardWriter(None).add_metrics(record)  # no directory: a no-op


def test_tensorboard_tags_megatron(tmp_path):
    """Megatron-DeepSpeed's tags (megatron/training.py training_log and evaluate_and_print_results, written out
    here): each value at step = iteration, and its `vs samples` / `vs tokens` twins at the consumed counts."""
    pytest.importorskip("tensorboard")
    record = dict(zip(METRIC_KEYS, [3, 10, 48, 48 * 64, 0.5, 1e-3, 16, 4.5, 8.0, 2.0, 7.0, 6.5, 0, 0, 32.0, 32.0 * 64,
                                    0.0, 65.0]))
    tb = TensorBoardWriter(str(tmp_path))  # megatron is the default
    tb.add_metrics(record)
    tb.add_eval(eval_record(3, 48, 48 * 64, 4.0))
    tb.add_eval(eval_record(3, 48, 48 * 64, 3.0, "en"))
    tb.close()
    scalars = read_tensorboard(tmp_path)
    it, samples, tokens = 3, 48, 48 * 64
    both = ("", " vs samples", " vs tokens")
    expected = {"steps-vs-samples/y=steps,x=samples": [(samples, it)],
                "steps-vs-samples/y=samples,x=steps": [(it, samples)],
                "steps-vs-tokens/y=steps,x=tokens": [(tokens, it)], "steps-vs-tokens/y=tokens,x=steps": [(it, tokens)],
                "batch-size/batch-size": [(it, 16)], "batch-size/batch-size vs samples": [(samples, 16)]}
    for tag, value in (("learning-rate/learning-rate", 1e-3), ("lm-loss-training/lm loss", 4.5),
                       ("loss-scale/loss-scale", 8.0), ("grad-norm/grad-norm", 2.0), ("num-zeros/num-zeros", 7.0),
                       ("params-norm/params-norm", 6.5),
                       ("iteration-time/iteration-time", 0.5), ("lm-loss-validation/lm loss validation", 4.0),
                       ("lm-loss-validation/lm loss validation ppl", math.exp(4.0)),
                       ("lm-loss-validation/en/lm loss validation", 3.0),
                       ("lm-loss-validation/en/lm loss validation ppl", math.exp(3.0))):
        for suffix, step in zip(both, (it, samples, tokens)):
            expected[tag + suffix] = [(step, value)]
    assert set(scalars) == set(expected)
    for tag, points in expected.items():
        assert scalars[tag] == [(step, pytest.approx(value, rel=1e-6)) for step, value in points], tag


def test_training_records_of_files_written_before_params_norm():
    """A metrics file from before `params_norm` existed still holds training records (tools/plot_metrics.py reads
    old runs); eval and timer records are not training records."""
    record = dict(zip(METRIC_KEYS, [3, 10, 48, 48 * 64, 0.5, 1e-3, 16, 4.5, 1.0, 2.0, None, None, 0, 0, 32.0, 32.0 * 64,
                                    0.0, 65.0]))
    older = {k: v for k, v in record.items() if k not in ("params_norm", "tokens_per_second", "time_left_s")}
    assert is_training_record(record) and is_training_record(older)
    assert not is_training_record({k: v for k, v in older.items() if k != "tflops"})
    assert not is_training_record(eval_record(3, 48, 48 * 64, 4.0))
    assert not is_training_record({"timers": True, "iteration": 3, "ms_per_iteration": {"forward": 1.0}})


@pytest.mark.parametrize("style", ["megatron", "gptpar"])
def test_tensorboard_timers_and_memory(tmp_path, style):
    """Timers under Megatron-DeepSpeed's `Timers.write` names (`<timer>-time`, seconds per iteration: the
    trainer's phases mapped to batch-generator, forward-compute, backward-compute, optimizer) or gptpar's
    `timers/<phase>_ms`; memory as Megatron-LM's `mem-<label>-bytes` or `memory/<label>_bytes`."""
    pytest.importorskip("tensorboard")
    phases = {"batch": 1.0, "forward": 20.0, "backward": 40.0, "micro-step": 2.0, "optimizer": 10.0, "other": 3.0}
    usage = {"allocated": 1e9, "max allocated": 2e9, "reserved": 3e9, "max reserved": 4e9}
    tb = TensorBoardWriter(str(tmp_path), tags=style)
    tb.add_timers(7, phases)
    tb.add_memory(7, usage)
    tb.close()
    scalars = read_tensorboard(tmp_path)
    if style == "megatron":
        names = {"batch": "batch-generator", "forward": "forward-compute", "backward": "backward-compute",
                 "micro-step": "micro-step", "optimizer": "optimizer", "other": "other"}
        expected = {f"{names[k]}-time": v / 1e3 for k, v in phases.items()}
        expected.update({"mem-allocated-bytes": 1e9, "mem-max-allocated-bytes": 2e9, "mem-reserved-bytes": 3e9,
                         "mem-max-reserved-bytes": 4e9})
    else:
        expected = {f"timers/{k}_ms": v for k, v in phases.items()}
        expected.update({"memory/allocated_bytes": 1e9, "memory/max_allocated_bytes": 2e9,
                         "memory/reserved_bytes": 3e9, "memory/max_reserved_bytes": 4e9})
    assert set(scalars) == set(expected)
    for tag, value in expected.items():
        assert scalars[tag] == [(7, pytest.approx(value, rel=1e-6))], tag


def test_peak_memory_fields_are_the_peaks_of_each_device_kind():
    """A record's memory fields: CUDA's max allocated and max reserved; on CPU the resident peak (VmHWM) and
    nothing reserved; nothing read, nothing there."""
    cuda = {"allocated": 1.0, "max allocated": 2.0, "reserved": 3.0, "max reserved": 4.0}
    assert peak_memory_fields(cuda) == {"max_allocated_bytes": 2.0, "max_reserved_bytes": 4.0}
    assert peak_memory_fields({"resident": 5.0, "max resident": 6.0}) == {"max_allocated_bytes": 6.0,
                                                                          "max_reserved_bytes": None}
    assert peak_memory_fields(None) == {"max_allocated_bytes": None, "max_reserved_bytes": None}
    assert set(MEMORY_KEYS) == set(peak_memory_fields(cuda)) and set(MEMORY_KEYS) <= set(METRIC_KEYS)
    line = format_log_line(**dict(parse_log_line(PREQUEL_LINES[0]), **peak_memory_fields(cuda)))
    assert line == PREQUEL_LINES[0]  # the line leaves them out


def test_log_paths_that_cannot_be_written_are_named_with_their_key(tmp_path):
    """check_log_paths, which the preflight runs on rank 0: each case names the key in full; a path that can be
    written passes, and nothing is left behind (the probe file is removed, the folder's modification time put
    back)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for metrics, tensorboard, message in (
            (f"{a_file}/m.jsonl", None, f"logging.metrics_file {a_file}/m.jsonl cannot be created: {a_file} is a file"),
            (f"{a_file}/deeper/m.jsonl", None, f"cannot be created: {a_file} is a file, not a folder"),
            (str(tmp_path), None, f"logging.metrics_file {tmp_path} is a folder: point logging.metrics_file at a file"),
            (None, str(a_file), f"logging.tensorboard_dir {a_file} is a file, not a folder"),
            (None, f"{a_file}/tb", f"logging.tensorboard_dir {a_file}/tb cannot be created: {a_file} is a file")):
        with pytest.raises(LogPathError) as e:
            check_log_paths(metrics, tensorboard)
        assert message in str(e.value)
    with pytest.raises(LogPathError, match=f"logging.diagnostics_dir {a_file} is a file, not a folder"):
        check_log_paths(None, None, str(a_file))
    before = os.stat(tmp_path).st_mtime_ns, os.stat(a_file).st_mtime_ns
    check_log_paths(str(tmp_path / "new" / "m.jsonl"), str(tmp_path / "new" / "tb"), str(tmp_path / "diag"))
    check_log_paths(str(a_file), None)  # an existing file is appended to
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and a_file.read_text() == "x"
    assert (os.stat(tmp_path).st_mtime_ns, os.stat(a_file).st_mtime_ns) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_file_system_that_takes_no_new_file_is_refused_for_every_log_path():
    """/proc takes no new file, although access(2) says writable to root: each log key is refused in one line
    naming it (before the probe, root's metrics file there passed and the run failed at its first write)."""
    for args, key in ((("/proc/gptpar-metrics.jsonl", None), "logging.metrics_file"),
                      ((None, "/proc/gptpar-tb"), "logging.tensorboard_dir"),
                      ((None, None, "/proc/gptpar-diagnostics"), "logging.diagnostics_dir")):
        with pytest.raises(LogPathError, match=f"^{key} /proc/gptpar-.* cannot be written: ") as e:
            check_log_paths(*args)
        assert "\n" not in str(e.value)


def test_writes_that_fail_raise_one_error_naming_the_key(tmp_path, capfd, monkeypatch):
    """The metrics file and TensorBoard, their folder gone (a file in its place) after the first write: each write
    then raises LogWriteError naming the key; TensorBoard's writer thread prints no traceback of its own (Python's
    own thread-error printer in place, as outside pytest, which replaces it)."""
    pytest.importorskip("tensorboard")
    import shutil
    import threading

    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)

    record = dict(zip(METRIC_KEYS, [3, 10, 48, 48 * 64, 0.5, 1e-3, 16, 4.5, 1.0, 2.0, None, 6.5, 0, 0, 32.0, 32.0 * 64,
                                    0.0, 65.0, None, None]))
    logs = tmp_path / "logs"
    metrics, tb = MetricsWriter(str(logs / "m.jsonl")), TensorBoardWriter(str(logs / "tb"))
    metrics.write(record)
    tb.add_metrics(record)
    shutil.rmtree(logs)
    logs.write_text("the volume is gone")
    with pytest.raises(LogWriteError, match=f"logging.metrics_file {logs}/m.jsonl could not be written \\(Not a "):
        metrics.write(record)
    with pytest.raises(LogWriteError, match=f"logging.tensorboard_dir {logs}/tb could not be written"):
        for _ in range(3):  # the writer thread's error surfaces at the next flush
            tb.add_metrics(record)
    tb.close()  # closed once, quietly, after its error was raised
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
