"""Pretrain a GPT with tensor x pipeline x data parallelism: parse -> init -> build -> train -> clean up.

    deepspeed --num_gpus 2 pretrain_gpt.py --config configs/cpu_dp2.json     # 2 ranks (gloo on CPU)
    torchrun --nproc_per_node 2 pretrain_gpt.py --config configs/cpu_pp2.json
    python pretrain_gpt.py --config configs/cpu_tiny.json --set training.train_iters=5   # one rank
    python pretrain_gpt.py --config configs/200b.json --dry-run   # the plan only: no process group, no weights

Config errors (world size, divisibility, ramp-up arithmetic, unknown keys, missing data) print one message
and exit 2 before any process group exists. A checkpoint.load that is not a whole checkpoint, a save folder
that another job holds or that cannot take a checkpoint, and data whose token ids do not fit the model exit 2
before the model is built, changing nothing (gptpar.training.preflight). SIGTERM / SIGUSR1 save a checkpoint
after the current iteration and exit 0; a failed save, and a run gone NaN, exit 1. A rank whose launcher dies
exits at once without saving (gptpar.training.launcher_watch).
"""
from __future__ import annotations

import functools
import logging
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

from gptpar.model.kernels import describe_kernels
from gptpar.parallel import destroy_parallel, init_parallel
from gptpar.data.indexed import DataError
from gptpar.training.checkpoint import CheckpointError, CheckpointSaveError
from gptpar.training.preflight import run_preflight
from gptpar.training.trainer import NonFiniteError
from gptpar.training.cli import USAGE, parse_args
from gptpar.training.config import ConfigError, load_config
from gptpar.training.launcher_watch import watch_launcher

ROOT = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------
# parse
# ---------------------------------------------------------------------------------------------

def launched_world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse(argv):
    """(config, flags, (tp, pp, dp)); raises ConfigError before anything distributed happens."""
    config_path, overrides, flags = parse_args(argv)
    if flags["help"]:
        return None, flags, None
    if config_path is None:
        raise ConfigError("no config given: pass --config configs/<name>.json")
    cfg = load_config(config_path, overrides)
    p = cfg.parallel
    world = launched_world_size()
    if flags["dry_run"] and "WORLD_SIZE" not in os.environ and not dist.is_initialized():
        world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * (p.data_parallel_size or 1)
    accelerator = None
    if cfg.training.precision == "fp16" and not flags["dry_run"]:  # a dry run plans for GPUs
        from gptpar.training.engine import detect_accelerator

        accelerator = detect_accelerator()
    return cfg, flags, cfg.check(world, accelerator)


# ---------------------------------------------------------------------------------------------
# --dry-run: formulas and a meta-device build, no process group
# ---------------------------------------------------------------------------------------------

def dry_run(cfg, tp: int, pp: int, dp: int) -> str:
    from gptpar.model.pipeline import model_parameter_count, partition_layers, stage_report
    from gptpar.planning import dry_run_report

    d = cfg.to_dict()
    d["parallel"]["data_parallel_size"] = dp
    plan = partition_layers(cfg.model.num_layers, pp, cfg.resolved_partition_method(pp),
                            cfg.parallel.embedding_weight or 1)
    report = dry_run_report(d, meta_param_count=model_parameter_count(cfg.model, tp))
    return report + "\n== stages of the real model (meta device) ==\n" + stage_report(cfg.model, plan, tp)


# ---------------------------------------------------------------------------------------------
# init
# ---------------------------------------------------------------------------------------------

def setup_environment() -> None:
    """DeepSpeed's CPU accelerator when there is no CUDA; one share of the cores per local rank."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    if os.environ.get("GPTPAR_DEEPSPEED_LOG", "warning").lower() != "info":
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)


def seed_everything(seed: int, pstate):
    """Python, numpy and torch seeds, and the tensor-parallel RNG streams (returned tracker)."""
    from gptpar.tensor_parallel.random import model_parallel_seed

    random.seed(seed)
    np.random.seed(seed)
    return model_parallel_seed(seed, pstate.tp_rank, pstate.pp_rank, pstate.device)


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------

def build_model(cfg, pstate, tracker):
    """GPTModel for pp = 1, a DeepSpeed PipelineModule (this rank's stage) for pp > 1."""
    kw = dict(sequence_parallel=cfg.parallel.sequence_parallel, rng_tracker=tracker, seed=cfg.training.seed,
              activation_checkpointing=cfg.training.activation_checkpointing)
    if pstate.pp_size == 1:
        from gptpar.model.gpt import GPTModel

        return GPTModel(cfg.model, tp_group=pstate.tp_group, **kw)
    from gptpar.model.pipeline import build_pipeline_model

    model, _ = build_pipeline_model(cfg.model, pstate, partition_method=cfg.parallel.partition_method,
                                    embedding_weight=cfg.parallel.embedding_weight or 1, **kw)
    return model


def checkpoint_shape(cfg, pstate) -> dict:
    """What a checkpoint must share with this run to be resumed (gptpar.training.checkpoint.shape_of)."""
    from gptpar.training.checkpoint import shape_of

    return shape_of(cfg.to_dict(), pstate.tp_size, pstate.pp_size, pstate.dp_size,
                    cfg.model.padded_vocab_size(pstate.tp_size), cfg.resolved_partition_method(pstate.pp_size))


def build_trainer(cfg, pstate, log, load_target):
    from gptpar.training.checkpoint import Checkpointer
    from gptpar.training.engine import deepspeed_config
    from gptpar.training.data import build_sources
    from gptpar.training.engine import build_engine
    from gptpar.training.schedules import train_iters
    from gptpar.training.trainer import Trainer

    t, ck = cfg.training, cfg.checkpoint
    tracker = seed_everything(t.seed, pstate)
    model = build_model(cfg, pstate, tracker)
    train_source, valid_source = build_sources(
        cfg, pstate, train_samples=t.train_samples or train_iters(t, pstate.dp_size) * t.global_batch_size,
        eval_samples=t.eval_iters * t.global_batch_size if t.eval_interval else 0, log=log)
    engine = build_engine(model, pstate, deepspeed_config(cfg, pstate.dp_size), lr=t.lr,
                          weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                          has_attention_mask=train_source.masks.has_attention_mask)
    checkpointer = Checkpointer(ck.save, load_target, ck.keep_last, pstate.rank, pstate.world_size,
                                checkpoint_shape(cfg, pstate), cfg.to_json(), log=log, device=pstate.device)
    return Trainer(cfg, pstate, engine, train_source, valid_source, checkpointer, tracker,
                   log=functools.partial(print, flush=True))


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    # parse: every config error ends here, before any process group exists
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, flags, sizes = parse(argv)
    except ConfigError as e:
        print(f"pretrain_gpt.py: config error: {e}", file=sys.stderr, flush=True)
        return 2
    if flags["help"]:
        print(USAGE)
        return 0
    if flags["dry_run"]:
        print(dry_run(cfg, *sizes), flush=True)
        return 0

    # init: first of all, never outlive the launcher (gptpar.training.launcher_watch)
    watch = watch_launcher(label=f"rank {os.environ.get('RANK', '0')}")
    setup_environment()
    owns_process_group = not dist.is_initialized()  # a test harness may have made it
    tp, pp, dp = sizes
    pstate = init_parallel(tp, pp, dp, timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    log = print if pstate.rank == 0 else _quiet
    log(f"gptpar: {pstate.world_size} rank(s) = tp {tp} x pp {pp} x dp {dp} on {pstate.backend}; "
        f"{describe_kernels(pstate.device)}\nresolved config:\n{cfg.to_json()}", flush=True)
    preflight = None
    try:
        # check what load, save and the data mean before anything is built (rank 0 decides for all)
        preflight = run_preflight(cfg, pstate, checkpoint_shape(cfg, pstate), functools.partial(log, flush=True))
        # build
        trainer = build_trainer(cfg, pstate, log, preflight.load_target)
        if cfg.training.zero_stage_note:
            log(cfg.training.zero_stage_note, flush=True)
        log(trainer.engine.precision_plan(), flush=True)
        trainer.resume()
        # train
        reason = trainer.train()
        log(f"training finished at iteration {trainer.counters.iteration}: {reason}", flush=True)
        dist.barrier()
    except CheckpointSaveError as e:  # a full disk or an I/O error while saving: the run's own failure
        print(f"pretrain_gpt.py: checkpoint save failed: {e}", file=sys.stderr, flush=True)
        return 1
    except NonFiniteError as e:
        print(f"pretrain_gpt.py: {e}", file=sys.stderr, flush=True)
        return 1
    except CheckpointError as e:  # load, save folder or shape refused: nothing was changed
        print(f"pretrain_gpt.py: checkpoint error: {e}", file=sys.stderr, flush=True)
        return 2
    except DataError as e:
        print(f"pretrain_gpt.py: data error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        # clean up
        if preflight is not None:
            preflight.release()
        if owns_process_group:
            destroy_parallel()
        watch.stop()
    return 0


def _quiet(*args, **kwargs) -> None:
    pass


if __name__ == "__main__":
    code = main()
    # Everything is saved, closed and flushed by now; skip the interpreter's teardown, where torch / DeepSpeed
    # exit handlers rarely abort ("terminate called without an active exception", exit -6) after a clean run
    # (twice in about 50 SIGTERM-and-save test runs here; gptpar.testing's ranks exit the same way).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
