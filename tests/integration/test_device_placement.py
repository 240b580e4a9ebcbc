"""Every tensor the trainer feeds the model goes through the engine's one device placement.

On a GPU the data pipeline builds micro-batches on the host and the model lives on cuda: a tensor that skips
`gptpar.training.engine.to_device` fails there ("index is on cpu, different from other tensors on cuda:0").
CI has no GPU, so the ranks here hand the trainer micro-batches whose tensors are `HostOnly`: a tensor that
may be moved (`.to(device)` returns a plain tensor) but raises on any other use. Every key a micro-batch can
hold (tokens, labels, loss mask, position ids, attention mask) is there, through pp = 1 and pp = 2, in
training and in evaluation.
"""
import pytest
import torch

from gptpar.testing import run_distributed
from gptpar.testing.runs import log_lines, run_mains, write_config

# Reading metadata is fine before placement; anything that computes with the data is not.
_METADATA = {"shape", "dtype", "device", "is_cuda", "requires_grad", "size", "dim", "ndim", "numel",
             "is_floating_point", "__len__"}


class HostOnly(torch.Tensor):
    """A batch tensor still on the host: it may be moved to a device, nothing else."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func in (torch.Tensor.to, torch.Tensor.cuda) or name in _METADATA or \
                getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        raise RuntimeError(f"a micro-batch tensor was used by {name or func} before the engine placed it on its "
                           "device (on a GPU: 'Expected all tensors to be on the same device')")


def _host_only_batches():
    """Patch the trainer's data source: every micro-batch holds all five keys, as HostOnly tensors."""
    from gptpar.training import sources as data

    real = data.BatchSource.micro_batches

    def micro_batches(self, consumed, global_batch_size):
        out = []
        for mb in real(self, consumed, global_batch_size):
            b, s = mb["input_ids"].shape
            mb = dict(mb, loss_mask=torch.ones(b, s), position_ids=torch.arange(s).expand(b, s).contiguous(),
                      attention_mask=torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s).contiguous())
            out.append({k: v.as_subclass(HostOnly) for k, v in mb.items()})
        return out

    data.BatchSource.micro_batches = micro_batches
    data.MaskOptions.has_attention_mask = property(lambda self: True)  # the pipeline carries the mask


def _train_with_host_only_batches(plan):
    _host_only_batches()
    return run_mains(plan)


def test_host_only_tensor_refuses_use_but_moves():
    t = torch.arange(4).as_subclass(HostOnly)
    with pytest.raises(RuntimeError, match="before the engine placed it"):
        torch.nn.functional.embedding(t, torch.zeros(4, 2))
    with pytest.raises(RuntimeError, match="before the engine placed it"):
        t + 1
    moved = t.to("cpu")
    assert type(moved) is torch.Tensor and moved.tolist() == [0, 1, 2, 3] and t.shape == (4,)


@pytest.mark.parametrize("pp", [1, 2])
def test_every_batch_tensor_reaches_the_model_placed(tmp_path, pp):
    """Train 3 iterations and evaluate twice at pp = 1 (dp 2) and pp = 2 (dp 1); the losses are finite and
    evaluation ran, so every tensor of every micro-batch was placed before use."""
    cfg = write_config(tmp_path / "c.json", parallel=dict(pipeline_model_parallel_size=pp, data_parallel_size=2 // pp),
                       training=dict(train_iters=3, eval_interval=2, eval_iters=1))
    out = run_distributed(_train_with_host_only_batches, 2, ([("run", ["--config", cfg])],), timeout=300)
    printed = "".join(rank["run"][1] for rank in out)
    assert all(rank["run"][0] == 0 for rank in out), printed
    assert len(log_lines(printed)) == 3 and "validation loss at iteration 2" in printed, printed
