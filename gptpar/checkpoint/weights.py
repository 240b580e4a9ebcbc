"""Full weights from any source, and weights-only checkpoints: the one reader behind checkpoint.init_from,
tools/generate.py, tools/eval_harness.py and tools/convert_checkpoint.py.

`read_weights(path)` gives one full (tp = 1) state dict, keyed by GPTModel's parameter names with the word
embedding trimmed to the real vocabulary (padding rows depend on tp: Megatron pads the vocab to a multiple of
128 x tp; gptpar.model.sharding re-adds them for the target tp), from whatever `path` holds:

    a training checkpoint (any tp x pp)   an iter_N folder, or the save folder holding `latest`
    a weights-only checkpoint             tools/convert_checkpoint.py --to gptpar (`save_weights_only`)
    a universal checkpoint                gptpar's, or one DeepSpeed's ds_to_universal.py wrote
    a Hugging Face model directory        GPT-2 or BLOOM (gptpar.checkpoint.huggingface)

Every file is read through gptpar.checkpoint.manifest's Verifier: a folder gptpar wrote is read only with its
manifest and only the files it lists, each checked against its sha256 before it is parsed (a flipped byte
anywhere refused, naming the file); a folder
gptpar did not write is said in one line to carry no checksums. `check_weight_files` checks, before any weight is
read, that everything `read_weights` will read is there and whole.

Which files DeepSpeed writes (one checkpoint folder):
  pp = 1   mp_rank_{tp:02d}_model_states.pt                 key 'module': GPTModel's state dict
  pp > 1   layer_{idx:02d}-model_{tp:02d}-model_states.pt   one pipeline layer's state dict
           with the spec indices of gptpar.model.pipeline.layer_specs (`gpt_layer_prefixes`: embedding 0,
           transformer layer i at w + i, final LayerNorm at w + L; w = embedding weight).
Shards are merged and split by the parameters' own tags (`tensor_model_parallel`, `partition_dim`) read off a
`meta`-device model, never by name patterns.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

from gptpar.checkpoint import universal
from gptpar.checkpoint.durable import StagedFolder
from gptpar.checkpoint.exceptions import CheckpointError, ConversionError
from gptpar.checkpoint.layout import (CONFIG, MANIFEST, TAG_RE, is_universal_folder, layer_file,
                                      model_states_file, resolve_load)
from gptpar.checkpoint.manifest import MARK, WEIGHTS_ONLY, Verifier, open_folder
from gptpar.checkpoint.weight_files import file_problems
from gptpar.checkpoint.writer import write_file
from gptpar.model.config import GPTConfig
from gptpar.model.partition import partition_layers
from gptpar.model.pipeline import gpt_layer_prefixes

StateDict = Dict[str, torch.Tensor]
SOURCES = ("a gptpar checkpoint folder (e.g. checkpoints/run/iter_0000100), its save folder (holding `latest`), a "
           "weights-only or universal checkpoint, or a local Hugging Face model directory")
FIX = "use another checkpoint, or copy, convert or export this one again"


def resolve_checkpoint_dir(path: str, tag: Optional[str] = None) -> str:
    """The checkpoint folder `path` means: the folder itself (an iter_N or weights-only folder), `tag` inside it,
    or what its `latest` points at (which must exist and be complete: the messages resume gives)."""
    if not os.path.exists(path):
        raise ConversionError(f"{path} does not exist: give {SOURCES}")
    if not os.path.isdir(path):
        raise ConversionError(f"{path} is a file, not a checkpoint folder: give the folder that holds it")
    if tag:
        path = os.path.join(path, tag)
        if not os.path.isdir(path):
            raise ConversionError(f"{path} does not exist: --tag names an iter_N folder inside --load")
        return path
    if TAG_RE.match(os.path.basename(os.path.normpath(path))) or any(
            os.path.isfile(os.path.join(path, name)) for name in (MANIFEST, CONFIG)):
        return path  # a checkpoint folder itself (a weights-only one has no iter_N name)
    try:
        target, note = resolve_load(path)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    if target is None:
        raise ConversionError(f"{path} holds no checkpoint ({note.split(': ', 1)[-1].split(';')[0]}): give {SOURCES}")
    return target.path


def is_hf_model_dir(path: str) -> bool:
    """A local Hugging Face model directory: its config.json names a `model_type` (gptpar's names `model`)."""
    config = os.path.join(path, CONFIG)
    if not os.path.isfile(config):
        return False
    try:
        with open(config) as f:
            return "model_type" in json.load(f)
    except (OSError, ValueError, TypeError) as e:
        raise ConversionError(f"{config} is unreadable ({type(e).__name__}: {e})") from None


def _source(path: str) -> str:
    """What `path` holds: "universal", "huggingface" or "gptpar" (a training or weights-only checkpoint)."""
    if os.path.isdir(path) and is_universal_folder(path):
        return "universal"
    if os.path.isdir(path) and is_hf_model_dir(path):
        return "huggingface"
    return "gptpar"


def _open(ckpt: str, log: Callable[[str], None], verify: bool, quiet: bool) -> Verifier:
    """A gptpar checkpoint folder opened for reading: its manifest required, every listed file whole."""
    try:
        verifier = open_folder(ckpt, FIX, log, verify, "--no-verify", quiet=quiet)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    if verifier.manifest is None:
        raise ConversionError(f"{ckpt} is not a gptpar checkpoint (no {MANIFEST}, no {CONFIG}): give {SOURCES}")
    return verifier


def _run_config(ckpt: str, verifier: Verifier) -> Tuple[dict, GPTConfig]:
    path = os.path.join(ckpt, CONFIG)
    try:
        run_config = json.loads(verifier.read_text(path))
        return run_config, GPTConfig(**run_config["model"])
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"{path} is unreadable ({type(e).__name__}: {e}): not a whole gptpar "
                              "checkpoint") from None


def _shard_files(ckpt: str, config: GPTConfig, parallel: dict) -> List[List[Tuple[str, str]]]:
    """Per tp rank, [(model-states file, the GPTModel name prefix of its keys)] of checkpoint folder `ckpt`."""
    tp = parallel.get("tensor_model_parallel_size", 1)
    pp = parallel.get("pipeline_model_parallel_size", 1)
    if pp == 1:
        return [[(os.path.join(ckpt, model_states_file(t)), "")] for t in range(tp)]
    weight = parallel.get("embedding_weight") or 1
    plan = partition_layers(config.num_layers, pp, parallel.get("partition_method", "auto"), weight)
    weight = plan.embedding_weight if plan.method == "balanced" else weight
    return [[(os.path.join(ckpt, layer_file(index, t)), prefix)
             for index, prefix in gpt_layer_prefixes(config.num_layers, weight).items()] for t in range(tp)]


def _read_shards(files: List[List[Tuple[str, str]]], pipelined: bool, verifier: Verifier):
    """For each tp rank, GPTModel-named tensors of that rank (all pipeline stages put together), every file
    verified before it is parsed."""
    shards = []
    for rank_files in files:
        sd = {}
        for path, prefix in rank_files:
            if not os.path.isfile(path):
                raise ConversionError(f"missing checkpoint file {path}: the checkpoint is incomplete")
            try:
                state = verifier.torch_load(path, weights_only=False)
            except CheckpointError as e:
                raise ConversionError(str(e)) from None
            except (RuntimeError, OSError, EOFError, ValueError) as e:
                raise ConversionError(f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}): "
                                      f"{FIX}") from None
            for key, value in (state if pipelined else state["module"]).items():
                if key != MARK:
                    sd[prefix + key] = value
        shards.append(sd)
    return shards


def shards_needed(config: GPTConfig, tp: int, for_rank: Optional[Tuple[int, int]] = None) -> List[int]:
    """The tp ranks of a checkpoint saved at `tp` whose files hold some of what tp rank `for_rank` = (rank, size)
    of a model at another tp keeps (every rank when `for_rank` is None): along each split tensor, the saved
    blocks that overlap the rank's block within the real rows (the vocabulary's padding rows differ by tp)."""
    from gptpar.model.gpt import GPTModel
    from gptpar.model.pipeline import padded_config

    if for_rank is None:
        return list(range(tp))
    rank, size = for_rank
    saved = dict(GPTModel(padded_config(config, tp), device="meta").named_parameters())
    wanted = dict(GPTModel(padded_config(config, size), device="meta").named_parameters())
    real = dict(GPTModel(config, device="meta").named_parameters())
    needed = set()
    for name, param in wanted.items():
        if not getattr(param, "tensor_model_parallel", False):
            continue
        dim = param.partition_dim
        want, have = param.shape[dim] // size, saved[name].shape[dim] // tp
        start, end = rank * want, min((rank + 1) * want, real[name].shape[dim])
        needed.update(s for s in range(tp) if s * have < end and start < (s + 1) * have)
    return sorted(needed) or [0]  # a rank holding only padding still takes the replicated tensors from one


def read_checkpoint_weights(path: str, tag: Optional[str] = None, log: Callable[[str], None] = print,
                            verify: bool = True, for_rank: Optional[Tuple[int, int]] = None
                            ) -> Tuple[StateDict, GPTConfig, dict]:
    """Read a gptpar checkpoint (any tp x pp, training or weights-only) into one tp = 1 state dict with the real
    vocab rows, every file verified before it is parsed. Returns (state dict, model config, the run's config dict).
    `for_rank` = (tp rank, tp size) of the model the weights go into: only the files holding that rank's blocks
    are read and verified (`shards_needed`), the rest of each split tensor left zero (that rank never takes it)."""
    from gptpar.model.gpt import GPTModel
    from gptpar.model.pipeline import padded_config

    ckpt = resolve_checkpoint_dir(path, tag)
    verifier = _open(ckpt, log, verify, quiet=False)
    run_config, config = _run_config(ckpt, verifier)
    parallel = run_config.get("parallel", {})
    tp = parallel.get("tensor_model_parallel_size", 1)
    if not glob.glob(os.path.join(ckpt, "*model_states.pt")):
        raise ConversionError(f"{ckpt} holds no DeepSpeed model states (*model_states.pt)")
    needed = shards_needed(config, tp, for_rank)
    files = _shard_files(ckpt, config, parallel)
    read = _read_shards([files[t] for t in needed], parallel.get("pipeline_model_parallel_size", 1) > 1, verifier)
    shards = dict(zip(needed, read))

    reference = GPTModel(config, device="meta")  # carries the sharding tags
    saved = dict(GPTModel(padded_config(config, tp), device="meta").named_parameters())  # the saved blocks' shapes
    full: StateDict = {}
    for name, param in reference.named_parameters():
        missing = [t for t, sd in shards.items() if name not in sd]
        if missing:
            raise ConversionError(f"{ckpt}: tensor {name} missing on tp rank(s) {missing}")
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            dim = param.partition_dim
            block = list(saved[name].shape)
            block[dim] //= tp
            full[name] = torch.cat([shards[t][name].float() if t in shards else torch.zeros(block)
                                    for t in range(tp)], dim=dim)
        else:
            full[name] = shards[needed[0]][name].float()
    emb = "embedding.word_embeddings.weight"
    full[emb] = full[emb][:config.vocab_size].clone()
    return full, config, run_config


def check_weight_files(path: str, tag: Optional[str] = None, config: Optional[GPTConfig] = None,
                       log: Callable[[str], None] = print) -> None:
    """ConversionError naming what `read_weights(path, tag, config)` would refuse, before anything is read or
    built: a folder gptpar wrote without its manifest, a listed file missing or of another size, a file it needs
    that the manifest does not list, a file that is not whole (a universal folder's fp32 states, a Hugging Face folder's weight files, a checkpoint's shards)."""
    from gptpar.checkpoint.huggingface import check_hf_files

    if not os.path.exists(path):
        resolve_checkpoint_dir(path)  # its "does not exist" message
    kind = _source(path)
    if kind == "universal":
        try:
            universal.read_meta(universal.open_universal(path, log, verify=False, quiet=True), config)
        except CheckpointError as e:
            raise ConversionError(str(e)) from None
        return
    if kind == "huggingface":
        check_hf_files(path, log)
        return
    ckpt = resolve_checkpoint_dir(path, tag)
    verifier = _open(ckpt, log, verify=False, quiet=True)
    run_config, model = _run_config(ckpt, verifier)
    files = [file for rank_files in _shard_files(ckpt, model, run_config.get("parallel", {})) for file, _ in rank_files]
    try:
        for file in files:
            if os.path.exists(file):  # a missing one is said below
                verifier.require_listed(file)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    problems = file_problems(files)
    if problems:
        raise ConversionError("unreadable weights: " + "; ".join(problems[:5])
                              + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "") + f": {FIX}")


def read_weights(path: str, tag: Optional[str] = None, config: Optional[GPTConfig] = None,
                 log: Callable[[str], None] = print, verify: bool = True,
                 for_rank: Optional[Tuple[int, int]] = None) -> Tuple[StateDict, GPTConfig]:
    """Full (tp = 1) weights with the real vocab rows, and the model config, from whatever `path` holds (see the
    module docstring); every file verified before it is parsed unless `verify` is off (the user asked by name). A
    universal folder DeepSpeed wrote records no model gptpar reads: it needs `config`. `for_rank` = (tp rank, tp
    size): a gptpar checkpoint's files that hold none of that rank's blocks are not read (read_checkpoint_weights);
    a universal or Hugging Face folder's files each hold whole tensors every rank needs."""
    from gptpar.checkpoint.huggingface import load_hf

    kind = _source(path)
    if kind == "universal":
        try:
            return universal.read_weights(path, config, log, verify)
        except CheckpointError as e:
            raise ConversionError(str(e)) from None
    if kind == "huggingface":
        return load_hf(path, log, verify)
    state, config, _ = read_checkpoint_weights(path, tag, log, verify, for_rank)
    return state, config


def read_weights_config(path: str, tag: Optional[str] = None, config: Optional[GPTConfig] = None) -> GPTConfig:
    """The model config of what `read_weights(path, tag, config)` returns, read without the tensors where the
    source keeps it apart (a Hugging Face or a gptpar checkpoint's config.json), so that shapes are checked
    before any weight is read; a universal folder is its metadata's model (gptpar's) or `config` once its names
    and shapes are checked against it (DeepSpeed's)."""
    from gptpar.checkpoint.huggingface import hf_config

    quiet = lambda *_: None  # noqa: E731 - the reads that follow say what there is to say
    kind = _source(path)
    if kind == "universal":
        try:
            return GPTConfig(**universal.read_meta(universal.open_universal(path, quiet, quiet=True), config)["model"])
        except CheckpointError as e:
            raise ConversionError(str(e)) from None
    if kind == "huggingface":
        return hf_config(path)
    ckpt = resolve_checkpoint_dir(path, tag)
    return _run_config(ckpt, _open(ckpt, quiet, verify=True, quiet=True))[1]


def run_config_of(path: str, tag: Optional[str] = None) -> Optional[dict]:
    """The training run's config a gptpar or universal checkpoint saved, verified (None for a Hugging Face
    directory or a universal folder written by DeepSpeed, which record none)."""
    quiet = lambda *_: None  # noqa: E731
    kind = _source(path)
    if kind == "universal":
        verifier = universal.open_universal(path, quiet, quiet=True)
        return None if verifier.manifest is None else universal.read_meta(verifier).get("config")
    if kind == "huggingface":
        return None
    ckpt = resolve_checkpoint_dir(path, tag)
    return _run_config(ckpt, _open(ckpt, quiet, verify=True, quiet=True))[0]


def check_layout(config: GPTConfig, tp: int, pp: int) -> None:
    """ConversionError unless the model splits tp x pp ways (heads, ffn, hidden by tp; layers over pp)."""
    try:
        config.check_parallel(tp, pp)
        if pp > 1:
            partition_layers(config.num_layers, pp)
    except ValueError as e:
        raise ConversionError(f"cannot lay this model out at tp {tp} x pp {pp}: {e}") from None


def save_weights_only(state: StateDict, config: GPTConfig, out_dir: str, tp: int = 1, pp: int = 1,
                      log: Callable[[str], None] = print) -> None:
    """Write full (tp = 1) weights as a weights-only gptpar checkpoint laid out for (tp, pp): DeepSpeed-named
    model-state files as a training checkpoint of that shape holds them (plain tensors only, so they load with
    `torch.load(weights_only=True)`, each carrying gptpar's mark), config.json (model, parallel) and a manifest of
    kind weights-only; no optimizer or per-rank state. `read_weights` reads it back; as `checkpoint.load` it starts a
    run at iteration 0. One durable write (gptpar.checkpoint.durable): `out_dir` must not exist or be empty."""
    from gptpar.model.gpt import GPTModel
    from gptpar.model.pipeline import padded_config
    from gptpar.model.sharding import split_tensor

    check_layout(config, tp, pp)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConversionError(f"{out_dir} exists and is not empty: choose a new folder (nothing is overwritten)")
    params = dict(GPTModel(padded_config(config, tp), device="meta").named_parameters())  # tags, target shapes
    missing = sorted(set(params) - set(state))
    if missing:
        raise ConversionError(f"the weights lack {missing[:5]}: not a gptpar GPT of this config")
    staged = StagedFolder(out_dir)
    try:
        tmp = staged.create()
        blocks = {name: split_tensor(state[name], param, tp) for name, param in params.items()}  # views
        records = {}
        for t in range(tp):  # clone: torch.save of a view would write the whole tensor it views
            records.update(_save_shard({name: b[t].clone() for name, b in blocks.items()}, tmp, t,
                                       config.num_layers, pp))
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump({"model": dataclasses.asdict(config),
                       "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                    "partition_method": "auto", "embedding_weight": 1}}, f, indent=1)
        staged.commit(WEIGHTS_ONLY, records, log=log, iteration=0, world_size=tp * pp)
    except BaseException:
        staged.abandon()
        raise


def _save_shard(shard: StateDict, ckpt: str, tp_rank: int, num_layers: int, pp: int) -> Dict[str, dict]:
    """One tp rank's GPTModel-named tensors, in the files `_read_shards` reads (embedding weight 1), each hashed
    as written and fsynced; their records."""
    if pp == 1:
        path = os.path.join(ckpt, model_states_file(tp_rank))
        return {os.path.basename(path): write_file({"module": shard, MARK: True}, path, checksums=True)}
    records = {}
    for index, prefix in gpt_layer_prefixes(num_layers).items():
        layer = {name[len(prefix):]: t for name, t in shard.items() if name.startswith(prefix)}
        path = os.path.join(ckpt, layer_file(index, tp_rank))
        records[os.path.basename(path)] = write_file(dict(layer, **{MARK: True}), path, checksums=True)
    return records


__all__ = ["StateDict", "resolve_checkpoint_dir", "is_hf_model_dir", "shards_needed", "read_checkpoint_weights",
           "check_weight_files", "read_weights", "read_weights_config", "run_config_of", "check_layout", "save_weights_only"]
