"""Faults a user meets, reproduced on 2 gloo ranks (one spawn runs every case, in order): wrong
checkpoint.load values, unusable save folders, locks, a full disk during a save, NaN runs, data whose
token ids do not fit the model. Each case checks the exit code, the message and what the folders hold.

Faults are injected from here (monkeypatching inside the ranks), never through hooks in the library.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from gptpar.testing import flip_a_byte_inside_a_tensor, run_distributed
from gptpar.checkpoint.checkpointer import read_latest
from gptpar.checkpoint.layout import SAVE_TIMES
from gptpar.training.trainer import Trainer
from gptpar.testing.runs import ROOT, log_lines, main_output, write_config
from gptpar.testing.deadline import stretched


# The checkpoint folder's documented layout (gptpar.checkpoint.layout), spelled out.
SHARD = "mp_rank_00_model_states.pt"
OPTIM_1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
MANIFEST = "gptpar_manifest.json"
LOCK = ".gptpar.lock"
OWNER = ".gptpar-owner.json"  # in a universal copy's temporary folder: the job writing it


def snapshot(folder):
    """Every entry under `folder` with its size and modification time (folders included)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            st = os.stat(path)
            out[os.path.relpath(path, folder)] = (st.st_size if name in files else None, st.st_mtime_ns)
    st = os.stat(folder)
    out["."] = (None, st.st_mtime_ns)
    return out


def _write_lock(folder, **fields):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, LOCK), "w") as f:
        json.dump(fields, f)


def _start_ticks(pid):
    """Field 22 of /proc/PID/stat: when the process started."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


DEAD_PID = 2 ** 22 + 1  # above the default pid_max: no such process


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _checkpoint_size(folder):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)


def _write_vocab_dataset(prefix, max_id, num_docs=40, seed=0):
    from gptpar.data.indexed import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for _ in range(num_docs):
            b.add_document(rng.integers(0, max_id, size=60))
        b.add_document([max_id])
        b.finalize()


def run_cases(d, live_pid, only=None):
    """On each rank: the cases in order, rank 0 preparing the folders between them; {name: (rc, output,
    (folder before, after) or None)}. `live_pid`: a live process on this host, the job holding a live lock (the
    test process). `only`: run just these cases (and "base"), e.g. against older code."""
    import torch.distributed as dist

    import gptpar.training.assembly

    rank = dist.get_rank()
    out = {}

    def run(name, config, *extra, prepare=None, patches=()):
        if only is not None and name not in only and name != "base":
            return
        if rank == 0 and prepare is not None:
            prepare()
        dist.barrier()
        rc, output = main_output(["--config", config] + list(extra), patches)
        dist.barrier()
        if rank == 0 and name in snapshots:  # (before, after) of the folder the case must leave alone
            folder, before = snapshots[name]
            snapshots[name] = (before, snapshot(folder))
        out[name] = (rc, output, snapshots.get(name) if rank == 0 else None)

    snapshots = {}

    def keep(name, folder):
        def prepare():
            snapshots[name] = (folder, snapshot(folder))
        return prepare

    a = str(d / "A")
    two = write_config(d / "two.json", training=dict(train_iters=2, lr_warmup_iters=1), checkpoint=dict(save=a, load=a))
    run("base", two)

    def copy_of(name, damage):
        folder = str(d / name)

        def prepare():
            shutil.copytree(a, folder)
            damage(folder)
            snapshots[name] = (folder, snapshot(folder))
        return folder, prepare

    def empty_latest(folder):
        open(os.path.join(folder, "latest"), "w").close()

    def truncate_shard(folder):
        _truncate(os.path.join(folder, "iter_0000002", SHARD))

    def drop_optim(folder):
        os.remove(os.path.join(folder, "iter_0000002", OPTIM_1))

    def drop_latest(folder):
        os.remove(os.path.join(folder, "latest"))

    # -- checkpoint.load refused: exit 2, the folder untouched (mtimes included) -----------------------
    for name, damage in (("empty_latest", empty_latest), ("truncated", truncate_shard), ("missing", drop_optim),
                         ("no_latest", drop_latest)):
        folder, prepare = copy_of(name, damage)
        run(name, two, "--set", f"checkpoint.load={folder}", "--set", f"checkpoint.save={folder}", prepare=prepare)
    # -- a file whose bytes changed after it was written, at its size: refused by its checksum, at the same
    # shape (rank 1 verifies the shard it wrote; both ranks stop) and before a universal conversion -----------
    for name, shape in (("corrupt", ()), ("corrupt_reshape", ("--set", "parallel.data_parallel_size=1", "--set",
                                                               "parallel.tensor_model_parallel_size=2"))):
        folder, prepare = copy_of(name, lambda folder: flip_a_byte_inside_a_tensor(
            os.path.join(folder, "iter_0000002", OPTIM_1)))
        run(name, two, "--set", f"checkpoint.load={folder}", "--set", f"checkpoint.save={folder}", *shape,
            prepare=prepare)
    run("load_file", two, "--set", f"checkpoint.load={a}/iter_0000002/config.json", prepare=keep("load_file", a))
    run("load_null_over_checkpoint", two, "--set", "checkpoint.load=null", prepare=keep("load_null_over_checkpoint", a))

    # -- checkpoint.save unusable: exit 2 before the first iteration ------------------------------------
    def regular_file():
        (d / "a_file").write_text("not a folder")
    run("unwritable", two, "--set", f"checkpoint.save={d}/a_file/ck", "--set", "checkpoint.load=null",
        prepare=regular_file)
    full = shutil.disk_usage(str(d))._replace(free=1000)
    run("no_space", two, "--set", f"checkpoint.save={d}/space", "--set", "checkpoint.load=null",
        patches=[(shutil, "disk_usage", lambda path: full)])
    run("live_lock", two, prepare=lambda: (_write_lock(a, pid=live_pid, host=socket.gethostname(),
                                                       start_ticks=_start_ticks(live_pid), started="earlier"),
                                           keep("live_lock", a)()))
    run("other_host_lock", two, prepare=lambda: (_write_lock(a, pid=1, host="elsewhere", started="earlier"),
                                                 keep("other_host_lock", a)()))

    # -- loaded / fresh --------------------------------------------------------------------------------
    # An iter_N folder given directly, with a lock from another host taken over explicitly and room for
    # fewer than two checkpoints (a warning).
    # Room for one and a half of the checkpoints this model really writes: one fits, two do not.
    roomy = shutil.disk_usage(str(d))._replace(free=int(1.5 * _checkpoint_size(f"{a}/iter_0000002")))
    run("iter_folder", two, "--set", f"checkpoint.load={a}/iter_0000002", "--set", "training.train_iters=3",
        "--set", "checkpoint.override_lock=true", patches=[(shutil, "disk_usage", lambda path: roomy)])

    def own_files_only():
        g = d / "G"
        os.makedirs(g / "iter_0000005.tmp-99999")  # what a killed save leaves: its temporary folder
        (g / "iter_0000005.tmp-99999" / SHARD).write_bytes(b"partial")
        (g / ".latest.tmp-99999").write_text("iter_0000005\n")
        _write_lock(str(g), pid=DEAD_PID, host=socket.gethostname(), started="earlier")
    g = str(d / "G")
    run("own_files_only", two, "--set", f"checkpoint.load={g}", "--set", f"checkpoint.save={g}",
        prepare=own_files_only)

    # -- a save that fails (the disk fills up), then the next start --------------------------------------
    h = str(d / "H")
    four = write_config(d / "four.json", training=dict(train_iters=4), checkpoint=dict(save=h, load=h, save_interval=2))
    real_save = torch.save

    def save_on_full_disk(obj, f, *args, **kwargs):
        name = f if isinstance(f, str) else getattr(f, "name", "")  # a path, or the file gptpar's writer opened
        if "iter_0000004" in name:
            with open(name, "wb") as partial:
                partial.write(b"PK\x03\x04 half a file")
            real_save(obj, "/dev/full")  # the kernel's ENOSPC, as torch reports it
        return real_save(obj, f, *args, **kwargs)
    run("disk_full", four, patches=[(torch, "save", save_on_full_disk)])
    run("after_disk_full", four, prepare=lambda: open(os.path.join(h, ".latest.tmp-4242"), "w").close())
    # the same with checkpoint.async_save, the failing save not the last: it fails in the background
    j = str(d / "J")
    six = write_config(d / "six.json", training=dict(train_iters=6),
                       checkpoint=dict(save=j, load=j, save_interval=2, async_save=True))
    real_step = Trainer.train_step

    def slow_fifth_step(self):  # iteration 4's save has failed in the background by the time the 5th ends
        if self.counters.iteration == 4:
            time.sleep(2)
        return real_step(self)
    run("disk_full_async", six, patches=[(torch, "save", save_on_full_disk), (Trainer, "train_step", slow_fifth_step)])

    # -- NaN runs --------------------------------------------------------------------------------------
    k = str(d / "K")
    # ZeRO-0: ZeRO-1 skips a step whose gradients are not finite (the weights stay finite, only the loss
    # goes NaN); without it the optimizer writes NaN into the weights, the case a save must refuse.
    nan = write_config(d / "nan.json", training=dict(train_iters=2, lr_warmup_iters=1, eval_interval=1, eval_iters=1,
                                                     zero_stage=0),
                       checkpoint=dict(save=k, load=k, save_interval=1))
    run("nan_base", nan)
    run("nan", nan, "--set", "training.lr=1e6", "--set", "training.min_lr=0", "--set", "training.train_iters=30",
        "--set", "training.exit_on_nan_iterations=3")
    run("nan_no_limit", nan, "--set", "training.lr=1e6", "--set", "training.min_lr=0",
        "--set", "training.train_iters=30", "--set", "training.exit_on_nan_iterations=null")

    # -- data whose token ids do not fit the model -------------------------------------------------------
    prefix = str(d / "big_vocab_text_document")
    if rank == 0:
        _write_vocab_dataset(prefix, 1023)
    built = []
    real_build = gptpar.training.assembly.build_model
    oov = write_config(d / "oov.json", data=dict(synthetic=False, data_path=prefix, split="90,10,0"))
    run("out_of_vocab", oov, patches=[(gptpar.training.assembly, "build_model",
                                       lambda *a, **k: built.append(1) or real_build(*a, **k))])
    out["out_of_vocab_built"] = (len(built), "", None)

    # -- resuming at another shape or precision; universal copies ------------------------------------------
    from gptpar.checkpoint import universal
    from gptpar.checkpoint.durable import write_manifest

    dd, e = str(d / "D"), str(d / "E")
    # parallel.data_parallel_size left at its default (null: what the world size leaves)
    unset = write_config(d / "unset.json", parallel=dict(data_parallel_size=None),
                         training=dict(train_iters=2, lr_warmup_iters=1),
                         checkpoint=dict(save=dd, load=dd, save_interval=1))
    run("d_base", unset)
    tp2 = ["--set", "parallel.tensor_model_parallel_size=2"]
    no_save = ["--set", "checkpoint.save=null", "--set", "checkpoint.save_interval=null"]
    conversions = []  # on each rank: whether the save folder was locked when its share of the conversion started
    real_convert = universal.convert_share

    def convert_watching_the_lock(*args, **kwargs):
        conversions.append(os.path.exists(os.path.join(e, LOCK)))
        return real_convert(*args, **kwargs)

    def old_style_with_leftovers():
        # iter_0000002 as gptpar wrote it before the resolved dp was recorded: data_parallel_size null
        ck = os.path.join(dd, "iter_0000002")
        with open(os.path.join(ck, "config.json")) as f:
            saved = json.load(f)
        saved["parallel"]["data_parallel_size"] = None
        with open(os.path.join(ck, "config.json"), "w") as f:
            json.dump(saved, f)
        write_manifest(ck, "checkpoint", iteration=2, world_size=2)
        # killed conversions' temporary folders (one recording its job, one of an older gptpar without that record)
        # and one of a live job
        u = d / "D_universal"
        for tmp, owner in ((f"iter_0000002.tmp-{DEAD_PID}", dict(pid=DEAD_PID, host=socket.gethostname())),
                           (f"iter_0000001.tmp-{DEAD_PID + 1}", None),
                           (f"iter_0000002.tmp-{live_pid}", dict(pid=live_pid, host=socket.gethostname(),
                                                                  start_ticks=_start_ticks(live_pid)))):
            os.makedirs(u / tmp / "zero" / "layers.0.dense.weight")
            (u / tmp / "zero" / "layers.0.dense.weight" / "fp32.pt").write_bytes(b"half a file")
            if owner:
                (u / tmp / OWNER).write_text(json.dumps(owner))
    run("dp_null", unset, *tp2, "--set", "training.train_iters=3", "--set", f"checkpoint.save={e}",
        prepare=old_style_with_leftovers,
        patches=[(universal, "convert_share", convert_watching_the_lock)])
    out["conversion_locked"] = (list(conversions), "", None)
    # the documented rollback: iter_0000001 resumed, iteration 2 skipped, iter_0000002 saved again in place
    run("rollback", unset, "--set", f"checkpoint.load={dd}/iter_0000001",
        "--set", 'training.skip_train_iteration_range=["2-2"]')
    run("stale", unset, *tp2, *no_save)
    run("partition", unset, "--set", "parallel.partition_method=transformer", *no_save)
    run("bf16", unset, "--set", "training.precision=bf16", "--set", "training.train_iters=3",
        "--set", f"checkpoint.save={d / 'BF'}")
    from deepspeed.accelerator import get_accelerator

    accelerator = type(get_accelerator())  # fp16 passes the config check on this CPU
    run("fp16", unset, "--set", "training.precision=fp16", *no_save,
        patches=[(accelerator, "is_fp16_supported", lambda self: True),
                 (accelerator, "supported_dtypes", lambda self: [torch.float, torch.bfloat16, torch.float16])])
    f = str(d / "F")

    def convert_on_full_disk(obj, file, *args, **kwargs):
        name = file if isinstance(file, str) else getattr(file, "name", "")  # a path, or gptpar's writer's file
        if name.startswith(f):
            return real_save(obj, "/dev/full")  # the kernel's ENOSPC, as torch reports it
        return real_save(obj, file, *args, **kwargs)
    run("convert_full", unset, *tp2, *no_save, "--set", f"checkpoint.universal_dir={f}",
        patches=[(torch, "save", convert_on_full_disk)])
    run("zero0_reshape", nan, *tp2, "--set", "parallel.data_parallel_size=1", *no_save)  # K: zero_stage 0

    # -- files that cannot be read name themselves, before the model is built --------------------------------
    built.clear()
    counting = [(gptpar.training.assembly, "build_model", lambda *a, **k: built.append(1) or real_build(*a, **k))]
    bad_init, bad_u, hf = str(d / "bad_init"), str(d / "bad_u"), str(d / "hf_config_only")

    def truncated_copies():
        shutil.copytree(f"{dd}/iter_0000001", bad_init)
        _truncate(os.path.join(bad_init, SHARD))
        universal.convert_deepspeed_checkpoint(f"{a}/iter_0000002", bad_u, log=lambda *args: None)
        for state in ("fp32", "exp_avg"):
            _truncate(os.path.join(bad_u, "zero", "layers.0.dense.weight", f"{state}.pt"))
        import transformers

        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=200, n_positions=16, bos_token_id=0,
                                eos_token_id=0, activation_function="gelu").save_pretrained(hf)  # TINY's shape
    run("init_truncated", unset, "--set", f"checkpoint.init_from={bad_init}", "--set", "checkpoint.load=null", *no_save,
        prepare=truncated_copies, patches=counting)
    run("universal_truncated", unset, "--set", f"checkpoint.load={bad_u}", *no_save, patches=counting)
    run("hf_without_weights", unset, "--set", f"checkpoint.init_from={hf}", "--set", "checkpoint.load=null", *no_save,
        patches=counting)
    out["unreadable_built"] = (len(built), "", None)
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    d = tmp_path_factory.mktemp("reliability")
    return d, run_distributed(run_cases, 2, (d, os.getpid()), timeout=600)


def _case(cases, name):
    d, out = cases
    return out[0][name], out[1][name]


def _expect(cases, name, rc, *messages):
    (rc0, out0, _), (rc1, out1, _) = _case(cases, name)
    assert (rc0, rc1) == (rc, rc), out0 + out1
    for m in messages:
        assert m in out0, f"{m!r} not in:\n{out0}"
    return out0


def _unchanged(cases, name):
    d, out = cases
    before, after = out[0][name][2]
    assert before and after == before


def _files_unchanged(cases, name):
    d, out = cases
    before, after = out[0][name][2]
    # the run's resolved config is written once the preflight has accepted the run (gptpar.training.assembly)
    kept = lambda snapshot: {k: v for k, v in snapshot.items() if k not in (".", "resolved_config.json")}  # noqa: E731
    assert before and kept(after) == kept(before)


def test_base_run_saves_a_complete_checkpoint(cases):
    d, _ = cases
    _expect(cases, "base", 0, "no checkpoint to load: ", "starting from scratch")
    with open(d / "A" / "iter_0000002" / MANIFEST) as f:
        files = json.load(f)["files"]
    assert SHARD in files and OPTIM_1 in files and "gptpar_rank_00001.pt" in files


def test_checkpoint_size_estimate_matches_a_real_checkpoint(cases):
    from gptpar.config import load_config
    from gptpar.training.preflight import count_parameters
    from gptpar.checkpoint.save_folder import checkpoint_bytes

    d, _ = cases
    cfg = load_config(str(d / "two.json"))
    estimate = checkpoint_bytes(count_parameters(cfg.model, 1, 1), "fp32", zero_stage=1, world_size=2)
    actual = _checkpoint_size(d / "A" / "iter_0000002")
    assert abs(estimate - actual) < 0.05 * actual, (estimate, actual)


@pytest.mark.parametrize("name,message", [
    ("empty_latest", "latest is empty: write the tag"),
    ("truncated", f"{SHARD} is not a whole torch file"),
    ("missing", f"{OPTIM_1} is missing"),
    ("no_latest", "holds checkpoints (iter_0000002) but no `latest` pointer: point checkpoint.load at"),
])
def test_bad_load_exits_2_and_changes_nothing(cases, name, message):
    d, _ = cases
    out = _expect(cases, name, 2, "pretrain_gpt.py: checkpoint error: ", message, str(d / name))
    assert not log_lines(out)
    _unchanged(cases, name)


@pytest.mark.parametrize("name", ["corrupt", "corrupt_reshape"])
def test_a_corrupted_file_of_the_same_size_is_refused_naming_it(cases, name):
    """One byte of rank 1's ZeRO shard changed: its size and zip structure are intact, its sha256 is not. Both
    ranks exit 2 before the model is built, naming the file and an earlier checkpoint to load instead; at
    another shape the conversion refuses it before writing anything."""
    d, _ = cases
    out = _expect(cases, name, 2, "pretrain_gpt.py: checkpoint error: ",
                  f"{d / name / 'iter_0000002' / OPTIM_1} does not match its sha256 in the manifest",
                  "resume from an earlier checkpoint instead")
    (_, out1, _) = _case(cases, name)[1]
    assert f"{OPTIM_1} does not match its sha256" in out1  # rank 1 found it, rank 0 reports it too
    assert not log_lines(out)
    _files_unchanged(cases, name)  # found while loading: the lock was taken and released (the folder's mtime)
    assert not os.path.exists(d / f"{name}_universal") or not os.listdir(d / f"{name}_universal")


def test_the_offline_universal_conversion_refuses_a_corrupted_file(cases):
    d, _ = cases
    output = d / "corrupt_offline_universal"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--load",
                           str(d / "corrupt"), "--to", "universal", "--output", str(output)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{d / 'corrupt' / 'iter_0000002' / OPTIM_1} does not match its sha256" in done.stderr
    assert not os.path.exists(output)


def test_load_of_a_file_exits_2(cases):
    d, _ = cases
    _expect(cases, "load_file", 2, f"checkpoint.load {d}/A/iter_0000002/config.json is a file")
    _unchanged(cases, "load_file")


def test_fresh_run_never_saves_over_an_existing_checkpoint(cases):
    _expect(cases, "load_null_over_checkpoint", 2, "already holds checkpoint iter_0000002", "checkpoint.load is null")
    _unchanged(cases, "load_null_over_checkpoint")


def test_unwritable_save_folder_exits_2_before_training(cases):
    d, _ = cases
    out = _expect(cases, "unwritable", 2, f"checkpoint.save {d}/a_file/ck cannot be created")
    assert not log_lines(out)


def test_no_space_for_a_checkpoint_exits_2(cases):
    out = _expect(cases, "no_space", 2, "0.0 MiB free, but one checkpoint of this model needs about")
    assert not log_lines(out)


def test_live_job_holding_the_folder_is_refused(cases):
    _expect(cases, "live_lock", 2, "another job is writing checkpoints to", f"pid {os.getpid()} on "
            f"{socket.gethostname()}")
    _unchanged(cases, "live_lock")


def test_lock_from_another_host_needs_the_override(cases):
    _expect(cases, "other_host_lock", 2, "(pid 1 on elsewhere, started earlier)", "checkpoint.override_lock=true")
    _unchanged(cases, "other_host_lock")


def test_iter_folder_given_directly_is_loaded(cases):
    d, _ = cases
    out = _expect(cases, "iter_folder", 0, f"resumed from {d}/A/iter_0000002: iteration 2",
                  "warning: checkpoint.override_lock=true: taking over the lock",
                  "room for fewer than two checkpoints")
    assert [line.split("/")[0].split()[-1] for line in log_lines(out)] == ["3"]
    assert read_latest(str(d / "A")) == "iter_0000003"
    assert not os.path.exists(d / "A" / LOCK)  # released at the end


def test_folder_with_only_own_files_starts_fresh_and_is_cleaned(cases):
    d, _ = cases
    _expect(cases, "own_files_only", 0, "starting from scratch", "taking over the lock",
            "removing partial checkpoint", "removing stale temporary file")
    assert sorted(os.listdir(d / "G")) == sorted([SAVE_TIMES, "iter_0000002", "latest", "resolved_config.json",
                                                  "zero_to_fp32.py", "zero_to_torch.py"])


def test_full_disk_during_a_save_names_the_folder_and_is_cleaned_up(cases):
    d, _ = cases
    h = d / "H"
    out = _expect(cases, "disk_full", 1, "pretrain_gpt.py: checkpoint save failed: ",
                  f"could not save checkpoint iter_0000004 in {h}: RuntimeError",
                  "torch's writer wrote fewer bytes than asked, without an errno",
                  "`latest` still points at iter_0000002")
    assert out.count("Traceback") == 0
    out = _expect(cases, "after_disk_full", 0, f"removing stale temporary file {h}/.latest.tmp-4242",
                  f"resumed from {h}/iter_0000002")
    assert "removing partial checkpoint" not in out  # the failed save's folder went when it failed
    assert read_latest(str(h)) == "iter_0000004" and os.path.isfile(h / "iter_0000004" / MANIFEST)


def test_an_async_save_failing_in_the_background_stops_every_rank(cases):
    """Iteration 4's async save fails in the background (a full disk, injected); every rank learns it at the next
    stop check (iteration 5) and stops with its message, `latest` on iteration 2's."""
    d, _ = cases
    j = d / "J"
    out = _expect(cases, "disk_full_async", 1, "pretrain_gpt.py: checkpoint save failed: ",
                  f"could not save checkpoint iter_0000004 in {j}: RuntimeError",
                  "`latest` still points at iter_0000002")
    assert [line.split("/")[0].split()[-1] for line in log_lines(out)][-1] == "5"
    assert read_latest(str(j)) == "iter_0000002" and not os.path.exists(j / "iter_0000006")


def _finite_weights(checkpoint):
    state = torch.load(os.path.join(checkpoint, SHARD), weights_only=False)["module"]
    return all(bool(torch.isfinite(t).all()) for t in state.values() if torch.is_tensor(t))


def test_nan_run_stops_and_latest_keeps_finite_weights(cases):
    d, _ = cases
    k = d / "K"
    out = _expect(cases, "nan", 1, "in 3 consecutive iterations (training.exit_on_nan_iterations=3)",
                  "the weights hold NaN/Inf", "lm loss PPL: NAN")
    stopped = len(log_lines(out)) + 2
    assert stopped < 30  # long before train_iters
    latest = read_latest(str(k))
    assert f"`latest` in {k} stays at {latest}" in out
    assert _finite_weights(k / latest)
    refused = [int(i) for i in re.findall(r"^warning: not saving iteration (\d+): ", out, re.M)]
    assert refused and int(latest.split("_")[1]) < refused[0]
    assert not any(os.path.exists(k / f"iter_{i:07d}") for i in refused + [stopped])


def test_nan_run_without_a_limit_refuses_the_final_save(cases):
    d, _ = cases
    k = d / "K"
    latest = read_latest(str(k))
    _expect(cases, "nan_no_limit", 1, "not saving iteration 30: the weights hold NaN/Inf",
            f"`latest` in {k} stays at {latest}")
    assert _finite_weights(k / latest)


def test_out_of_vocab_data_exits_2_before_the_model_is_built(cases):
    d, out = cases
    _expect(cases, "out_of_vocab", 2, "pretrain_gpt.py: data error: dataset ",
            "largest token id is 1023, but model.vocab_size is 200")
    assert out[0]["out_of_vocab_built"][0] == out[1]["out_of_vocab_built"][0] == 0


# -- resuming at another shape or precision; universal copies; unreadable files -------------------------------

def _trained(text):
    return [int(line.split("/")[0].split()[-1]) for line in log_lines(text)]


def _old_style_copy(src, dst):
    """Checkpoint folder `src` copied as gptpar wrote it before the resolved dp was recorded: config.json's
    parallel.data_parallel_size null (the config's default), the manifest matching."""
    from gptpar.checkpoint.durable import write_manifest

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        saved = json.load(f)
    saved["parallel"]["data_parallel_size"] = None
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(saved, f)
    write_manifest(str(dst), "checkpoint", iteration=1, world_size=2)


def test_reshape_with_data_parallel_size_unset(cases, tmp_path):
    """A run that left parallel.data_parallel_size at null records the resolved dp; an older checkpoint that
    recorded null is resumed at tp = 2 (dp from its optimizer files' names) and converted offline."""
    from gptpar.tools import convert_checkpoint

    d, _ = cases
    with open(d / "D" / "iter_0000001" / "config.json") as f:
        assert json.load(f)["parallel"]["data_parallel_size"] == 2
    out = _expect(cases, "dp_null", 0, f"reshaping checkpoint {d}/D/iter_0000002 from (tp,pp,dp) (1, 1, 2) to "
                  f"(2, 1, 1): converted to its universal copy {d}/D_universal/iter_0000002")
    assert _trained(out) == [3]
    _old_style_copy(d / "D" / "iter_0000001", tmp_path / "iter_0000001")
    assert convert_checkpoint.main(["--load", str(tmp_path / "iter_0000001"), "--to", "universal",
                                    "--output", str(tmp_path / "u")]) == 0
    with open(tmp_path / "u" / "gptpar_universal.json") as f:
        assert json.load(f)["source"]["data_parallel_size"] == 2


def test_conversion_takes_the_lock_first_and_cleans_killed_conversions(cases):
    """The save folder is locked before the conversion starts; `.tmp-PID` folders of conversions whose job is
    gone are removed (with and without the job record), a live job's is left alone."""
    d, out = cases
    u = d / "D_universal"
    text = _expect(cases, "dp_null", 0, f"removing {u}/iter_0000002.tmp-{DEAD_PID}: the temporary folder of a "
                   "universal conversion", f"removing {u}/iter_0000001.tmp-{DEAD_PID + 1}: ")
    assert f"iter_0000002.tmp-{os.getpid()}" not in text
    assert out[0]["conversion_locked"][0] == [True]
    assert sorted(os.listdir(u)) == ["iter_0000002", f"iter_0000002.tmp-{os.getpid()}"]


def test_a_universal_copy_is_rebuilt_after_its_checkpoint_was_rewritten(cases):
    """After the rollback (iter_0000001 resumed, iteration 2 skipped, iter_0000002 saved again in place, so it
    holds iter_0000001's weights), the copy converted from the old iter_0000002 is rebuilt, in one line, and
    holds the new weights (DeepSpeed's own model files are the reference); unchanged files reuse it."""
    from gptpar.checkpoint import universal
    from gptpar.checkpoint.weights import read_checkpoint_weights

    d, _ = cases
    copy_dir = d / "D_universal" / "iter_0000002"
    _expect(cases, "stale", 0, f"the universal copy {copy_dir} was converted from other files than "
            f"{d}/D/iter_0000002 holds now", "rebuilding it", f"converted to its universal copy {copy_dir}")
    now, _, _ = read_checkpoint_weights(str(d / "D" / "iter_0000002"))
    rolled_back_to, _, _ = read_checkpoint_weights(str(d / "D" / "iter_0000001"))
    assert all(torch.equal(now[name], rolled_back_to[name]) for name in now)
    copy, _ = universal.read_weights(str(copy_dir))
    assert sorted(copy) == sorted(now)
    for name in now:
        assert torch.equal(copy[name], now[name]), name
    _expect(cases, "bf16", 0, f"read from its existing universal copy {copy_dir}")


def test_a_precision_change_at_the_same_shape(cases):
    """fp32 -> bf16 at the same (tp, pp, dp) goes through the universal form (their optimizer files differ: the
    rule's file names are the ones each checkpoint holds); fp32 -> fp16 is refused naming the field."""
    from gptpar.checkpoint import universal

    d, _ = cases
    out = _expect(cases, "bf16", 0, f"checkpoint {d}/D/iter_0000002 was saved with training.precision=fp32, whose "
                  "optimizer files a bf16 run does not load: going through its universal form",
                  f"resumed from universal checkpoint {d}/D_universal/iter_0000002: iteration 2")
    assert _trained(out) == [3]
    for ck, precision in ((d / "D" / "iter_0000002", "fp32"), (d / "BF" / "iter_0000003", "bf16")):
        for dp_rank in (0, 1):
            assert os.path.isfile(ck / universal.optimizer_states_file(precision, dp_rank, 0)), (ck, precision)
    assert universal.optimizer_files("bf16") != universal.optimizer_files("fp32") != universal.optimizer_files("fp16")
    out = _expect(cases, "fp16", 2, "pretrain_gpt.py: checkpoint error: ", "saved with training.precision=fp32",
                  "a training.precision=fp16 run cannot start from its universal form",
                  "resume it with training.precision=fp32")
    assert not log_lines(out)


def test_full_disk_during_the_conversion(cases):
    d, _ = cases
    out = _expect(cases, "convert_full", 2, f"could not write the universal copy {d}/F/iter_0000002: RuntimeError",
                  "torch's writer wrote fewer bytes than asked", "MiB free there now",
                  "set checkpoint.universal_dir to another folder")
    assert "Traceback" not in out and not log_lines(out)
    assert [name for name in os.listdir(d / "F")] == []  # the partial copy removed


def test_zero0_reshape_is_refused_with_the_fix_and_writes_nothing(cases):
    d, _ = cases
    _expect(cases, "zero0_reshape", 2, "was saved with training.zero_stage=0",
            "with training.zero_stage=0", "checkpoint.init_from")
    assert not os.path.exists(d / "K_universal")


def test_partition_method_at_pp1_is_no_new_shape(cases):
    d, _ = cases
    out = _expect(cases, "partition", 0, f"resumed from {d}/D/iter_0000002: iteration 2")
    assert "reshaping" not in out and "universal copy" not in out


def test_unreadable_files_name_themselves_before_the_model_is_built(cases):
    d, out = cases
    for name, message in (("init_truncated", f"checkpoint.init_from {d}/bad_init cannot be read as model weights: "
                                             f"{d}/bad_init is damaged: {d}/bad_init/{SHARD} is not a whole torch file"),
                          ("universal_truncated", f"{d}/bad_u/zero/layers.0.dense.weight/exp_avg.pt is not a whole "
                                                  "torch file"),
                          ("hf_without_weights", f"{d}/hf_config_only holds a Hugging Face config.json but no "
                                                 "weights")):
        text = _expect(cases, name, 2, "pretrain_gpt.py: checkpoint error: ", message)
        assert "Traceback" not in text
    assert out[0]["unreadable_built"][0] == out[1]["unreadable_built"][0] == 0


def _tool(*argv, file_size_limit=None):
    """A tool run as a user runs it: (exit code, stdout + stderr). `file_size_limit`: bytes any file it writes
    may hold (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a longer write fails with EFBIG, as on a full disk)."""
    import resource
    import subprocess

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    p = subprocess.run([sys.executable] + list(argv), cwd=ROOT, capture_output=True, text=True, timeout=stretched(300),
                       preexec_fn=limit if file_size_limit else None)
    return p.returncode, p.stdout + p.stderr


def test_offline_conversions_on_a_full_disk_leave_nothing(cases, tmp_path):
    """--to universal and --to hf with every written file limited to 16 KiB (a parameter's state, the
    safetensors file): one line naming the output, exit 1, and no folder left (no HF config.json alone)."""
    d, _ = cases
    for to in ("universal", "hf"):
        output = tmp_path / to
        rc, text = _tool("tools/convert_checkpoint.py", "--load", str(d / "D" / "iter_0000001"), "--to", to,
                         "--output", str(output), file_size_limit=16384)
        assert rc == 1 and f"error: could not write {output}: " in text and "Traceback" not in text, text[-3000:]
        assert "EFBIG" in text and "RLIMIT_FSIZE (`ulimit -f`) is 16384 bytes" in text, text[-3000:]
        assert "full disk" not in text.replace("not a full disk", ""), text[-3000:]
        assert os.listdir(tmp_path) == [], to


def test_tools_name_bad_paths_in_one_line(cases, tmp_path, capsys):
    """A truncated model-states file, a universal folder with a truncated state, a Hugging Face folder without
    weights, a --load that does not exist, an --output under a regular file, an unsupported model_type: each
    tool prints one line naming it and exits 2."""
    from gptpar.tools import convert_checkpoint
    from gptpar.tools import generate

    d, _ = cases
    bad = tmp_path / "iter_0000001"
    shutil.copytree(d / "D" / "iter_0000001", bad)
    _truncate(str(bad / SHARD))
    hf = tmp_path / "llama"
    shutil.copytree(d / "hf_config_only", hf)
    with open(hf / "config.json") as f:
        llama = dict(json.load(f), model_type="llama")
    with open(hf / "config.json", "w") as f:
        json.dump(llama, f)
    (tmp_path / "a_file").write_text("not a folder")
    cases_ = [
        (convert_checkpoint.main, ["--load", str(bad), "--to", "hf", "--output", str(tmp_path / "o1")],
         f"{bad}/{SHARD} is not a whole torch file"),
        (generate.main, ["--load", str(bad), "--prompt-ids", "1,2"], f"{bad}/{SHARD} is not a whole torch file"),
        (generate.main, ["--load", str(d / "bad_u"), "--prompt-ids", "1,2"],
         f"{d}/bad_u/zero/layers.0.dense.weight/fp32.pt is not a whole torch file"),
        (generate.main, ["--load", str(d / "hf_config_only"), "--prompt-ids", "1,2"],
         "holds a Hugging Face config.json but no weights"),
        (convert_checkpoint.main, ["--from-hf", str(d / "hf_config_only"), "--to", "gptpar",
                                   "--output", str(tmp_path / "o2")],
         "holds a Hugging Face config.json but no weights"),
        (generate.main, ["--load", str(tmp_path / "nothing"), "--prompt-ids", "1,2"],
         f"{tmp_path}/nothing does not exist"),
        (convert_checkpoint.main, ["--load", str(tmp_path / "nothing"), "--to", "universal",
                                   "--output", str(tmp_path / "o3")], f"{tmp_path}/nothing does not exist"),
        (convert_checkpoint.main, ["--load", str(d / "D"), "--to", "hf", "--output", str(tmp_path / "a_file" / "o")],
         f"{tmp_path}/a_file is a file, not a folder"),
        (convert_checkpoint.main, ["--from-hf", str(hf), "--to", "gptpar", "--output", str(tmp_path / "o4")],
         "model_type 'llama' is not supported"),
    ]
    for main, argv, message in cases_:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0], (argv, err)
    assert not any(name.startswith("o") for name in os.listdir(tmp_path))
