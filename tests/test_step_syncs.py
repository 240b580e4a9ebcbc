"""A training step does not wait for the device between micro-batches: no device synchronisation from DeepSpeed
inside `TrainEngine.train_step` (its throughput timer, on by default, would synchronize twice per micro-batch).

Counted on the CPU accelerator, whose `synchronize` DeepSpeed calls exactly where it would on a GPU. The step's
loss and gradient norm are read without waiting for the optimizer step queued after them (`HostScalar`,
gptpar/training/engine/host_scalar.py; its CUDA behaviour checked where a GPU is)."""

import pytest
import torch

from gptpar.testing import run_distributed

TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 256,
        "make_vocab_size_divisible_by": 128}
MICRO_BATCHES = 4


def _synchronizations_per_step(timers_on: bool):
    """Device synchronisations DeepSpeed makes during the third train step of 4 micro-batches (its timer starts
    after two), with gptpar's generated config or with DeepSpeed's throughput timer left on."""
    from gptpar.parallel import init_parallel
    from gptpar.training.batches import SyntheticDataset, rank_micro_batches
    from gptpar.training.build import build_model, seed_everything
    from gptpar.config import config_from_dict
    from gptpar.training.engine import build_engine, deepspeed_config
    from gptpar.training.engine.deepspeed_api import accelerator

    pstate = init_parallel(1, 1, 1)
    cfg = config_from_dict({"model": dict(TINY), "training": {"micro_batch_size": 1, "global_batch_size":
                                                              MICRO_BATCHES, "train_iters": 3, "precision": "bf16"},
                            "data": {"synthetic": True}})
    ds = deepspeed_config(cfg, 1)
    if timers_on:
        ds.pop("timers")
    engine = build_engine(build_model(cfg, pstate, seed_everything(1, pstate)), pstate, ds, lr=1e-3)
    data = SyntheticDataset(TINY["vocab_size"], TINY["seq_length"], 7)
    counts = []
    acc = type(accelerator())
    real = acc.synchronize

    def counted(self, *args, **kwargs):
        counts[-1] += 1
        return real(self, *args, **kwargs)

    acc.synchronize = counted
    try:
        for step in range(3):
            counts.append(0)
            texts = rank_micro_batches(data, step * MICRO_BATCHES, MICRO_BATCHES, 1, 0, 1)
            engine.train_step([{"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()}
                               for x in texts])
    finally:
        acc.synchronize = real
    return counts[-1]


def _both():
    return _synchronizations_per_step(False), _synchronizations_per_step(True)


def test_a_step_does_not_synchronize_the_device_per_micro_batch():
    gptpar, deepspeed_default = run_distributed(_both, 1, timeout=300)[0]
    assert deepspeed_default == 2 * MICRO_BATCHES  # what the generated config turns off (the test can see it)
    assert gptpar == 0


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
