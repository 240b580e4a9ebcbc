"""gptpar's checkpoint writer on its own (no processes, no DeepSpeed): an async save writes the bytes `torch.save`
writes of the state at the save, whatever changes after the snapshot copy, and records their size and sha256; a
blocking save's failure is kept for the job instead of raised."""
import hashlib
import io
import time
import types

import torch

from gptpar.checkpoint import writer as checkpoint_writer
from gptpar.checkpoint.writer import CheckpointWriter


def _state():
    """Shapes of what DeepSpeed saves: views sharing one storage (ZeRO's flat buffers), a Parameter, a non-leaf
    view that requires grad (ZeRO-1's fp32 partitions), a 0-d step tensor, an object (the fp16 loss scaler)."""
    flat = torch.arange(1000, dtype=torch.float32)
    master = torch.linspace(0, 1, 64, requires_grad=True)
    scaler = types.SimpleNamespace(cur_scale=1024.0)
    return {"module": {"w": flat[10:20].view(2, 5), "b": flat[20:30]}, "flat": flat,
            "param": torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)), "partition": master[:32],
            "step": torch.tensor(7.0), "loss_scaler": scaler, "lr": 1e-3}


def _torch_save_bytes(state) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def test_an_async_save_holds_the_state_at_the_save(tmp_path, monkeypatch):
    real_copy = checkpoint_writer._Snapshot.copy

    def late_copy(self):  # the copy still runs when the caller reaches its next "optimizer step"
        time.sleep(0.3)
        real_copy(self)

    monkeypatch.setattr(checkpoint_writer._Snapshot, "copy", late_copy)
    state = _state()
    expected = _torch_save_bytes(state)
    writer = CheckpointWriter(async_save=True, checksums=True)
    path = str(tmp_path / "file.pt")
    writer.save(state, path)
    jobs = []
    writer.start(lambda records, error: jobs.append((records, error)) or "done", name="t")
    writer.wait_for_snapshot()  # what the optimizer step hook does: then the live tensors change in place
    with torch.no_grad():
        state["flat"].add_(1.0)
        state["param"].mul_(3)
        state["partition"].zero_()
        state["step"].add_(1)
    state["loss_scaler"].cur_scale = 512.0
    assert writer.wait() == "done"
    data = (tmp_path / "file.pt").read_bytes()
    assert data == expected  # the same bytes as a blocking torch.save at the save
    (records, error), = jobs
    assert error is None and records == {path: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


def test_a_blocking_save_keeps_its_failure_for_the_job(tmp_path):
    writer = CheckpointWriter(async_save=False, checksums=False)
    writer.save({"x": torch.ones(2)}, str(tmp_path / "missing_folder" / "a.pt"))
    writer.save({"x": torch.ones(2)}, str(tmp_path / "b.pt"))  # not written: the save is lost already
    jobs = []
    writer.start(lambda records, error: jobs.append((records, error)), name="t")
    (records, error), = jobs
    assert isinstance(error, FileNotFoundError) and records == {}
    assert not (tmp_path / "b.pt").exists()


def _files(n=3):
    """States of several files, each with storages of various sizes (shared ones included)."""
    files, generator = [], torch.Generator().manual_seed(5)
    for i in range(n):
        state = _state()
        state["big"] = torch.randn(50_000 + 1000 * i, generator=generator)  # 200 KB: larger than the others together
        state["shared"] = [state["big"][:10], state["big"][5:]]  # views of one storage, written once
        files.append(state)
    return files


def _save_files(tmp_path, name, files, **writer_kwargs):
    """Save `files` as one async save, change every live tensor once the snapshot is taken, return the bytes."""
    writer = CheckpointWriter(async_save=True, checksums=True, **writer_kwargs)
    paths = [str(tmp_path / f"{name}_{i}.pt") for i in range(len(files))]
    for state, path in zip(files, paths):
        writer.save(state, path)
    jobs = []
    writer.start(lambda records, error: jobs.append((records, error)) or "done", name=name)
    writer.wait_for_snapshot()
    with torch.no_grad():
        for state in files:
            state["big"].mul_(-2)
            state["flat"].add_(1.0)
    assert writer.wait() == "done" and jobs[0][1] is None, jobs
    return [open(path, "rb").read() for path in paths], writer


def test_a_bounded_snapshot_writes_the_same_bytes_within_its_bound(tmp_path):
    """A bound smaller than the state (one big storage at a time) gives the bytes of the unbounded snapshot and of a
    blocking torch.save at the save, file by file; the host memory it held never passed the bound."""
    expected = [_torch_save_bytes(state) for state in _files()]
    unbounded, _ = _save_files(tmp_path, "unbounded", _files())
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for state in _files()
                for t in (state["big"], state["flat"])}
    limit = max(storages.values()) + 8192  # the largest storage and a few small ones
    bounded, writer = _save_files(tmp_path, "bounded", _files(), host_limit=limit)
    assert bounded == unbounded == expected
    total = sum(storages.values())
    assert 0 < writer.snapshot_peak_bytes <= limit < total / 2


def test_a_bounded_snapshot_keeps_resident_memory_within_its_bound(tmp_path):
    """The process's resident memory during a save of 8 x 16 MiB tensors: the whole state with buffers for all of
    it, less than the 32 MiB bound plus allocator slack through the bounded pool (read from /proc/self/statm)."""
    import os
    import threading

    page = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    def peak_growth(**kwargs):
        state = {f"t{i}": torch.full((4 * 2 ** 20,), float(i)) for i in range(8)}  # 8 x 16 MiB of fp32
        base, peak, stop = rss(), [0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], rss() - base)
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            writer = CheckpointWriter(async_save=True, checksums=False, **kwargs)
            writer.save(state, str(tmp_path / "big.pt"))
            writer.start(lambda records, error: error, name="big")
            assert writer.wait() is None
        finally:
            stop.set()
            sampler.join()
        return peak[0]

    mib = 2 ** 20
    assert peak_growth() > 100 * mib  # the unbounded snapshot: 128 MiB of buffers
    assert peak_growth(host_limit=32 * mib) < 32 * mib + 24 * mib
