"""The one durable write, checked from the file-system calls a real save makes: every file fsynced, the manifest
last, the new folder fsynced before `latest` names it, the save folder fsynced after `latest` is renamed and before
an older checkpoint is pruned; a universal conversion fsyncs every file it writes and its folder; a re-saved tag is
swapped in, never rewritten, and a swap cut short by a crash is put back at the next start."""
import errno
import os
import shutil

import pytest

from gptpar.checkpoint import durable
from gptpar.checkpoint.layout import MANIFEST, is_complete
from gptpar.testing import run_distributed
from gptpar.testing.runs import run_mains, write_config


def _recording(events):
    """Wrap os.fsync, os.rename, os.replace and shutil.rmtree so that each call is appended to `events` as
    (what, path[, destination]) in the order they happen; a descriptor is named by the path it was opened with."""
    real_fsync, real_rename, real_replace, real_rmtree = os.fsync, os.rename, os.replace, shutil.rmtree

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst, *args, **kwargs):
        events.append(("rename", os.path.abspath(src), os.path.abspath(dst)))
        return real_rename(src, dst, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        events.append(("replace", os.path.abspath(src), os.path.abspath(dst)))
        return real_replace(src, dst, *args, **kwargs)

    def rmtree(path, *args, **kwargs):
        events.append(("rmtree", os.path.abspath(path)))
        return real_rmtree(path, *args, **kwargs)

    os.fsync, os.rename, os.replace, shutil.rmtree = fsync, rename, replace, rmtree


def _save_recorded(config):
    """One rank: gptpar.training.pretrain.main with the file-system calls recorded."""
    events = []
    _recording(events)
    out = run_mains([("run", ["--config", config])])
    return out["run"], events


def _index(events, predicate, after=-1):
    return next(i for i, e in enumerate(events) if i > after and predicate(e))


def test_a_save_is_ordered_on_disk(tmp_path):
    """Save every iteration with keep_last=1, 3 iterations: for iteration 3's save, every file of the new folder is
    fsynced before the manifest is put in place, the manifest before the folder is fsynced, the folder before it is
    renamed into place, the save folder after that and before `latest` moves; `latest` is fsynced and renamed, the
    save folder fsynced again, and only then is iteration 2's checkpoint deleted."""
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", parallel=dict(data_parallel_size=1),
                       training=dict(train_iters=3, lr_warmup_iters=1),
                       checkpoint=dict(save=ck, save_interval=1, keep_last=1))
    ((rc, output), events), = run_distributed(_save_recorded, 1, (cfg,), timeout=300)
    assert rc == 0, output
    final = os.path.join(ck, "iter_0000003")
    i_rename = _index(events, lambda e: e[0] == "rename" and e[2] == final)
    tmp = events[i_rename][1]
    assert os.path.basename(tmp).startswith("iter_0000003.tmp-")
    files = sorted(os.listdir(final))
    fsynced = [e[1] for e in events[:i_rename] if e[0] == "fsync"]
    i_manifest = _index(events, lambda e: e[0] == "replace" and e[2] == os.path.join(tmp, MANIFEST))
    for name in files:  # every file, the manifest's temporary name included, fsynced before the manifest lands
        if name != MANIFEST:
            assert os.path.join(tmp, name) in [e[1] for e in events[:i_manifest] if e[0] == "fsync"], name
    assert any(os.path.basename(path).startswith(f".{MANIFEST}.tmp-") for path in fsynced)
    i_folder = _index(events, lambda e: e == ("fsync", tmp), after=i_manifest)
    assert i_folder < i_rename
    i_parent = _index(events, lambda e: e == ("fsync", ck), after=i_rename)
    i_latest = _index(events, lambda e: e[0] == "replace" and e[2] == os.path.join(ck, "latest"), after=i_rename)
    assert i_parent < i_latest
    assert events[i_latest - 1][0] == "fsync" and os.path.basename(events[i_latest - 1][1]).startswith(".latest.tmp-")
    i_parent_again = _index(events, lambda e: e == ("fsync", ck), after=i_latest)
    i_prune = _index(events, lambda e: e[0] == "rename" and e[1] == os.path.join(ck, "iter_0000002"))
    aside = events[i_prune][2]  # the pruned folder leaves its name before any of its files goes
    assert os.path.basename(aside).startswith("iter_0000002.tmp-retired-")
    i_gone = _index(events, lambda e: e == ("rmtree", aside), after=i_prune)
    assert i_latest < i_parent_again < i_prune < _index(events, lambda e: e == ("fsync", ck), after=i_prune) < i_gone
    # DeepSpeed's scripts, the run's config, the last save's duration (gptpar.launch's stop grace)
    others = {"zero_to_fp32.py", "zero_to_torch.py", "resolved_config.json", ".gptpar-save-times.json"}
    assert sorted(set(os.listdir(ck)) - others) == ["iter_0000003", "latest"]


def _convert_recorded(ckpt, out):
    from gptpar.checkpoint import universal

    events = []
    _recording(events)
    universal.convert_deepspeed_checkpoint(ckpt, out, log=lambda *a: None)
    return events


def test_a_universal_conversion_fsyncs_every_file_and_its_folder(tmp_path):
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", parallel=dict(data_parallel_size=1),
                       training=dict(train_iters=1, lr_warmup_iters=0), checkpoint=dict(save=ck))
    out, = run_distributed(run_mains, 1, ([("run", ["--config", cfg])],), timeout=300)
    assert out["run"][0] == 0, out["run"][1]
    out = str(tmp_path / "u")
    events, = run_distributed(_convert_recorded, 1, (os.path.join(ck, "iter_0000001"), out), timeout=300)
    i_rename = _index(events, lambda e: e[0] == "rename" and e[2] == os.path.abspath(out))
    tmp = events[i_rename][1]
    fsynced = {e[1] for e in events[:i_rename] if e[0] == "fsync"}
    for root, _, names in os.walk(out):  # every file and every folder (their entries) of the copy
        for name in names:
            if name == MANIFEST:  # written under a temporary name, fsynced, then renamed
                assert any(os.path.basename(p).startswith(f".{MANIFEST}.tmp-") for p in fsynced)
                continue
            assert os.path.join(tmp, os.path.relpath(os.path.join(root, name), out)) in fsynced, name
        assert os.path.normpath(os.path.join(tmp, os.path.relpath(root, out))) in fsynced, root
    assert ("fsync", str(tmp_path)) in events[i_rename:]  # the parent, after the rename


def test_a_resaved_tag_is_swapped_in_and_a_cut_swap_is_put_back(tmp_path):
    from gptpar.checkpoint.save_folder import clean_leftovers

    def write(target, text, token):
        staged = durable.StagedFolder(str(target), token)
        (open(os.path.join(staged.create(), "file"), "w")).write(text)
        return staged

    target = tmp_path / "iter_0000002"
    write(target, "first", "1").commit("checkpoint", log=lambda *a: None)
    inode = os.stat(target / "file").st_ino
    staged = write(target, "second", "2")
    with pytest.raises(durable.CheckpointError, match="appeared while"):  # not asked to replace: refused
        staged.commit("checkpoint", log=lambda *a: None)
    staged.publish(lambda *a: None, replace=True)
    assert (target / "file").read_text() == "second" and os.stat(target / "file").st_ino != inode
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002"]

    # a crash between the swap's two renames: the previous folder is aside, the new one not yet in place
    os.rename(target, tmp_path / "iter_0000002.old-7")
    os.makedirs(tmp_path / "iter_0000003.tmp-7")
    lines = []
    clean_leftovers(str(tmp_path), lines.append)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002"] and is_complete(str(target))
    assert (target / "file").read_text() == "second"
    assert any("restoring" in line for line in lines) and any("removing partial checkpoint" in line for line in lines)


def _complete_checkpoint(directory, tag, files=6):
    """A folder with the names and manifest of a saved checkpoint (the bytes do not matter to pruning)."""
    path = os.path.join(directory, tag)
    os.makedirs(path)
    for i in range(files):
        with open(os.path.join(path, f"mp_rank_{i:02d}_model_states.pt"), "wb") as f:
            f.write(os.urandom(64))
    durable.write_manifest(path, "checkpoint", log=lambda *a: None, iteration=int(tag[5:]), world_size=1)
    return path


def test_a_prune_cut_short_leaves_nothing_that_counts_as_complete(tmp_path, monkeypatch):
    """keep_last=1 prunes iter_1 once `latest` names iter_2; the process dies (here: raises) right after the prune's
    first unlink. No folder left may be taken for a complete checkpoint: not by a resume of the save folder or of
    the folder itself, not by the fix text for a damaged `latest`, not by the next start's clean-up."""
    from gptpar.checkpoint.checkpointer import Checkpointer
    from gptpar.checkpoint.exceptions import CheckpointError
    from gptpar.checkpoint.layout import complete_checkpoints, resolve_load
    from gptpar.checkpoint.save_folder import clean_leftovers

    ck = str(tmp_path / "ck")
    old = _complete_checkpoint(ck, "iter_0000001")
    _complete_checkpoint(ck, "iter_0000002")
    durable.publish_latest(ck, "iter_0000002", log=lambda *a: None)

    class Killed(BaseException):
        """The process ending mid-prune (not an OSError: nothing may catch it)."""

    real_unlink, unlinked = os.unlink, []

    def unlink_then_die(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        unlinked.append(path)
        raise Killed()

    ckpt = Checkpointer(ck, None, 1, 0, 1, {}, "{}", log=lambda *a, **k: None)
    monkeypatch.setattr(os, "unlink", unlink_then_die)
    monkeypatch.setattr(os, "remove", unlink_then_die)
    with pytest.raises(Killed):
        ckpt._prune(2)
    monkeypatch.undo()
    assert len(unlinked) == 1
    assert complete_checkpoints(ck) == ["iter_0000002"] and not os.path.exists(old)
    leftovers = [name for name in os.listdir(ck) if name.startswith("iter_0000001")]
    assert len(leftovers) == 1  # renamed aside, one file gone
    aside = os.path.join(ck, leftovers[0])
    assert not is_complete(aside)
    with pytest.raises(CheckpointError):  # a resume pointed at what is left of it
        resolve_load(aside)
    with open(os.path.join(ck, "latest"), "w") as f:  # a damaged `latest`: its fix names only iter_2
        f.write("garbage")
    with pytest.raises(CheckpointError) as refused:
        resolve_load(ck)
    durable.publish_latest(ck, "iter_0000003", log=lambda *a: None)  # names a folder that is not there
    with pytest.raises(CheckpointError, match="the newest complete checkpoint there is iter_0000002") as refused:
        resolve_load(ck)
    assert "iter_0000001" not in str(refused.value)
    lines = []
    clean_leftovers(ck, lines.append)  # the next start deletes it and puts nothing back
    assert sorted(os.listdir(ck)) == ["iter_0000002", "latest"], lines
    assert any("keep_last was deleting" in line for line in lines)


def test_a_file_system_that_cannot_fsync_a_folder_is_said_once(tmp_path, monkeypatch):
    real = os.fsync

    def refuse_folders(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd)

    monkeypatch.setattr(os, "fsync", refuse_folders)
    monkeypatch.setattr(durable, "_said_unsupported", set())
    lines = []
    for _ in range(3):
        durable.fsync_dir(str(tmp_path), lines.append)
    assert len(lines) == 1 and "does not fsync directories (EINVAL)" in lines[0]

    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):  # any other failure is a failed write
        durable.fsync_dir(str(tmp_path), lines.append)


# Run in a child process: its file-size limit (RLIMIT_FSIZE) makes torch's writes fail with EFBIG, as a real limit
# does (Python ignores SIGXFSZ); a torch.save into /dev/full fails as a full disk does.
_WRITE_FAILURES = """
import resource, sys, torch
from gptpar.checkpoint.durable import describe_write_failure
folder, limit = sys.argv[1], int(sys.argv[2])
if limit:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
for how in ("file", "path", "full"):
    try:
        if how == "file":
            with open(folder + "/x.pt", "wb") as f:
                torch.save(torch.zeros(100000), f)
        else:
            torch.save(torch.zeros(100000), "/dev/full" if how == "full" else folder + "/y.pt")
        print(how, "written")
    except RuntimeError as e:
        print(how, describe_write_failure(folder, e))
"""


def test_a_write_refused_by_a_file_size_limit_is_not_called_a_full_disk(tmp_path):
    """torch.save under RLIMIT_FSIZE (the EFBIG a user's `ulimit -f` or a file system's largest file gives):
    through a file object (gptpar's writers) the errno reaches the message; through a path torch keeps none, and
    the limit is named from getrlimit. Neither says a full disk, while the disk has room. ENOSPC, EDQUOT and
    safetensors' `os error N` are named by their errno."""
    import subprocess
    import sys

    from gptpar.testing import ROOT

    run = subprocess.run([sys.executable, "-c", _WRITE_FAILURES, str(tmp_path), "16384"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert set(lines) == {"file", "path", "full"}, run.stdout + run.stderr
    assert "(EFBIG: file too large for a limit, not a full disk: this process's file-size limit RLIMIT_FSIZE " \
           "(`ulimit -f`) is 16384 bytes: raise it)" in lines["file"]
    assert "without an errno: likely EFBIG: this process's file-size limit RLIMIT_FSIZE (`ulimit -f`) is 16384 " \
           "bytes" in lines["path"]
    assert not any("full disk" in text and "not a full disk" not in text for text in lines.values())
    # no limit: /dev/full as torch reports it (no errno): not guessed a full disk where the folder has room
    run = subprocess.run([sys.executable, "-c", _WRITE_FAILURES, str(tmp_path), "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert lines["file"] == "written" and "wrote fewer bytes than asked, without an errno" in lines["full"]
    free = shutil.disk_usage(str(tmp_path)).free
    expected = "likely ENOSPC" if free < durable._LOW_SPACE else "not a full disk by the free space"
    assert expected in lines["full"], lines["full"]
    for code, word in ((errno.ENOSPC, "ENOSPC: no space left on the device"), (errno.EDQUOT, "EDQUOT: this user's "
                       "disk quota is used up"), (errno.EFBIG, "EFBIG: file too large for a limit")):
        assert word in durable.describe_write_failure(str(tmp_path), OSError(code, os.strerror(code)))
    safetensors_like = RuntimeError("I/O error: Disk quota exceeded (os error 122)")
    assert "EDQUOT" in durable.describe_write_failure(str(tmp_path), safetensors_like)
