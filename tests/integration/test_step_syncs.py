"""A training step does not wait for the device between micro-batches: no device synchronisation from DeepSpeed
inside `TrainEngine.train_step` (its throughput timer, on by default, would synchronize twice per micro-batch), and
a bf16 step reads no device value on the host (DeepSpeed's own step reads the gradient norm to decide its NaN/Inf
skip; gptpar's decides it on the device, `DeviceSkip`).

Counted on the CPU accelerator, whose `synchronize` DeepSpeed calls exactly where it would on a GPU, and as
`aten._local_scalar_dense` calls (what `bool()`, `float()` and `.item()` of a tensor run: on a GPU each waits for
everything queued before it). The step's loss and gradient norm are read without waiting for the optimizer step
queued after them (`HostScalar`, gptpar/training/engine/host_scalar.py: its copy, made when the value is, is read
where an event says it is ready; its CUDA behaviour checked where a GPU is), so reads inside `HostScalar.value` are
not counted."""

import pytest
import torch

from gptpar.testing import run_distributed

TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 256,
        "make_vocab_size_divisible_by": 128}
MICRO_BATCHES = 4
STEPS = 3


class _HostReads:
    """Counts host reads of tensor values (`aten._local_scalar_dense`) made outside `HostScalar.value`, while
    entered (`with reads:`; `reads.count`)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.count, self.inside = 0, False

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default and not counter.inside:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        from gptpar.training.engine.host_scalar import HostScalar

        self.real = real = HostScalar.value

        def value(scalar):
            self.inside = True
            try:
                return real(scalar)
            finally:
                self.inside = False

        HostScalar.value = value
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        from gptpar.training.engine.host_scalar import HostScalar

        self.mode.__exit__(*exc)
        HostScalar.value = self.real


def _counts_per_step(timers_on: bool, skip_on_device: bool):
    """[(device synchronisations DeepSpeed makes, host reads of device values)] in each of STEPS bf16 train steps
    of MICRO_BATCHES micro-batches, the step's own reads included (`step_applied`, `grad_norm`: what the trainer reads
    after every step), with gptpar's generated config or with DeepSpeed's throughput timer left on, the NaN/Inf
    skip decided on the device or by DeepSpeed's host read."""
    from gptpar.parallel import init_parallel
    from gptpar.training.batches import SyntheticDataset, rank_micro_batches
    from gptpar.training.assembly import build_model, seed_everything
    from gptpar.config import config_from_dict
    from gptpar.training.engine import build_engine, deepspeed_config
    from gptpar.training.engine.deepspeed_api import accelerator

    pstate = init_parallel(1, 1, 1)
    cfg = config_from_dict({"model": dict(TINY), "training": {"micro_batch_size": 1, "global_batch_size":
                                                              MICRO_BATCHES, "train_iters": STEPS, "precision": "bf16"},
                            "data": {"synthetic": True}})
    ds = deepspeed_config(cfg, 1)
    if timers_on:
        ds.pop("timers")
    engine = build_engine(build_model(cfg, pstate, seed_everything(1, pstate)), pstate, ds, lr=1e-3,
                          skip_on_device=skip_on_device)
    data = SyntheticDataset(TINY["vocab_size"], TINY["seq_length"], 7)
    syncs, reads = [], _HostReads()
    acc = type(accelerator())
    real = acc.synchronize

    def counted(self, *args, **kwargs):
        syncs[-1] += 1
        return real(self, *args, **kwargs)

    acc.synchronize = counted
    counts = []
    try:
        for step in range(STEPS):
            syncs.append(0)
            reads.count = 0
            texts = rank_micro_batches(data, step * MICRO_BATCHES, MICRO_BATCHES, 1, 0, 1)
            with reads:
                engine.train_step([{"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()}
                                   for x in texts])
                assert engine.step_applied and engine.grad_norm > 0
            counts.append((syncs[-1], reads.count))
    finally:
        acc.synchronize = real
    return counts


def _trainer_counts():
    """{report on/off: (device synchronisations, host reads of device values)} over a whole 2-rank Trainer run of
    ITERS iterations with a log line at every one, the straggler report on (its default) or off; the synchronisations
    are DeepSpeed's (the accelerator's) and, on a GPU, torch.cuda's (device, stream and event waits)."""
    import os

    import torch.distributed as dist

    from gptpar.parallel import init_parallel
    from gptpar.testing.runs import write_config
    from gptpar.training.assembly import build_trainer
    from gptpar.training.cli import parse
    from gptpar.training.collectives import CollectiveLog
    from gptpar.training.engine.deepspeed_api import accelerator

    syncs = [0]
    patched = [(type(accelerator()), "synchronize")]
    if torch.cuda.is_available():
        patched += [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in patched]

    def counting(real):
        def wrapper(*args, **kwargs):
            syncs[0] += 1
            return real(*args, **kwargs)
        return wrapper

    collectives, pstate, counts = CollectiveLog().install(), None, {}
    for threshold in (None, 1.2):
        path = write_config(f"/tmp/gptpar_syncs_{os.getpid()}.json", parallel=dict(data_parallel_size=2),
                            training=dict(train_iters=ITERS, eval_interval=None, precision="bf16"),
                            logging=dict(log_interval=1, straggler_threshold=threshold))
        cfg, _, (tp, pp, dp) = parse(["--config", path])
        os.remove(path)
        pstate = pstate or init_parallel(tp, pp, dp)
        trainer = build_trainer(cfg, pstate, lambda *a, **k: None, None, collectives=collectives)
        trainer.log = lambda *a, **k: None
        assert (trainer.straggler is not None) == (threshold is not None)
        reads = _HostReads()
        syncs[0] = 0
        for owner, name, real in originals:
            setattr(owner, name, counting(real))
        try:
            with reads:
                trainer.train()
        finally:
            for owner, name, real in originals:
                setattr(owner, name, real)
        counts["on" if threshold else "off"] = (syncs[0], reads.count)
        dist.barrier()
    return counts


ITERS = 8


def test_the_straggler_report_adds_no_device_wait_to_the_trainer():
    """The Trainer's synchronisations and host reads of device values over a run with a log line at every
    iteration are the same with the straggler report on as off (its clocks are read one log interval late,
    queried: gptpar.training.collectives.RankClock), on every rank."""
    for counts in run_distributed(_trainer_counts, 2, timeout=600):
        assert counts["on"] == counts["off"], counts


def _three_ways():
    return {"gptpar": _counts_per_step(False, True), "timers_on": _counts_per_step(True, True),
            "read_on_host": _counts_per_step(False, False)}


@pytest.fixture(scope="module")
def counts():
    return run_distributed(_three_ways, 1, timeout=300)[0]


def test_a_step_does_not_synchronize_the_device_per_micro_batch(counts):
    """The third step (DeepSpeed's timer starts after two)."""
    assert counts["timers_on"][-1][0] == 2 * MICRO_BATCHES  # what the generated config turns off (the test can see it)
    assert counts["gptpar"][-1][0] == 0


def test_a_bf16_step_reads_nothing_from_the_device(counts):
    """With the NaN/Inf skip decided on the device a bf16 step makes no host read of a device value once the
    optimizer has state (the first step keeps DeepSpeed's read: its skip must not create the state); DeepSpeed's
    own decision reads the norm in every step."""
    assert [reads for _, reads in counts["gptpar"]] == [1] + [0] * (STEPS - 1)
    assert [reads for _, reads in counts["read_on_host"]] == [1] * STEPS


def test_host_scalar_reads_numbers_tensors_and_the_copy_a_tensor_carries():
    from gptpar.training.engine.host_scalar import HostScalar

    t = torch.tensor(2.5)
    assert HostScalar(t * 2).value() == 5.0
    assert HostScalar.read(1.25) == 1.25 and HostScalar.read(t) == 2.5
    t.host_scalar = HostScalar(torch.tensor(-1.0))  # the carried copy is what is read
    assert HostScalar.read(t) == -1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_host_scalar_does_not_wait_for_work_queued_after_it_cuda():
    """`value()` returns while the device still runs what was queued after the scalar was made; `float()` of the
    same tensor waits for all of it (the stream is idle after it): what the step's loss and norm avoid."""
    from gptpar.training.engine.host_scalar import HostScalar

    x = torch.full((), 3.5, device="cuda")
    scalar = HostScalar(x * 2)
    torch.cuda._sleep(2_000_000_000)  # about a second of device time, queued after the copy
    assert scalar.value() == 7.0
    assert not torch.cuda.current_stream().query()  # still sleeping: value() did not wait for it
    y = x * 2
    torch.cuda._sleep(200_000_000)
    assert float(y) == 7.0 and torch.cuda.current_stream().query()  # float() waited for the whole stream


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_device_skip_steps_torchs_fused_adamw_without_a_host_read(device):
    """`DeviceSkip` on a stand-in of DeepSpeed's engine around torch's fused AdamW: a NaN or Inf norm leaves the
    weights, both moments and the step count as they were, a finite one steps; deciding queues work only (on a
    GPU the step returns while the device still sleeps before the norm), and `settle` then counts the skip as
    DeepSpeed's engine does."""
    from types import SimpleNamespace

    from deepspeed.runtime.utils import is_invalid_grad_norm

    from gptpar.training.engine.deepspeed_api import DeviceSkip, global_grad_norm

    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(300, generator=g).to(device))
    client = torch.optim.AdamW([param], lr=0.1, weight_decay=0.1, fused=True)
    param.grad = torch.randn(300, generator=g).to(device)
    client.step()  # the state exists: later steps are decided on the device
    engine = SimpleNamespace(optimizer=SimpleNamespace(optimizer=client, overflow=False, _global_grad_norm=None),
                             _global_grad_norm=None, _step_applied=True, skipped_steps=0)
    skip = DeviceSkip(engine, is_invalid_grad_norm)
    for bad, skipped in ((float("nan"), 1), (None, 1), (float("inf"), 2)):
        grad = torch.randn(300, generator=g).to(device)
        if bad is not None:
            grad[7] = bad
        before = [param.detach().clone()] + [v.clone() for v in client.state[param].values()]
        engine._step_applied = True  # as DeepSpeed's _take_model_step leaves it, not knowing
        if device == "cuda":
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device time before the norm
        norm = global_grad_norm([grad])
        assert skip.decide(norm) is False
        param.grad = grad
        client.step()
        skip.step_done()
        if device == "cuda":
            assert not torch.cuda.current_stream().query()  # nothing waited for the device
        skip.settle()
        after = [param.detach()] + list(client.state[param].values())
        assert all(torch.equal(a, b) for a, b in zip(before, after)) == (bad is not None)
        assert engine._step_applied == (bad is None) and engine.skipped_steps == skipped
        assert "found_inf" not in vars(client)
    assert engine.optimizer.overflow and engine._global_grad_norm == float("inf")
