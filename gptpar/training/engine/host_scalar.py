"""`HostScalar`: a device scalar's value for the host, without waiting for the device work queued after it (the
step's loss and gradient norm, read by the log line while the optimizer step still runs)."""
from __future__ import annotations

import torch


class HostScalar:
    """A scalar tensor's value for the host, read as soon as the device work queued before it is done.

    `float(t)` of a CUDA tensor waits for everything queued on the stream so far: read after `step()`, the loss
    made the host wait for the whole optimizer step (clip, AdamW, the bf16 weight copy) before
    it could log and queue the next forward, and the device idled meanwhile. Here the value is copied into
    pinned host memory when it is made (a non-blocking copy and an event on the current stream); `value()` waits
    for that event only. On a CPU the tensor is read as it is."""

    def __init__(self, tensor: torch.Tensor):
        tensor = tensor.detach()
        self.event = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def value(self) -> float:
        if self.event is not None:
            self.event.synchronize()
        return float(self.host)

    @staticmethod
    def read(value) -> float:
        """A number, a tensor, or a tensor carrying its HostScalar (`tensor.host_scalar`) as a float."""
        copy = getattr(value, "host_scalar", None)
        return copy.value() if copy is not None else float(value)
