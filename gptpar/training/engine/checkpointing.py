"""DeepSpeed's part of a checkpoint: the model and optimizer shard files of one tag, written and read by the
DeepSpeed engine through gptpar's CheckpointWriter (gptpar/checkpoint/writer.py: checksums, async saves). gptpar's own
files, `latest`, the manifest and the save folder's rules live in gptpar/checkpoint/."""
from __future__ import annotations

import glob
import os

import torch

from gptpar.training.engine.optimizer_state import optimizers


def install_writer(ds, writer) -> None:
    """Every file DeepSpeed's engine saves (and loads) goes through `writer` from now on: it becomes the engine's
    `checkpoint_engine`, the object DeepSpeed calls for each file (the pipeline engine's layer files
    included), keeping the serialisation DeepSpeed chose. The client optimizer's step, the first thing that
    changes the saved tensors in place, waits for the snapshot of an async save first."""
    writer.zipfile_serialization = getattr(ds.checkpoint_engine, "zipfile_serialization", True)
    ds.checkpoint_engine = writer
    optimizers(ds)[1].register_step_pre_hook(lambda optimizer, args, kwargs: writer.wait_for_snapshot())


def save(ds, save_dir: str, tag: str, client_state: dict) -> None:
    """DeepSpeed's part of checkpoint `tag` (model and optimizer shards); `latest` is gptpar's to move."""
    ds.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)


def load(ds, directory: str, tag: str) -> bool:
    """Restore DeepSpeed's part of checkpoint `tag`; False when DeepSpeed found nothing to load."""
    loaded, _ = ds.load_checkpoint(directory, tag=tag)
    return loaded is not None


def checkpoint_loss_scale(iteration_dir: str) -> float:
    """The dynamic loss scale DeepSpeed's fp16 ZeRO-1 optimizer wrote into a checkpoint folder (each
    optimizer shard holds its loss scaler; they must agree): what `loss_scale` logged at that iteration."""
    shards = sorted(glob.glob(os.path.join(iteration_dir, "*optim_states.pt")))
    if not shards:
        raise FileNotFoundError(f"{iteration_dir}: no DeepSpeed optimizer shards (*optim_states.pt)")
    scales = {float(torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]["loss_scaler"]
                    .cur_scale) for f in shards}
    if len(scales) != 1:
        raise ValueError(f"{iteration_dir}: the optimizer shards disagree on the loss scale: {sorted(scales)}")
    return scales.pop()
