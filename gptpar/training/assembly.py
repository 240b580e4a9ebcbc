"""The run assembled from a checked `Config`: environment, seeds, model, engine, data, checkpointer, trainer.

pretrain_gpt.py calls these in order (parse -> build -> train); tests and benches build from here too, so
the pp = 1 / pp > 1 dispatch lives in one place (`build_gpt`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import random
from typing import Optional, Sequence

import numpy as np
import torch

from gptpar.config import Config, ConfigError


def share_cpu_threads() -> None:
    """Without CUDA, one share of the cores per local rank (unless OMP_NUM_THREADS says otherwise): ranks that
    each take every core slow each other down."""
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))


def setup_environment(verbose: bool = False) -> None:
    """DeepSpeed's CPU accelerator when there is no CUDA; one share of the cores per local rank. Unless `verbose`
    (or GPTPAR_DEEPSPEED_LOG=info), DeepSpeed's INFO lines and the known-harmless warnings (gptpar.quiet) are held
    back."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    share_cpu_threads()
    if not verbose:
        from gptpar.quiet import hold_back_warnings

        hold_back_warnings()
    if not verbose and os.environ.get("GPTPAR_DEEPSPEED_LOG", "warning").lower() != "info":
        from gptpar.training.engine import quiet_deepspeed_log

        quiet_deepspeed_log()


def seed_everything(seed: int, pstate):
    """Python, numpy and torch seeds, and the tensor-parallel RNG streams (returned tracker)."""
    from gptpar.tensor_parallel.random import model_parallel_seed

    random.seed(seed)
    np.random.seed(seed)
    return model_parallel_seed(seed, pstate.tp_rank, pstate.pp_rank, pstate.device)


def build_gpt(config, pstate, *, partition_method: str = "auto", embedding_weight: int = 1, **kw):
    """A `GPTModel` for pp = 1, DeepSpeed's `PipelineModule` (this rank's stage) for pp > 1. `kw`: the keyword
    arguments both take (sequence_parallel, rng_tracker, seed, activation_checkpointing, dtype)."""
    if pstate.pp_size == 1:
        from gptpar.model.gpt import GPTModel

        return GPTModel(config, tp_group=pstate.tp_group, **kw)
    from gptpar.model.pipeline import build_pipeline_model
    from gptpar.training.engine.deepspeed_api import load_comm_op

    load_comm_op()  # before the pipeline builder's init_distributed asks DeepSpeed for it
    model, _ = build_pipeline_model(config, pstate, partition_method=partition_method,
                                    embedding_weight=embedding_weight, **kw)
    return model


def build_float8(cfg: Config, pstate):
    """precision fp8: the float8 GEMM every transformer layer's linears share (torchao's recipe
    `training.fp8_recipe`, emulated where this rank has no CUDA device); None for any other precision."""
    if cfg.training.precision != "fp8":
        return None
    from gptpar.tensor_parallel.float8 import Float8Matmul

    return Float8Matmul(cfg.training.fp8_recipe, emulate=pstate.device.type != "cuda")


def build_model(cfg: Config, pstate, tracker):
    """The run's model on this rank (see `build_gpt`), its transformer layers compiled with training.compile."""
    model = build_gpt(cfg.model, pstate, partition_method=cfg.parallel.partition_method,
                      embedding_weight=cfg.parallel.embedding_weight or 1,
                      sequence_parallel=cfg.parallel.sequence_parallel, rng_tracker=tracker, seed=cfg.training.seed,
                      activation_checkpointing=cfg.training.activation_checkpointing,
                      float8=build_float8(cfg, pstate))
    if cfg.training.compile:
        from gptpar.model.gpt import compile_transformer_layers

        deterministic_inductor()
        compile_transformer_layers(model)
    return model


def deterministic_inductor() -> None:
    """Inductor's deterministic mode (torch._inductor.config.deterministic, TORCHINDUCTOR_DETERMINISTIC=1): without
    it inductor picks reduction kernels by timing them on each rank, and those choices change the numerics, so
    replicas (dp ranks, the LayerNorms of tp ranks) would drift apart (gptpar.training.replicas checks them)."""
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True


def checkpoint_shape(cfg: Config, pstate) -> dict:
    """What a checkpoint must share with this run to be resumed (gptpar.checkpoint.resume.shape_of)."""
    from gptpar.checkpoint.resume import shape_of

    return shape_of(cfg.to_dict(), pstate.tp_size, pstate.pp_size, pstate.dp_size,
                    cfg.model.padded_vocab_size(pstate.tp_size), cfg.resolved_partition_method(pstate.pp_size))


def saved_config(cfg: Config, pstate) -> Config:
    """The config a checkpoint records (its config.json): the run's, with parallel.data_parallel_size resolved
    (null in the config means "what the world size leaves"), so that the checkpoint says its own shape."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, data_parallel_size=pstate.dp_size))


def resolved_config_path(cfg: Config) -> Optional[str]:
    """Where a run writes its resolved config: beside logging.metrics_file, else in logging.tensorboard_dir's
    parent, else in checkpoint.save (one of gptpar's own entries there); None when the run names none of them."""
    lg = cfg.logging
    if lg.metrics_file:
        folder = os.path.dirname(lg.metrics_file)
    elif lg.tensorboard_dir:
        folder = os.path.dirname(os.path.normpath(lg.tensorboard_dir))
    elif cfg.checkpoint.save:
        folder = cfg.checkpoint.save
    else:
        return None
    from gptpar.checkpoint.layout import RESOLVED_CONFIG

    return os.path.join(folder, RESOLVED_CONFIG)


def write_resolved_config(cfg: Config, pstate, verbose: bool = False) -> str:
    """Write the run's resolved config (every key, defaults included, data_parallel_size resolved) where
    `resolved_config_path` says (call on one rank, after the preflight accepted the run); the line saying where
    (with `verbose` the config itself was printed already)."""
    path = resolved_config_path(cfg)
    if path is None:
        return ("resolved config: not written (no logging.metrics_file, logging.tensorboard_dir or checkpoint.save "
                "to put it beside)" + ("" if verbose else "; --verbose prints it"))
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(saved_config(cfg, pstate).to_json() + "\n")
    os.replace(temporary, path)
    return f"resolved config: {path}" + ("" if verbose else " (--verbose prints it)")


def checkpoint_group(pstate, timeout_minutes: float):
    """The gloo group a save's and a resume's ranks agree over (None for one rank): its own, because an async save
    agrees from the writer thread while training's collectives run on theirs. Collective: every rank calls it."""
    from gptpar.parallel import host_group

    return None if pstate.world_size == 1 else host_group(timeout_minutes)


def save_token(pstate) -> str:
    """What names a save's temporary folders (`iter_N.tmp-TOKEN`), the same on every rank: rank 0's pid.
    Collective."""
    import torch.distributed as dist

    box = [os.getpid()]
    if pstate.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return str(box[0])


def build_trainer(cfg: Config, pstate, log, load_target, init_from=None, collectives=None):
    """Seeds, model, data sources, DeepSpeed engine and checkpointer, under one `Trainer`. `init_from`: weights
    to start from (gptpar.checkpoint.init_weights), put into the model before the engine copies them;
    `collectives`: the process's gptpar.training.collectives.CollectiveLog (the straggler report reads it)."""
    from gptpar.checkpoint.checkpointer import Checkpointer
    from gptpar.checkpoint.universal import deepspeed_universal_info, gpt_parameter_name
    from gptpar.training.sources import build_sources
    from gptpar.checkpoint.writer import CheckpointWriter
    from gptpar.training.engine import build_engine, deepspeed_config
    from gptpar.training.engine.ds_config import describe_overrides
    from gptpar.schedules import train_iters
    from gptpar.training.trainer import Trainer

    t, ck = cfg.training, cfg.checkpoint
    tracker = seed_everything(t.seed, pstate)
    model = build_model(cfg, pstate, tracker)
    if init_from is not None:
        from gptpar.checkpoint.init_weights import load_initial_weights

        load_initial_weights(model, cfg, pstate, init_from, log)
    train_source, valid_sources = build_sources(
        cfg, pstate, train_samples=t.train_samples or train_iters(t, pstate.dp_size) * t.global_batch_size,
        eval_samples=t.eval_iters * t.global_batch_size if t.eval_interval else 0, log=log)
    for line in describe_overrides(cfg.deepspeed):
        log(line, flush=True)
    engine = build_engine(model, pstate, deepspeed_config(cfg, pstate.dp_size), optimizer=t.optimizer, lr=t.lr,
                          weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                          has_attention_mask=train_source.masks.has_attention_mask,
                          universal_checkpoint_info=deepspeed_universal_info(cfg.model),
                          gradient_accumulation_fusion=t.gradient_accumulation_fusion)
    host_limit = None if ck.async_host_buffer_mb is None else ck.async_host_buffer_mb * 2 ** 20
    writer = CheckpointWriter(async_save=ck.async_save, checksums=ck.checksums, log=log, host_limit=host_limit)
    engine.install_checkpoint_writer(writer)
    checkpointer = Checkpointer(ck.save, load_target, ck.keep_last, pstate.rank, pstate.world_size,
                                checkpoint_shape(cfg, pstate), saved_config(cfg, pstate).to_json(), log=log,
                                device=pstate.device,
                                tp_rank=pstate.tp_rank, tp_size=pstate.tp_size,
                                parameter_name=functools.partial(
                                    gpt_parameter_name, pipelined=pstate.pp_size > 1,
                                    num_layers=cfg.model.num_layers,
                                    embedding_weight=cfg.parallel.embedding_weight or 1),
                                model_config=cfg.model, save_interval=ck.save_interval, writer=writer,
                                checksums=ck.checksums, verify=ck.verify_checksums, token=save_token(pstate),
                                group=checkpoint_group(pstate, cfg.parallel.distributed_timeout_minutes)
                                if ck.save or load_target is not None else None)
    trainer = Trainer(cfg, pstate, engine, train_source, valid_sources, checkpointer, tracker,
                      log=functools.partial(print, flush=True), collectives=collectives)
    if cfg.training.check_replicas_interval != 0:  # replicas bitwise equal before every save, else it is refused
        checkpointer.pre_save_checks.append(lambda _: trainer.check_replicas(saving=True))
    return trainer


def dry_run(cfg: Config, tp: int, pp: int, dp: int, sec_per_iter: Optional[float] = None,
            calibrations: Sequence[str] = (), gpu: Optional[str] = None, assume: Sequence[str] = (),
            as_json: bool = False) -> str:
    """The --dry-run report: formulas and a meta-device build, no process group. `sec_per_iter`: a measured time
    per iteration to price and rate; `calibrations`: GPU kinds to predict for besides the shipped kinds (files or
    shipped names); `gpu`: the kind to plan for and rank by; `assume`: what-ifs (gptpar.estimate.kinds); `as_json`:
    one JSON object instead of the text. A bad kind, assumption or calibration raises ConfigError."""
    from gptpar.estimate.kinds import DEFAULT_KIND, parse_assumptions
    from gptpar.estimate.planner import calibrated_kind
    from gptpar.estimate.report import plan_json, plan_kinds, render_dry_run
    from gptpar.estimate.settings import settings_of
    from gptpar.model.pipeline import model_parameter_count, partition_layers, stage_parameter_counts

    s = settings_of(cfg, dp)
    try:
        what_if = parse_assumptions(assume)
        kinds = plan_kinds(s, gpu)
        extra = [calibrated_kind(path, s, fallback=gpu or DEFAULT_KIND) for path in calibrations]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if as_json:
        try:
            return plan_json(cfg, dp, kinds + extra, gpu, what_if, sec_per_iter)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    plan = partition_layers(cfg.model.num_layers, pp, cfg.resolved_partition_method(pp),
                            cfg.parallel.embedding_weight or 1)
    try:
        return render_dry_run(cfg, dp, sec_per_iter=sec_per_iter, meta_param_count=model_parameter_count(cfg.model, tp),
                              kinds=kinds + extra, assume=what_if,
                              meta_stage_params=[row["params"] for row in stage_parameter_counts(cfg.model, plan, tp)])
    except ValueError as e:
        raise ConfigError(str(e)) from None


__all__ = ["setup_environment", "seed_everything", "build_gpt", "build_float8", "build_model", "checkpoint_shape",
           "saved_config", "resolved_config_path", "write_resolved_config", "checkpoint_group",
           "save_token", "build_trainer", "dry_run"]
