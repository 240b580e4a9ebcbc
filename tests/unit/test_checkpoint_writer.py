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
