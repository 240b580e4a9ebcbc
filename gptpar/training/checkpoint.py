"""Checkpoints: DeepSpeed's files plus gptpar's own state, and a `latest` pointer that is never half-written.

Layout of one checkpoint (tag `iter_{N:07d}`):

    {save}/latest                       "iter_0000300": written by rank 0 only after every rank finished
                                        (barrier), via a temporary file + atomic rename
    {save}/iter_0000300/                DeepSpeed's save_checkpoint(save, tag, save_latest=False): model
                                        states per (tp, pp) rank, ZeRO-1 optimizer shards per dp rank
    {save}/iter_0000300/gptpar_rank_00000.pt   per rank: counters, ramp-up and LR-schedule inputs, the RNG
                                        states (torch, numpy, python, the tp tracker's streams)
    {save}/iter_0000300/config.json     the resolved config of the run that saved it

A save killed half-way leaves `latest` on the previous complete checkpoint, so a resume never reads a
partial one. `keep_last` deletes the oldest complete checkpoints after `latest` moved on.

Resume: the model and parallel shape stored in config.json must equal the current config's (a clear
error otherwise: ZeRO shards and tp/pp slices cannot be reshaped here); every other key (LR, intervals,
exit conditions, ...) comes from the current config. An empty or missing `load` directory starts fresh.

`GPTPAR_TEST_KILL_IN_SAVE=N` (test-only fault injection): rank 0 SIGKILLs itself while saving iteration N,
after DeepSpeed wrote its files and before the gptpar files and `latest`.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest"
TAG_RE = re.compile(r"^iter_(\d{7,})$")
FORMAT_VERSION = 1

# The keys that fix the shape of the weights and of the optimizer shards.
MODEL_SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                    "max_position_embeddings", "activation")
PARALLEL_SHAPE_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                       "partition_method", "zero_stage")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed with this config; the message says what differs."""


def tag_of(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def read_latest(directory: Optional[str]) -> Optional[str]:
    """The tag `latest` points at, or None when the directory or the pointer does not exist."""
    if not directory:
        return None
    path = os.path.join(directory, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    return tag or None


def write_latest(directory: str, tag: str) -> None:
    """Point `latest` at `tag` atomically: a reader sees the old or the new pointer, never a partial one."""
    tmp = os.path.join(directory, f".{LATEST}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, LATEST))


def shape_of(cfg_dict: dict, tp: int, pp: int, dp: int, padded_vocab: int, partition_method: str) -> dict:
    """What must match between a checkpoint and the run resuming from it."""
    model = {k: cfg_dict["model"].get(k) for k in MODEL_SHAPE_KEYS}
    model["padded_vocab_size"] = padded_vocab
    return {"model": model, "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                         "data_parallel_size": dp, "partition_method": partition_method,
                                         "zero_stage": cfg_dict["training"]["zero_stage"]}}


def check_shape(saved: dict, current: dict, where: str) -> None:
    """Raise CheckpointError listing every model/parallel key that differs."""
    diffs = [f"{section}.{key}: checkpoint {saved.get(section, {}).get(key)!r}, config {value!r}"
             for section, values in current.items() for key, value in values.items()
             if saved.get(section, {}).get(key) != value]
    if diffs:
        raise CheckpointError(f"checkpoint {where} does not fit this config's model/parallel shape:\n  "
                              + "\n  ".join(diffs)
                              + "\nresume with the config it was saved with, or point checkpoint.load elsewhere")


def rng_states(tracker) -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tracker": tracker.get_states() if tracker is not None else None}


def set_rng_states(states: dict, tracker) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if tracker is not None and states.get("tracker") is not None:
        tracker.set_states(states["tracker"])


@dataclass
class Checkpointer:
    """Saves and loads the run's checkpoints on every rank (all calls are collective)."""

    save_dir: Optional[str]
    load_dir: Optional[str]
    keep_last: Optional[int]
    rank: int
    shape: dict
    config_json: str
    log: callable = print

    # -- save ----------------------------------------------------------------------------------
    def save(self, ds_engine, iteration: int, client_state: dict, tracker) -> str:
        """Write checkpoint `iter_{iteration}` on every rank, then move `latest` to it. Returns the path."""
        tag = tag_of(iteration)
        path = os.path.join(self.save_dir, tag)
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
        _barrier()
        ds_engine.save_checkpoint(self.save_dir, tag=tag, client_state={"gptpar_iteration": iteration},
                                  save_latest=False)
        _fault_point(iteration, self.rank)
        state = dict(client_state, version=FORMAT_VERSION, shape=self.shape, rng=rng_states(tracker))
        torch.save(state, os.path.join(path, f"gptpar_rank_{self.rank:05d}.pt"))
        if self.rank == 0:
            with open(os.path.join(path, "config.json"), "w") as f:
                f.write(self.config_json)
        _barrier()  # every rank's files are on disk before the pointer moves
        if self.rank == 0:
            write_latest(self.save_dir, tag)
            self._prune(iteration)
        _barrier()
        return path

    def _prune(self, newest: int) -> None:
        """Delete all but the newest `keep_last` checkpoints at or before the one `latest` points at."""
        if not self.keep_last:
            return
        done = sorted(i for i in _iterations(self.save_dir) if i <= newest)
        for i in done[:-self.keep_last]:
            shutil.rmtree(os.path.join(self.save_dir, tag_of(i)), ignore_errors=True)

    # -- load ----------------------------------------------------------------------------------
    def load(self, ds_engine, tracker) -> Optional[dict]:
        """Restore the checkpoint `latest` points at; its client state, or None to start fresh."""
        tag = read_latest(self.load_dir)
        if tag is None:
            if self.load_dir:
                self.log(f"no checkpoint in {self.load_dir} (no `{LATEST}` file): starting from scratch")
            return None
        path = os.path.join(self.load_dir, tag)
        state_file = os.path.join(path, f"gptpar_rank_{self.rank:05d}.pt")
        if not os.path.isfile(state_file):
            raise CheckpointError(f"{self.load_dir}/{LATEST} points at {tag}, which has no {state_file} "
                                  "(saved by another topology or not by gptpar)")
        state = torch.load(state_file, weights_only=False)
        check_shape(state["shape"], self.shape, path)
        loaded, _ = ds_engine.load_checkpoint(self.load_dir, tag=tag)
        if loaded is None:
            raise CheckpointError(f"DeepSpeed could not load {path}")
        set_rng_states(state["rng"], tracker)
        self.log(f"resumed from {path}: iteration {state['iteration']}, "
                 f"{state['consumed_samples']} consumed samples")
        return state


def _iterations(directory: str):
    if not os.path.isdir(directory):
        return []
    return [int(m.group(1)) for m in map(TAG_RE.match, os.listdir(directory)) if m]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fault_point(iteration: int, rank: int) -> None:
    target = os.environ.get("GPTPAR_TEST_KILL_IN_SAVE")
    if target is not None and int(target) == iteration and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["Checkpointer", "CheckpointError", "read_latest", "write_latest", "tag_of", "shape_of", "check_shape",
           "rng_states", "set_rng_states"]
