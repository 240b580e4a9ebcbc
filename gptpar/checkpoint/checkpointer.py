"""The run's checkpoints on every rank: when to save, what a save refuses, the save itself, and the resume.

One checkpoint (tag `iter_{N:07d}`, layout in gptpar.checkpoint.layout):

    {save}/iter_0000300/                DeepSpeed's files (model states per (tp, pp) rank, ZeRO-1 optimizer shards
                                        per dp rank), written by DeepSpeed's save_checkpoint through the engine's
                                        CheckpointWriter (gptpar.checkpoint.writer: hashed as written, fsynced)
    {save}/iter_0000300/gptpar_rank_00000.pt   per rank: counters, ramp-up and LR-schedule inputs, RNG states
    {save}/iter_0000300/config.json     the resolved config of the run that saved it
    {save}/iter_0000300/gptpar_manifest.json   every file: size, sha256, writing rank; written last

The policy (`save`): a save is due every `checkpoint.save_interval` iterations and at the end; it is refused, with a
warning (or, for the final save, NonFiniteWeightsError), while the weights hold NaN/Inf or a pre-save check (the
replica check) reports a problem: `latest` keeps the last good checkpoint.

The write is gptpar.checkpoint.durable's: every rank writes into `{save}/iter_N.tmp-TOKEN` (rank 0's token), then
the ranks agree over their own gloo group (from the writer thread when async) and rank 0 writes config.json and the
manifest, fsyncs the folder, renames it into place (a tag re-saved after a rollback is swapped in, never rewritten),
fsyncs the save folder, moves `latest` (fsynced), and only then prunes `keep_last`. A save killed half-way leaves
only the temporary folder, which the next start deletes; a save that fails (a full disk, an I/O error, a snapshot
that could not be taken) raises CheckpointSaveError naming the folder and the cause, on every rank; `latest` stays.

The resume (`load`) reads every file through the Verifier of gptpar.checkpoint.manifest: each rank hashes the files
it wrote, the ranks agree, and only then does DeepSpeed load (its reads come from the page cache): a damaged file
ends every rank with CheckpointError naming it (exit 2, so gptpar.launch does not restart) before any rank parses a
byte of it. A universal copy is verified the same way, each of its files hashed by one rank before the ranks take
their slices.
"""
from __future__ import annotations

import functools
import os
import random
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from gptpar.checkpoint import stop_grace, universal
from gptpar.checkpoint.durable import StagedFolder, describe_write_failure, publish_latest, retire_folder
from gptpar.checkpoint.exceptions import CheckpointError, CheckpointSaveError
from gptpar.checkpoint.layout import (CONFIG, TAG_RE, LoadTarget, complete_checkpoints, earlier_checkpoint_fix,
                                      read_latest, state_file, tag_of)
from gptpar.checkpoint.manifest import CHECKPOINT, Verifier, read_manifest
from gptpar.checkpoint.resume import FORMAT_VERSION, check_shape, read_rank_state
from gptpar.model.config import GPTConfig
from gptpar.model.sharding import shard_tensor


class NonFiniteWeightsError(CheckpointSaveError):
    """The run's last save was refused: the weights hold NaN/Inf (`latest` keeps the last finite checkpoint)."""


def rng_states(tracker) -> dict:
    """Every generator's state, as tensors and plain values (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                    gauss), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tracker": tracker.get_states() if tracker is not None else None}


def set_rng_states(states: dict, tracker) -> None:
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    keys = keys.numpy() if torch.is_tensor(keys) else keys  # an array in format 2
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if tracker is not None and states.get("tracker") is not None:
        tracker.set_states(states["tracker"])


@dataclass
class Checkpointer:
    """Saves and loads the run's checkpoints on every rank (all calls are collective).

    `load_target` is what checkpoint.load resolved to before training (None = a fresh start); `token` names the
    save's temporary folders (rank 0's pid, the same on every rank); `pre_save_checks` are collective callables
    `(engine) -> problem or None` run before each save (a problem refuses it)."""

    save_dir: Optional[str]
    load_target: Optional[LoadTarget]
    keep_last: Optional[int]
    rank: int
    world_size: int
    shape: dict
    config_json: str
    log: Callable = print
    device: object = "cpu"  # where the all-reduces' flag lives (a GPU under NCCL)
    tp_rank: int = 0
    tp_size: int = 1
    # GPTModel's name of each of the engine's parameter names (gptpar.checkpoint.universal.gpt_parameter_name)
    parameter_name: Callable[[str], str] = field(default=lambda name: name)
    model_config: Optional[GPTConfig] = None  # the model of a universal folder DeepSpeed wrote (it has none)
    save_interval: Optional[int] = None

    # The engine's CheckpointWriter (every file of a save goes through it), the process group the ranks agree
    # over (gloo, separate from training's: an async job agrees from the writer thread), checksums recorded,
    # checksums verified on load.
    writer: Optional[object] = None
    group: object = None
    checksums: bool = True
    verify: bool = True
    token: str = field(default_factory=lambda: str(os.getpid()))
    pre_save_checks: List[Callable] = field(default_factory=list)
    saved_at: Optional[int] = None  # the iteration of the last save (or of the checkpoint resumed)
    iteration_seconds: float = 0.0  # the last iteration's, set by the trainer: recorded with each save's duration
    _announced: set = field(default_factory=set)  # the waits said once (checkpoint.async_save)
    _reported: Optional[object] = None  # the save whose outcome was last handed to the trainer

    # -- the policy ------------------------------------------------------------------------------
    def due(self, iteration: int) -> bool:
        """Whether checkpoint.save_interval asks for a save after `iteration`."""
        return bool(self.save_dir and self.save_interval and iteration % self.save_interval == 0)

    def save(self, engine, iteration: int, client_state: dict, tracker, final: bool = False) -> Optional[str]:
        """Save checkpoint `iter_{iteration}` unless there is nothing to do (no checkpoint.save, or saved at this
        iteration already) or the save is refused: weights with NaN/Inf or a pre-save check's problem give a
        warning and keep `latest` (a refused `final` save raises NonFiniteWeightsError for NaN/Inf,
        CheckpointSaveError for a check). Returns the checkpoint's path, or None when nothing was saved."""
        if not self.save_dir or self.saved_at == iteration:
            return None
        problem = None if self.weights_finite(engine) else "the weights hold NaN/Inf"
        for check in self.pre_save_checks if problem is None else ():
            problem = check(engine)
            if problem is not None:
                break
        if problem is not None:
            message = f"not saving iteration {iteration}: {problem}{self.latest_note()}"
            if final:
                raise (NonFiniteWeightsError if "NaN/Inf" in problem else CheckpointSaveError)(message)
            self.log(f"warning: {message}", flush=True)
            return None
        start = time.time()
        path = self._save(engine, iteration, client_state, tracker)
        self.saved_at = iteration
        if self.writer.async_save:
            self.log(f"saving checkpoint {path} in the background (training stopped {time.time() - start:.2f} s "
                     "for it)", flush=True)
        else:
            self.log(f"saved checkpoint {path} in {time.time() - start:.2f} s", flush=True)
            self._record_times(iteration, time.time() - start)
        return path

    def _record_times(self, iteration: int, seconds: float) -> None:
        """Rank 0: this save's and the last iteration's seconds, for gptpar.launch's stop grace."""
        if self.rank == 0:
            stop_grace.record(self.save_dir, iteration, self.iteration_seconds, seconds,
                              lambda line: self.log(line, flush=True))

    def weights_finite(self, engine) -> bool:
        """Whether every rank's weights are finite (one all-reduce MAX of a flag)."""
        bad = any(not bool(torch.isfinite(p).all()) for p in engine.parameters())
        flag = torch.tensor([float(bad)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0

    def latest_note(self) -> str:
        """"; `latest` in SAVE stays at TAG" (after any save in flight is written), for the messages of a refusal."""
        if not self.save_dir:
            return ""
        self.wait()
        try:
            latest = read_latest(self.save_dir)
        except CheckpointError:
            latest = None
        return f"; `latest` in {self.save_dir} stays at {latest}" if latest else f"; {self.save_dir} holds no checkpoint"

    # -- the write -------------------------------------------------------------------------------
    def _save(self, engine, iteration: int, client_state: dict, tracker) -> str:
        """Every file (DeepSpeed's and this rank's state) goes through the engine's CheckpointWriter into the
        temporary folder; once every rank's files are whole, rank 0 commits (`_agree_and_commit`). With
        checkpoint.async_save this returns as soon as the snapshot is planned and the writer thread does the rest
        (`wait`, `poll`); a save still in flight is waited for first."""
        self.wait("saving the next one")
        tag = tag_of(iteration)
        staged = StagedFolder(os.path.join(self.save_dir, tag), self.token)
        with self._failures(tag, defer=True) as failed:
            if self.rank == 0:
                staged.create()
        _agree_or_raise(failed, self.device)
        # A write that fails is kept by the writer and agreed on after all files were given (no rank leaves
        # DeepSpeed's closing barrier early); anything else failing inside DeepSpeed's save raises at once.
        with self._failures(tag):
            engine.save_checkpoint(self.save_dir, os.path.basename(staged.tmp), {"gptpar_iteration": iteration})
        state = dict(client_state, version=FORMAT_VERSION, shape=self.shape, rng=rng_states(tracker))
        self.writer.save(state, os.path.join(staged.tmp, state_file(self.rank)))
        self.writer.start(functools.partial(self._agree_and_commit, staged, iteration), name=staged.target)
        if not self.writer.async_save:
            self.wait()
        return staged.target

    def _agree_and_commit(self, staged: StagedFolder, iteration: int, records: dict,
                          error: Optional[BaseException]):
        """The end of a save, on every rank once its files are written (in the writer thread when async): the
        ranks exchange their files' records and failures over `group`; if none failed rank 0 writes config.json
        and the manifest, puts the folder in place, moves `latest`, then prunes. Returns the failure every rank
        reports (None: saved)."""
        tag = os.path.basename(staged.target)
        mine = ({os.path.relpath(p, staged.tmp): dict(r, rank=self.rank) for p, r in records.items()},
                describe_save_failure(self.save_dir, tag, self.rank, error) if error is not None else None)
        everyone = [mine]
        if self.group is not None:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self.group)
        failures = [message for _, message in everyone if message]
        if self.rank == 0:
            try:
                if not failures:
                    with open(os.path.join(staged.tmp, CONFIG), "w") as f:  # fsynced and hashed with the manifest
                        f.write(self.config_json)
                    staged.commit(CHECKPOINT, {rel: r for files, _ in everyone for rel, r in files.items()},
                                  self.checksums, self.log, replace=True, iteration=iteration,
                                  world_size=self.world_size)
                    publish_latest(self.save_dir, tag, self.log)
                    self._prune(iteration)
            except (OSError, RuntimeError) as e:
                failures.append(describe_save_failure(self.save_dir, tag, self.rank, e))
            if failures:
                staged.abandon()  # the partial folder goes now: it may hold most of a checkpoint's bytes
        if self.group is not None:  # every rank learns whether rank 0 committed
            box = [failures]
            dist.broadcast_object_list(box, src=0, group=self.group)
            failures = box[0]
        return failures[0] if failures else None

    def wait(self, why: Optional[str] = None) -> None:
        """Block until the save in flight (checkpoint.async_save) is written; raise CheckpointSaveError, on
        every rank alike, if it failed. `why`: what waits, said once per kind of wait."""
        if self.writer is None:
            return
        save = self.writer.in_flight()
        if save is not None and why is not None and why not in self._announced:
            self._announced.add(why)
            self.log(f"waiting for checkpoint {save.name} to finish writing before {why} (checkpoint.async_save: "
                     "one save in flight at a time)", flush=True)
        self.writer.wait()
        self._consume()

    def poll(self) -> None:
        """Between iterations: say that an async save was written (rank 0's log). Its failure is left to the
        trainer, which agrees on it through `failed` (all ranks stop at the same iteration) and raises by `wait`."""
        save = self.writer.finished() if self.writer is not None else None
        if save is not None and save is not self._reported and save.outcome is None:
            self._consume()

    def failed(self) -> bool:
        """Whether the last save is known, on this rank, to have failed (not yet raised)."""
        save = self.writer.finished() if self.writer is not None else None
        return save is not None and save is not self._reported and save.outcome is not None

    def _consume(self) -> None:
        """Hand the outcome of the last finished save to the run, once."""
        save = self.writer.finished()
        if save is None or save is self._reported:
            return
        self._reported = save
        if isinstance(save.outcome, str):
            raise CheckpointSaveError(save.outcome)
        if save.outcome is not None:
            raise CheckpointSaveError(f"the checkpoint writer failed saving {save.name} "
                                      f"({type(save.outcome).__name__}: {save.outcome}); `latest` was not moved")
        if self.writer.async_save:
            self.log(f"saved checkpoint {save.name} in {save.seconds:.2f} s (written while training went on)",
                     flush=True)
            match = TAG_RE.match(os.path.basename(save.name))
            self._record_times(int(match.group(1)) if match else -1, save.seconds)

    def _failures(self, tag: str, defer: bool = False) -> "_SaveFailure":
        return _SaveFailure(self.save_dir, tag, self.rank, defer)

    def _prune(self, newest: int) -> None:
        """Delete all but the newest `keep_last` complete checkpoints at or before the one `latest` points at
        (called once `latest` is on disk). Each is renamed aside before any file goes (durable.retire_folder), so a
        prune cut short never leaves an `iter_N` that looks complete; one that cannot be renamed is left whole,
        with a warning (the save itself succeeded)."""
        if not self.keep_last:
            return
        done = [tag for tag in complete_checkpoints(self.save_dir) if int(TAG_RE.match(tag).group(1)) <= newest]
        for tag in done[:-self.keep_last]:
            try:
                retire_folder(os.path.join(self.save_dir, tag), self.token, self.log)
            except OSError as e:
                self.log(f"warning: could not delete {os.path.join(self.save_dir, tag)} (checkpoint.keep_last="
                         f"{self.keep_last}): {type(e).__name__}: {e.strerror or e}; it stays, complete", flush=True)

    # -- the resume ------------------------------------------------------------------------------
    def load(self, engine, tracker) -> Optional[dict]:
        """Restore `load_target` (checked whole before training), every file verified before it is parsed; its client
        state, or None to start fresh."""
        target = self.load_target
        if target is None:
            return None
        if target.universal is not None:
            return self._load_universal(engine, target.universal)
        path = target.path
        verifier = Verifier(path, read_manifest(path, earlier_checkpoint_fix(target)), earlier_checkpoint_fix(target),
                            enabled=self.verify, checks=lambda _, record: record.get("rank", 0) == self.rank,
                            defer=True)
        # Each rank hashes the files it wrote, the ranks agree, and only then does any rank parse a byte: DeepSpeed
        # loads files other ranks wrote (the model states, every dp rank's ZeRO shard), so a file is known whole
        # before it reaches any rank's unpickler.
        verifier.verify_share()
        self._agree_on(verifier)
        verifier.trust_all()
        state = read_rank_state(path, self.rank, verifier)
        self.writer.verifier = verifier
        try:
            loaded = engine.load_checkpoint(target.directory, target.tag)
        finally:
            self.writer.verifier = None
        check_shape(state["shape"], self.shape, path)
        if not loaded:
            raise CheckpointError(f"DeepSpeed could not load {path}")
        set_rng_states(state["rng"], tracker)
        self.saved_at = state["iteration"]
        self.log(f"resumed from {path}: iteration {state['iteration']}, {state['consumed_samples']} consumed samples"
                 + ("; every file matched its checksum" if self.verify and verifier.manifest.has_digests else ""))
        return state

    def _agree_on(self, verifier: Verifier) -> None:
        """Every rank learns every rank's verification problems; all raise the same CheckpointError, or none."""
        problems = list(verifier.problems)
        if self.group is not None:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, problems, group=self.group)
            problems = [line for lines in everyone for line in lines]
        verifier.raise_problems(problems)

    def _load_universal(self, engine, directory: str) -> Optional[dict]:
        """Every parameter of this rank: its tp slice (vocab padding re-added for this tp) of the full fp32
        master weight and Adam moments, set through the engine (which cuts this dp rank's ZeRO partition) with
        the parameter's Adam step; each file of the folder verified by one rank while it reads it. Returns the
        counters; None (a fresh start of the counters and schedule) for a folder without them."""
        try:
            verifier = universal.open_universal(directory, self.log, self.verify, quiet=True, defer=True)
            listed = sorted(verifier.manifest.files) if verifier.manifest is not None else []
            order = {os.path.join(verifier.folder, rel): i for i, rel in enumerate(listed)}
            # file i of the folder is verified by rank i % world_size, before any rank reads it
            verifier.checks = lambda path, _: order.get(path, 0) % self.world_size == self.rank
            verifier.verify_share()  # every rank's share hashed and agreed on before any file is parsed
            self._agree_on(verifier)
            verifier.trust_all()
            meta = universal.read_meta(verifier, self.model_config)
            for name, param in engine.named_parameters():
                full_name = self.parameter_name(name)
                states = {key: shard_tensor(universal.read_state(verifier, full_name, key, meta), param,
                                            self.tp_rank, self.tp_size).to(param.device) for key in universal.STATES}
                step = float(universal.read_state(verifier, full_name, "step", meta))
                engine.set_full_state(param, states.pop("fp32"), states, step)
        except universal.UniversalCheckpointError as e:
            raise CheckpointError(str(e)) from None
        counters = meta["counters"] or None
        where = (f"iteration {counters['iteration']}, {counters['consumed_samples']} consumed samples" if counters
                 else "iteration 0 (no counters in it)")
        if counters:
            self.saved_at = counters["iteration"]
        self.log(f"resumed from universal checkpoint {directory}: {where}, Adam step {step:g} (RNG streams "
                 "start from the seed: they are per rank)")
        return counters


class _SaveFailure:
    """Turns an OSError (or torch's writer error) inside a save into CheckpointSaveError naming the folder and
    the cause. `defer` collects it in the list `with` returns instead of raising, for the ranks to agree first."""

    def __init__(self, save_dir: str, tag: str, rank: int, defer: bool):
        self.save_dir, self.tag, self.rank, self.defer = save_dir, tag, rank, defer
        self.errors = []

    def __enter__(self):
        return self.errors

    def __exit__(self, exc_type, exc, tb):
        if exc is None or not isinstance(exc, (OSError, RuntimeError)) or isinstance(exc, CheckpointError):
            return False
        error = CheckpointSaveError(describe_save_failure(self.save_dir, self.tag, self.rank, exc))
        if not self.defer:
            raise error from exc
        self.errors.append(error)
        return True


def describe_save_failure(save_dir: str, tag: str, rank: int, exc: BaseException) -> str:
    """Where and why a save failed, the free space left, and what `latest` still points at."""
    try:
        kept = read_latest(save_dir)
    except CheckpointError:
        kept = None
    intact = f"`latest` still points at {kept}" if kept else "no earlier checkpoint there"
    return (f"rank {rank} could not save checkpoint {tag} in {save_dir}: {describe_write_failure(save_dir, exc)}; "
            f"{intact}. Free space or set checkpoint.save to another folder, then resume")


def _agree_or_raise(errors: list, device) -> None:
    """All ranks learn whether any failed (one all-reduce MAX, also the barrier), so none moves on alone."""
    failed = torch.tensor([float(bool(errors))], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if errors:
        raise errors[0]
    if failed.item() > 0:
        raise CheckpointSaveError("another rank could not write its part of the checkpoint (its message says "
                                  "why); `latest` was not moved")


__all__ = ["Checkpointer", "NonFiniteWeightsError", "rng_states", "set_rng_states", "describe_save_failure"]
