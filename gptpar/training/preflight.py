"""Checks before the model is built: what checkpoint.load means, whether the data fits the model, and
whether checkpoint.save can take this run. Rank 0 checks, every rank gets the outcome (one broadcast),
so all ranks stop with the same message or go on with the same checkpoint to load.

Order, so that a refused run changes nothing in checkpoint.save (not even a modification time):
    0. training.kill_switch_path exists?                 -> stop: exit 0 before anything is built
    1. another live job holds checkpoint.save?          (read-only)  gptpar.training.save_folder.peek_lock
    2. checkpoint.load resolved and verified             (read-only)  gptpar.training.checkpoint_files; at another
       parallel shape, converted to its universal copy outside the load folder (gptpar.training.checkpoint.plan_load);
       or, without a checkpoint to resume, checkpoint.init_from (or a weights-only checkpoint.load) checked
       against the model's shape                         (read-only)  gptpar.training.init_weights
    3. checkpoint.save holding another run's checkpoints (read-only)
    4. every dataset's largest token id (data_path's and valid_data_path's) and the tokenizer's vocabulary
       < model.vocab_size (caches beside the data, gptpar.data.token_stats)
    5. checkpoint.save: lock, probe, leftovers, free space          gptpar.training.save_folder
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from gptpar.data.indexed import DataError
from gptpar.training.checkpoint import plan_load
from gptpar.training.checkpoint_files import (CheckpointError, LoadTarget, complete_checkpoints, read_latest,
                                              resolve_load)
from gptpar.training.init_weights import check_weights_fit, choose_start
from gptpar.training.save_folder import (JobLock, check_free_space, checkpoint_bytes, clean_leftovers,
                                         peek_lock, probe_writable)


@dataclass
class Preflight:
    """What rank 0 found: the checkpoint to load (None = fresh), the weights to start from instead (None = the
    model's own initialisation) and, on rank 0, the save folder's lock; or `stop`, why the run must end now
    without training (the kill switch file exists)."""

    load_target: Optional[LoadTarget]
    lock: Optional[JobLock] = None
    init_from: Optional[str] = None
    stop: Optional[str] = None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def run_preflight(cfg, pstate, shape: dict, log: Callable[[str], None]) -> Preflight:
    """Collective: rank 0 checks, the others wait for its verdict. Raises CheckpointError or DataError."""
    outcome, lock = None, None
    if pstate.rank == 0:
        try:
            kill = cfg.training.kill_switch_path
            if kill is not None and os.path.exists(kill):  # as Megatron-DeepSpeed: exit 0 before training
                outcome = ("stop", f"kill switch {kill} exists (training.kill_switch_path): exiting before "
                                   "training; remove the file to start or resume the run")
            else:
                target, init_from, lock = check_on_rank0(cfg, pstate.world_size, pstate.tp_size, pstate.pp_size,
                                                         shape, log)
                outcome = ("ok", (target, init_from))
        except (CheckpointError, DataError) as e:
            outcome = (type(e).__name__, str(e))
        except Exception as e:  # noqa: BLE001 - any surprise must still reach the other ranks, not hang them
            outcome = ("RuntimeError", f"{type(e).__name__}: {e}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [outcome]
        dist.broadcast_object_list(box, src=0, device=pstate.device if pstate.device.type != "cpu" else None)
        outcome = box[0]
    kind, value = outcome
    if kind == "ok":
        return Preflight(value[0], lock, init_from=value[1])
    if kind == "stop":
        return Preflight(None, stop=value)
    raise {"DataError": DataError, "RuntimeError": RuntimeError}.get(kind, CheckpointError)(value)


def check_on_rank0(cfg, world_size: int, tp: int, pp: int, shape: dict, log) -> tuple:
    """(load target or None, the weights to start from or None, the held JobLock or None); raises CheckpointError
    / DataError."""
    ck = cfg.checkpoint
    peek_lock(ck.save, ck.override_lock)
    target, note = resolve_load(ck.load)
    target, init_from, note = choose_start(ck.init_from, target, note)
    if target is not None:
        target = plan_load(target, shape, world_size, ck.universal_dir, cfg.training.precision, log, cfg.model)
    if init_from is not None:
        check_weights_fit(init_from, cfg.model, "checkpoint.init_from" if init_from == ck.init_from
                          else "checkpoint.load")
    check_save_holds_no_other_run(ck.save, target, ck.load)
    check_data(cfg, log)
    if note:
        log(note)
    if not ck.save:
        return target, init_from, None
    lock = JobLock(ck.save)
    lock.acquire(ck.override_lock, log)
    try:
        probe_writable(ck.save)
        clean_leftovers(ck.save, log)
        need = checkpoint_bytes(count_parameters(cfg.model, tp, pp), cfg.training.precision,
                                cfg.training.zero_stage, world_size)
        check_free_space(ck.save, need, log)
    except BaseException:
        lock.release()
        raise
    return target, init_from, lock


def check_save_holds_no_other_run(save: Optional[str], target: Optional[LoadTarget],
                                  load: Optional[str] = None) -> None:
    """A run that does not resume from checkpoint.save must not write over the checkpoints already there. `load`:
    checkpoint.load, named when it resumes nothing (no checkpoint there, or weights only)."""
    if not save or not os.path.isdir(save):
        return
    if target is not None and os.path.samefile(target.directory, save):
        return
    latest = read_latest(save)
    existing = [latest] if latest else complete_checkpoints(save)[-1:]
    if existing:
        loading = (f"checkpoint.load is {target.path}" if target is not None else
                   f"checkpoint.load {load} resumes nothing" if load else "checkpoint.load is null")
        raise CheckpointError(f"checkpoint.save {save} already holds checkpoint {existing[0]} of an earlier run, and "
                              f"{loading}: set checkpoint.load={save} to resume it, or give checkpoint.save a new "
                              "folder (this run would otherwise save over it)")


def check_data(cfg, log) -> None:
    """Every dataset's largest token id, and the tokenizer's vocabulary, fit model.vocab_size (unpadded)."""
    d, vocab = cfg.data, cfg.model.vocab_size
    if d.synthetic or d.data_path is None:
        return
    from gptpar.data.gpt_dataset import parse_data_path, parse_valid_data_path
    from gptpar.data.indexed import IndexedDataset
    from gptpar.data.token_stats import token_stats

    if d.tokenizer_model is not None:
        from gptpar.data.tokenizer import load_tokenizer

        tokenizer_vocab = load_tokenizer(d.tokenizer_model).vocab_size
        if tokenizer_vocab > vocab:
            raise DataError(f"data.tokenizer_model {d.tokenizer_model} has {tokenizer_vocab} pieces but "
                            f"model.vocab_size is {vocab}: set model.vocab_size={tokenizer_vocab} (or more)")
    prefixes, _ = parse_data_path(d.data_path)
    if d.valid_data_path is not None:
        prefixes += [prefix for entries in parse_valid_data_path(d.valid_data_path).values()
                     for prefix, _, _ in entries]
    for prefix in dict.fromkeys(prefixes):
        stats = token_stats(IndexedDataset(prefix), log=log)
        if stats["num_tokens"] and stats["max_id"] >= vocab:
            raise DataError(f"dataset {prefix}: its largest token id is {stats['max_id']}, but model.vocab_size is "
                            f"{vocab} (ids must be below it): set model.vocab_size to the vocabulary the data was "
                            f"tokenized with (at least {stats['max_id'] + 1}), or re-tokenize the data")


def count_parameters(model_cfg, tp: int, pp: int) -> int:
    """Parameters stored in one checkpoint: the model's, plus the tied output embedding's copy when pp > 1
    (the last stage holds its own)."""
    from gptpar.model.pipeline import block_parameter_counts, model_parameter_count

    params = model_parameter_count(model_cfg, tp)
    if pp > 1:
        params += block_parameter_counts(model_cfg, tp)["output_embedding"][0]
    return params


__all__ = ["Preflight", "run_preflight", "check_on_rank0", "check_data", "count_parameters",
           "check_save_holds_no_other_run"]
