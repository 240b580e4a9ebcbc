"""Checks before the model is built: what checkpoint.load means, whether the data fits the model, and
whether checkpoint.save can take this run. Rank 0 checks, every rank gets the outcome (one broadcast), so all
ranks stop with the same message or go on with the same checkpoint to load. The others wait for rank 0 in a
polled barrier (`wait_for_rank0`), never in one long collective: a conversion, a checksum pass or a first scan of
a large dataset may take longer than parallel.distributed_timeout_minutes.

Order, so that a refused run changes nothing in checkpoint.save (not even a modification time):
    0. training.kill_switch_path exists?                 -> stop: exit 0 before anything is built
       logging.metrics_file, logging.tensorboard_dir and logging.diagnostics_dir writable (access(2) on the
       nearest existing folder of each, then a probe file there, removed and the folder's modification time put
       back)                                              gptpar.training.reporting.check_log_paths
    1. another live job holds checkpoint.save?          (read-only)  gptpar.checkpoint.save_folder.peek_lock
    2. checkpoint.load resolved and checked whole        (read-only)  gptpar.checkpoint.layout, .resume: its
       manifest there and readable, every listed file there with its size, every torch file a whole zip; a
       universal folder's too; at another parallel shape or kind of optimizer files, its universal copy planned
       (gptpar.checkpoint.resume.plan_load: an existing copy of exactly these files is reused, else one is
       written in step 7, every file it is converted from checked against its sha256 as the conversion reads
       it); or, without a checkpoint to resume, checkpoint.init_from (or a weights-only checkpoint.load) checked
       against the model's shape, every file it will read whole (read-only)  gptpar.checkpoint.init_weights
    3. checkpoint.save holding another run's checkpoints (read-only)
    4. every dataset's largest token id (data_path's and valid_data_path's) and the tokenizer's vocabulary
       < model.vocab_size (caches beside the data, gptpar.data.token_stats)
    -- broadcast --
    6. checkpoint.save: lock, probe, leftovers, free space (rank 0)   gptpar.checkpoint.save_folder
    7. with the lock held: killed conversions' temporary folders removed from the universal folder, and the
       universal copy written, so that two jobs on one save folder never convert at once: by one process
       (gptpar.checkpoint.resume.write_universal_copy), or, with several ranks, by all of them
       (`convert_over_ranks`: rank 0 plans, each rank writes a share of the parameters, rank 0 writes the
       metadata and the manifest last)
    -- broadcast --
The sha256 of every file resumed is checked later, before DeepSpeed parses any (gptpar.checkpoint.checkpointer.load):
a damaged file ends every rank with exit 2 before any weight is used.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from gptpar.data.indexed import DataError
from gptpar.checkpoint.exceptions import CheckpointError
from gptpar.checkpoint.init_weights import check_weights_fit, choose_start
from gptpar.checkpoint.layout import LoadTarget, complete_checkpoints, read_latest, resolve_load
from gptpar.checkpoint import universal
from gptpar.checkpoint.durable import StagedFolder
from gptpar.checkpoint.layout import earlier_checkpoint_fix, fingerprint
from gptpar.checkpoint.manifest import open_folder
from gptpar.checkpoint.resume import plan_load, universal_copy_error, write_universal_copy
from gptpar.checkpoint.save_folder import (JobLock, check_free_space, checkpoint_bytes, clean_conversion_leftovers,
                                           clean_leftovers, peek_lock, probe_writable, this_job)
from gptpar.training.reporting import LogPathError, check_log_paths


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
    """Collective: rank 0 checks and the others wait for its verdict (steps 0-4); then rank 0 takes the save folder
    and writes what must be written with it held (6-7). Raises CheckpointError, DataError or LogPathError, on every
    rank alike."""
    kept = {}  # rank 0's: the universal copy to write, its folder, the lock

    def start():
        kill = cfg.training.kill_switch_path
        if kill is not None and os.path.exists(kill):  # as Megatron-DeepSpeed: exit 0 before training
            return ("stop", f"kill switch {kill} exists (training.kill_switch_path): exiting before training; "
                            "remove the file to start or resume the run")
        target, init_from, kept["copy"], kept["conversions"] = check_start(cfg, pstate.world_size, shape, log)
        return ("ok", (target, init_from))

    kind, value = _outcome(wait_for_rank0(_guarded(start), pstate))
    if kind == "stop":
        return Preflight(None, stop=value)
    target, init_from = value

    spread = pstate.world_size > 1  # the ranks share the conversion (after the lock is taken)

    def take():
        kept["lock"] = take_save_folder(cfg, pstate.world_size, pstate.tp_size, pstate.pp_size, log,
                                        None if spread else kept["copy"], kept["conversions"])
        return ("ok", None)

    _outcome(wait_for_rank0(_guarded(take), pstate))  # take_save_folder releases the lock when it raises
    if spread:
        try:
            convert_over_ranks(kept.get("copy"), pstate, log, owner=this_job() if pstate.rank == 0 else None)
        except BaseException:
            if kept.get("lock") is not None:
                kept["lock"].release()
            raise
    return Preflight(target, kept.get("lock"), init_from=init_from)


def _guarded(check: Callable[[], tuple]) -> Callable[[], tuple]:
    """`check` made safe for `wait_for_rank0`, whose work must return: its CheckpointError / DataError /
    LogPathError (or any surprise) becomes the outcome (kind, message) every rank raises in `_outcome`."""
    def run():
        try:
            return check()
        except (CheckpointError, DataError, LogPathError) as e:
            return (type(e).__name__, str(e))
        except BaseException as e:  # noqa: BLE001 - any surprise must still reach the other ranks, not hang them
            return ("RuntimeError", f"{type(e).__name__}: {e}")
    return run


def _outcome(outcome: tuple) -> tuple:
    if outcome[0] not in ("ok", "stop"):
        raise {"DataError": DataError, "LogPathError": LogPathError, "RuntimeError": RuntimeError}.get(
            outcome[0], CheckpointError)(outcome[1])
    return outcome


def wait_for_rank0(work: Callable[[], object], pstate, poll_seconds: float = 1.0):
    """`work()`'s result on rank 0 (run in a thread there), broadcast to every rank. The others wait in a polled
    barrier: one small all-reduce every `poll_seconds` until rank 0 is done, so no collective lasts longer than
    that however long the work takes (converting a 200B checkpoint takes hours, far past
    parallel.distributed_timeout_minutes, which bounds each collective). `work` must return, not raise."""
    result = []
    worker = None
    if pstate.rank == 0:
        worker = threading.Thread(target=lambda: result.append(work()), name="gptpar-preflight", daemon=True)
        worker.start()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        worker.join()
        return result[0]
    device = pstate.device if pstate.device.type != "cpu" else None
    done = torch.zeros(1, device=pstate.device)
    while not done.item():
        if worker is not None:
            worker.join(timeout=poll_seconds)
            done.fill_(float(not worker.is_alive()))
        dist.all_reduce(done, op=dist.ReduceOp.MAX)  # the others block here until rank 0's next poll
    box = [result[0] if result else None]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def convert_over_ranks(copy, pstate, log: Callable[[str], None], owner: Optional[dict] = None,
                       poll_seconds: float = 1.0) -> None:
    """Write rank 0's universal `copy` (gptpar.checkpoint.resume.UniversalCopy; None: nothing to write, and on the
    other ranks, which learn it from rank 0) with every rank converting a share of the parameters. Collective.

    Rank 0 creates the staged folder (`owner` recorded in it). Then every rank, in two rounds: reads the parameter
    list of the pipeline stages it leads (universal.stage_ranks), the lists going to every rank, which cut the same
    shares (universal.split_shares); and writes its share into the staged folder (every file hashed as written and
    fsynced; each source file verified by the rank that reads it, a rank reading the shards of its own stages only).
    Each round's work runs in a thread while the main thread joins a small all-reduce every `poll_seconds`, so no
    collective outlasts parallel.distributed_timeout_minutes however long a share takes. A rank that fails stops
    the others between two parameters; rank 0 removes the staged folder once no rank writes any more, and every
    rank raises the failed rank's one-line error. Else rank 0 writes the metadata and the manifest last and renames
    the folder into place (universal.finish_conversion): the copy is the one `write_universal_copy` writes, byte for
    byte."""
    local = {}  # rank 0's staged folder

    def start():
        if copy is None:
            return ("ok", None)
        if copy.stale:
            log(copy.stale)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(copy.out)), exist_ok=True)
            if os.path.exists(copy.out) and copy.stale is None:
                raise universal.UniversalCheckpointError(f"{copy.out} exists: choose a new output folder (nothing "
                                                         "is overwritten)")
            local["staged"] = universal.start_conversion(copy.out, owner)
        except Exception as e:  # noqa: BLE001 - raised on every rank, as _guarded words it
            raise universal_copy_error(copy, e) from None
        return ("ok", (copy, local["staged"].token))

    started = _outcome(wait_for_rank0(_guarded(start), pstate))[1]
    if started is None:
        return
    copy, token = started
    rank, ranks, opened = pstate.rank, pstate.world_size, {}
    try:
        def read_stages(stop):
            opened["verifier"] = verifier = open_folder(copy.source.path, earlier_checkpoint_fix(copy.source), log,
                                                        copy.verify, "checkpoint.verify_checksums=false", quiet=True)
            opened["source"] = source = universal.read_source(copy.source.path, verifier)
            return {stage: universal.stage_parameters(source, verifier, stage)
                    for stage, owners in enumerate(universal.stage_ranks(source.pp, ranks)) if owners[0] == rank}

        stages = {}
        for found in _on_every_rank(read_stages, copy, pstate, poll_seconds):
            stages.update(found)
        source = opened["source"]
        plan = universal.conversion_plan(source, stages)  # the same on every rank
        sizes = {name: math.prod(tag["shape"]) for name, tag in universal.parameter_tags(source.model).items()}
        share = universal.split_shares(plan, sizes, ranks, source.pp)[rank]
        tmp = StagedFolder(copy.out, token).tmp
        results = _on_every_rank(lambda stop: universal.convert_share(source, opened["verifier"], tmp, share, stop),
                                 copy, pstate, poll_seconds)
    except BaseException:
        if "staged" in local:  # no rank writes any more (or this one lost its peers)
            local["staged"].abandon()
        raise

    def finish():
        records, steps = {}, {}
        for rank_records, rank_steps in results:
            records.update(rank_records)
            steps.update(rank_steps)
        try:
            universal.finish_conversion(local["staged"], source, plan, records, steps, copy.counters,
                                        fingerprint(copy.source.path), owner, log, replace=copy.stale is not None)
        except Exception as e:  # noqa: BLE001 - raised on every rank, as _guarded words it
            local["staged"].abandon()
            raise universal_copy_error(copy, e) from None
        log(f"{copy.reason}: converted to its universal copy {copy.out} ({ranks} ranks)")
        return ("ok", None)

    _outcome(wait_for_rank0(_guarded(finish), pstate))


def _on_every_rank(work: Callable, copy, pstate, poll_seconds: float) -> list:
    """Every rank's `work(stop)` result (`stop()` true once another rank's failed), run in a thread on each rank while
    the main thread joins a small all-reduce every `poll_seconds`; the first rank's failure raised on every rank, in
    one line, once no rank works any more."""
    done, stop = {}, threading.Event()

    def run():
        try:
            done["result"] = work(stop.is_set)
        except BaseException as e:  # noqa: BLE001 - every rank learns it through the polls below
            e = universal_copy_error(copy, e) if isinstance(e, Exception) else e
            done["error"] = (isinstance(e, CheckpointError), isinstance(e, universal.ConversionCancelled),
                             str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")

    worker = threading.Thread(target=run, name="gptpar-conversion", daemon=True)
    worker.start()
    flags = torch.zeros(2, device=pstate.device)  # (a rank failed, a rank still works), MAX over the ranks
    while True:
        worker.join(timeout=poll_seconds)
        flags[0], flags[1] = float("error" in done and not done["error"][1]), float(worker.is_alive())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        failed, working = flags.tolist()
        if failed:
            stop.set()
        if not working:
            break
    results = [None] * pstate.world_size
    dist.all_gather_object(results, ("error", done["error"]) if "error" in done else ("ok", done["result"]))
    failures = [(rank, error) for rank, (kind, error) in enumerate(results) if kind == "error" and not error[1]]
    if failures:
        rank, (checkpoint_error, _, message) = failures[0]
        raise (CheckpointError if checkpoint_error else RuntimeError)(
            f"the universal conversion failed on rank {rank}: {message}")
    return [result for _, result in results]


def check_on_rank0(cfg, world_size: int, tp: int, pp: int, shape: dict, log) -> tuple:
    """(load target or None, the weights to start from or None, the held JobLock or None): `check_start` then
    `take_save_folder` on one process; raises CheckpointError / DataError."""
    target, init_from, copy, conversions = check_start(cfg, world_size, shape, log)
    return target, init_from, take_save_folder(cfg, world_size, tp, pp, log, copy, conversions)


def check_start(cfg, world_size: int, shape: dict, log) -> tuple:
    """The logs' folders, then steps 1-4, read-only: (load target or None, the weights to start from or None, the
    universal copy still to write or None, the folder of this checkpoint's universal copies or None)."""
    check_log_paths(cfg.logging.metrics_file, cfg.logging.tensorboard_dir, cfg.logging.diagnostics_dir)
    ck = cfg.checkpoint
    peek_lock(ck.save, ck.override_lock)
    target, note = resolve_load(ck.load)
    target, init_from, note = choose_start(ck.init_from, target, note)
    copy, conversions = None, None
    if target is not None:
        if target.universal is None:  # where this checkpoint's universal copies go
            conversions = ck.universal_dir or f"{target.directory}_universal"
        target, copy = plan_load(target, shape, world_size, ck.universal_dir, cfg.training.precision, log, cfg.model,
                                 verify=ck.verify_checksums, run=cfg.to_dict())
    if init_from is not None:
        check_weights_fit(init_from, cfg.model, "checkpoint.init_from" if init_from == ck.init_from
                          else "checkpoint.load")
    check_save_holds_no_other_run(ck.save, target, ck.load)
    check_data(cfg, log)
    if note:
        log(note)
    return target, init_from, copy, conversions


def take_save_folder(cfg, world_size: int, tp: int, pp: int, log, copy=None,
                     conversions: Optional[str] = None) -> Optional[JobLock]:
    """Steps 6-7: checkpoint.save locked, probed, cleaned and checked for room; then, with the lock held, killed
    conversions' leftovers in `conversions` removed and the universal `copy` written. The held lock (None without
    checkpoint.save)."""
    ck = cfg.checkpoint
    lock = JobLock(ck.save) if ck.save else None
    if lock is not None:
        lock.acquire(ck.override_lock, log)
    try:
        if ck.save:
            probe_writable(ck.save)
            clean_leftovers(ck.save, log)
            need = checkpoint_bytes(count_parameters(cfg.model, tp, pp), cfg.training.precision,
                                    cfg.training.zero_stage, world_size)
            check_free_space(ck.save, need, log)
        if conversions is not None:
            clean_conversion_leftovers(conversions, log)
        if copy is not None:
            write_universal_copy(copy, log, owner=this_job())
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


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


__all__ = ["Preflight", "run_preflight", "wait_for_rank0", "convert_over_ranks", "check_on_rank0", "check_start",
           "take_save_folder", "check_data", "count_parameters",
           "check_save_holds_no_other_run"]
