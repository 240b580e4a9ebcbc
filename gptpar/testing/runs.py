"""The trainer tests' runs: a tiny config, ranks of pretrain_gpt.py started by hand, the trainer's main inside
harness ranks.

Every expected number in the tests is recomputed here or in the test from the contract's formulas,
never copied from a previous run.
"""
import contextlib
import copy
import io
import json
import math
import os
import subprocess
import sys

from gptpar.testing import ROOT, free_port
from gptpar.testing.deadline import communicate
from gptpar.training.engine import allow_fp16_on_cpu


TINY = {
    "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
              "vocab_size": 200, "make_vocab_size_divisible_by": 128},
    "parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 2},
    "training": {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 6, "lr": 1e-3, "min_lr": 1e-4,
                 "lr_warmup_iters": 2, "lr_decay_style": "cosine", "weight_decay": 0.01, "adam_beta2": 0.95,
                 "clip_grad": 1.0, "seed": 1234, "precision": "fp32", "zero_stage": 1, "eval_interval": None},
    "data": {"synthetic": True},
    "checkpoint": {},
    "logging": {"log_interval": 1},
}


def rank_env(**extra):
    """The environment of a rank started by hand (CPU, one thread, unbuffered output)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def launch_ranks(world_size, argv, script=os.path.join(ROOT, "pretrain_gpt.py"), own_group=False, **extra_env):
    """Start `world_size` ranks of `script` (pretrain_gpt.py) by hand, with the launcher's environment variables.
    `own_group`: all ranks in one new process group (its id is rank 0's pid), for a SIGKILL of the whole job."""
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = rank_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra_env)
        group = {} if not own_group else {"process_group": 0 if rank == 0 else procs[0].pid}
        procs.append(subprocess.Popen([sys.executable, script] + argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, **group))
    return procs


def finish_ranks(procs, timeout=120):
    """(exit codes, outputs) of ranks started by `launch_ranks`; all killed if one outlives `timeout` seconds of an
    idle machine (stretched by the load measured while waiting: gptpar.testing.deadline)."""
    outs = []
    for p in procs:
        try:
            outs.append(communicate(p, timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return [p.returncode for p in procs], outs


# The model of the engine-level tests (precision, fusion, fp8): wider than TINY's so that ZeRO's partitions and fp8's
# GEMM shapes are not degenerate.
ENGINE_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 256,
                "make_vocab_size_divisible_by": 128}


def tiny_dict(**sections):
    """TINY with `sections` merged in key by key (a new dict)."""
    cfg = copy.deepcopy(TINY)
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def write_config(path, **sections):
    """TINY with `sections` merged in key by key, written as JSON; returns the path."""
    with open(path, "w") as f:
        json.dump(tiny_dict(**sections), f)
    return str(path)


def tiny_config(**sections):
    """TINY with `sections` merged in key by key, read as the trainer reads a config (a gptpar.config.Config)."""
    from gptpar.config import config_from_dict

    return config_from_dict(tiny_dict(**sections))


def engine_config(precision, zero_stage, pp=1, dp=1, micro_batches=2, **training):
    """ENGINE_MODEL on synthetic data at `precision` and ZeRO `zero_stage`, `micro_batches` micro-batches of one
    sample per step on each of `dp` replicas; `training` sets more training keys."""
    from gptpar.config import config_from_dict

    t = dict(micro_batch_size=1, global_batch_size=micro_batches * dp, train_iters=3, precision=precision,
             zero_stage=zero_stage, initial_loss_scale=256, lr=1e-3)
    t.update(training)
    return config_from_dict({"model": dict(ENGINE_MODEL), "parallel": {"pipeline_model_parallel_size": pp},
                             "training": t, "data": {"synthetic": True}})


def engine_for(cfg, pstate, ds_edit=None, **build):
    """The trainer's model and engine for `cfg` (`ds_edit` may alter the generated DeepSpeed dict; `build`: more
    build_engine arguments)."""
    from gptpar.training.assembly import build_model, seed_everything
    from gptpar.training.engine import build_engine, deepspeed_config

    model = build_model(cfg, pstate, seed_everything(cfg.training.seed, pstate))
    ds = deepspeed_config(cfg, pstate.dp_size)
    if ds_edit is not None:
        ds_edit(ds)
    t = cfg.training
    return build_engine(model, pstate, ds, optimizer=t.optimizer, lr=t.lr, weight_decay=0.0, **build)


def synthetic_batches(cfg, pstate, consumed=0):
    """This rank's micro-batches of the step that starts after `consumed` samples of synthetic data (seed 7)."""
    from gptpar.training.batches import SyntheticDataset, rank_micro_batches

    t, m = cfg.training, cfg.model
    texts = rank_micro_batches(SyntheticDataset(m.vocab_size, m.seq_length, 7), consumed, t.global_batch_size,
                               t.micro_batch_size, pstate.dp_rank, pstate.dp_size)
    return [{"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()} for x in texts]


def run_mains(runs, env=None):
    """On one harness rank: gptpar.training.pretrain.main(argv) for each (name, argv); {name: (exit code, output)}, the
    output being what the run printed to stdout and stderr."""
    os.environ.update(env or {})
    from gptpar.training.pretrain import main

    out = {}
    for name, argv in runs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = main(argv)
        out[name] = (rc, buf.getvalue())
    return out


def main_output(argv, patches=()):
    """gptpar.training.pretrain.main(argv) in this process with `patches` ((object, attribute, value) each, undone
    after): (exit code, what it printed to stdout and stderr). An exception that escapes main is a result too: the
    code is "exception" and its traceback is in the output (a fault test asserts there is none)."""
    import traceback

    from gptpar.training.pretrain import main

    buf = io.StringIO()
    with contextlib.ExitStack() as stack:
        for target, attr, value in patches:
            stack.callback(setattr, target, attr, getattr(target, attr))
            setattr(target, attr, value)
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                rc = main(list(argv))
            except Exception:  # noqa: BLE001 - reported, not raised: see the docstring
                rc = "exception"
                traceback.print_exc()
    return rc, buf.getvalue()


@contextlib.contextmanager
def environ_kept():
    """A tool's main called in the test process makes a one-rank world, which sets RANK, WORLD_SIZE and
    MASTER_PORT in os.environ (gptpar.parallel.init_distributed): put the environment back for the tests after."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_mains_fp16(runs):
    allow_fp16_on_cpu()
    return run_mains(runs)


def log_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith(" iteration ")]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_tensorboard(log_dir):
    """{tag: [(step, value)]} of every scalar in the TensorBoard event files under log_dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def synthetic_sample(seed, index, vocab_size, seq_length):
    """The contract's synthetic sample i, written out: randint(0, V, s + 1) seeded by (seed, i)."""
    import torch

    g = torch.Generator().manual_seed((seed * 0x9E3779B9 + index) % 2 ** 32)
    return torch.randint(0, vocab_size, (seq_length + 1,), generator=g)


def megatron_rampup(consumed, start, increment, ramp_samples, final):
    """Megatron's RampupBatchsizeNumMicroBatches, written out."""
    if consumed > ramp_samples:
        return final
    per_increment = ramp_samples / ((final - start) // increment)
    return start + int(consumed / per_increment) * increment


def improved_tflops(B, s, L, h, V, sec, n_gpus, recompute):
    """Narayanan et al. eq. 3 (recompute: 96 = 24 x 4), vocab term V/(12Lh) without recompute (72 = 24 x 3)."""
    if recompute:
        flops = 96 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (16 * L * h))
    else:
        flops = 72 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (12 * L * h))
    return flops / (sec * n_gpus * 1e12)


def cosine_lr(step, warmup, decay, max_lr, min_lr):
    if warmup and step <= warmup:
        return max_lr * step / warmup
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)
