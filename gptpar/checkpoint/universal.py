"""Universal checkpoints: every parameter's full fp32 master weight and Adam moments, keyed by `GPTModel`'s
parameter names, so that a run saved at (tp, pp, dp) resumes at any other (tp', pp', dp').

On disk (docs/checkpoints.md has the full description, for writing a converter from another trainer):

    {dir}/gptpar_universal.json           written last: format, source shape, model config, counters,
                                          and per parameter its full shape and sharding tags
    {dir}/zero/{name}/fp32.pt             {"param": full fp32 tensor, "cat_dim": int, "vocab_tensor": bool}
    {dir}/zero/{name}/exp_avg.pt          the same for Adam's first moment
    {dir}/zero/{name}/exp_avg_sq.pt       and its second moment
    {dir}/zero/{name}/step.pt             Adam's step count, a 0-d tensor

The per-parameter folder and file names and the dict keys are DeepSpeed's universal-checkpoint layout
(deepspeed/checkpoint/ds_to_universal.py, constants PARAM / CAT_DIM / VOCAB_TENSOR); the names are
`GPTModel`'s, whatever pipeline layout saved them (DeepSpeed's pipeline names, `tied_modules.embed.*` and
`{layer index}.*`, change with pp and the partitioning, so they are mapped here). The vocabulary padding,
which depends on tp, is dropped: the word embedding and its moments hold the real `vocab_size` rows.
Every file holds only tensors and plain values: they load with `torch.load(..., weights_only=True)`.

A universal folder written by DeepSpeed's own `ds_to_universal.py` (no gptpar_universal.json: from a gptpar
checkpoint under DeepSpeed's names, or from a Megatron-DeepSpeed GPT/BLOOM run) is read too: its names are
mapped to GPTModel's (`deepspeed_parameter_names`), its model shape is the run's config (DeepSpeed keeps
Megatron's args only as a pickle, which gptpar does not unpickle), its word embedding's padding rows are
dropped, and it carries no counters.

`convert_deepspeed_checkpoint` streams a gptpar checkpoint (DeepSpeed's ZeRO-1 / BF16_Optimizer shards, whose
names `optimizer_files` gives per training.precision) into this form: one state of one full parameter in memory
at a time, copied piece by piece out of memory-mapped shard files, each mapped only while its piece is read. It
writes `{out}.tmp-PID` (the converting job recorded inside as OWNER) and renames it when whole; the metadata
records the exact source files it was given (their sizes, modification times and inodes), so that a copy is
never reused once its checkpoint was rewritten. DeepSpeed's own shard files are pickles (its checkpoint engine
writes optimizer objects into them) and are read with `weights_only=False`: convert only checkpoints you trust.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import re
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from gptpar.checkpoint.durable import StagedFolder
from gptpar.checkpoint.exceptions import CheckpointError, UniversalCheckpointError
from gptpar.checkpoint.layout import OWNER, UNIVERSAL_META as META, model_states_file
from gptpar.checkpoint.manifest import MARK, UNIVERSAL, Verifier, open_folder
from gptpar.checkpoint.weight_files import file_problems
from gptpar.checkpoint.writer import write_file
from gptpar.config import deepspeed_precision
from gptpar.model.config import GPTConfig

FORMAT = "gptpar-universal"
VERSION = 1
STATES = ("fp32", "exp_avg", "exp_avg_sq")  # the tensors kept per parameter (plus "step")
# DeepSpeed's keys inside each per-parameter file (deepspeed.checkpoint.constants PARAM, CAT_DIM, VOCAB_TENSOR).
PARAM, CAT_DIM, VOCAB_TENSOR = "param", "cat_dim", "vocab_tensor"


# ---------------------------------------------------------------------------------------------
# Names: DeepSpeed's pipeline-module parameter names -> GPTModel's
# ---------------------------------------------------------------------------------------------

def gpt_parameter_name(name: str, pipelined: bool, num_layers: int, embedding_weight: int = 1) -> str:
    """GPTModel's name of parameter `name` of a plain GPTModel (itself) or of a DeepSpeed PipelineModule stage
    (the mapping's one home is gptpar.model.pipeline.gpt_parameter_name, beside the layer specs)."""
    if not pipelined:
        return name
    from gptpar.model.pipeline import gpt_parameter_name as pipeline_name

    try:
        return pipeline_name(name, num_layers, embedding_weight)
    except ValueError as e:
        raise UniversalCheckpointError(str(e)) from None


def parameter_tags(config: GPTConfig) -> Dict[str, dict]:
    """{name: {"shape", "tensor_model_parallel", "partition_dim", "vocab_tensor"}} of the full model at tp = 1
    with the real vocabulary, read off a meta-device GPTModel's own tags (never off the names). Built once per
    model config in a process (a conversion asks several times); each call returns its own copy."""
    key = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    if key not in _TAGS:
        _TAGS[key] = _parameter_tags(config)
    return copy.deepcopy(_TAGS[key])


_TAGS: Dict[str, Dict[str, dict]] = {}  # parameter_tags' models, by their config


def _parameter_tags(config: GPTConfig) -> Dict[str, dict]:
    from gptpar.model.gpt import GPTModel
    from gptpar.tensor_parallel.layers import VocabParallelEmbedding

    model = GPTModel(config, device="meta")
    vocab = {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
    tags = {}
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if id(p) in vocab:
            shape[0] = config.vocab_size
        split = bool(getattr(p, "tensor_model_parallel", False))
        tags[name] = {"shape": shape, "tensor_model_parallel": split,
                      "partition_dim": p.partition_dim if split else None, "vocab_tensor": id(p) in vocab}
    return tags


def deepspeed_universal_info(config: GPTConfig) -> dict:
    """DeepSpeed's `universal_checkpoint_info` for this model (saved into every checkpoint by the engine), so
    that DeepSpeed's own `ds_to_universal.py` merges gptpar's tp slices right: the parameters replicated over
    tp, those split along dim 1 (row-parallel), the vocabulary ones and the real vocab size. Built from the
    parameters' tags; each pattern matches a parameter's name in a GPTModel and in a PipelineModule (DeepSpeed
    reads the info of the first model-parallel rank only, so it must cover every stage)."""
    kinds = {"tp_replicated_parameter_patterns": [], "parameter_with_row_parallelism_patterns": [],
             "vocabulary_parameter_patterns": []}  # deepspeed.checkpoint.constants' names for them
    for name, tag in parameter_tags(config).items():
        pattern = _either_name_pattern(name)
        if not tag["tensor_model_parallel"]:
            kinds["tp_replicated_parameter_patterns"].append(pattern)
        elif tag["partition_dim"] == 1:
            kinds["parameter_with_row_parallelism_patterns"].append(pattern)
        if tag["vocab_tensor"]:
            kinds["vocabulary_parameter_patterns"].append(pattern)
    info = {kind: sorted(set(patterns)) for kind, patterns in kinds.items()}
    info["original_vocab_size"] = config.vocab_size
    return info


def _either_name_pattern(name: str) -> str:
    """A regex matching GPTModel's `name` of a block's parameter in either model, whatever its layer index."""
    block, rest = name.split(".", 1)
    if block == "layers":
        return r"^(layers\.)?\d+\." + re.escape(rest.split(".", 1)[1]) + "$"
    prefix = {"embedding": r"(embedding|tied_modules\.embed)", "final_layernorm": r"(final_layernorm|\d+)"}[block]
    return f"^{prefix}\\." + re.escape(rest) + "$"


# ---------------------------------------------------------------------------------------------
# Reading one
# ---------------------------------------------------------------------------------------------

def is_universal(path: str) -> bool:
    """A universal checkpoint written by gptpar (its metadata file is there)."""
    return os.path.isfile(os.path.join(path, META))


def is_deepspeed_universal(path: str) -> bool:
    """A universal folder without gptpar's metadata: DeepSpeed's `zero/{name}/*.pt` files, as
    `ds_to_universal.py` writes them (from a gptpar or a Megatron-DeepSpeed checkpoint)."""
    return not is_universal(path) and os.path.isdir(os.path.join(path, "zero"))


def state_path(directory: str, name: str, key: str) -> str:
    return os.path.join(directory, "zero", name, f"{key}.pt")


def open_universal(directory: str, log: Callable[[str], None], verify: bool = True, quiet: bool = False,
                   checks: Optional[Callable[[str, dict], bool]] = None, defer: bool = False,
                   fix: Optional[str] = None) -> Verifier:
    """Start reading universal folder `directory` (gptpar.checkpoint.manifest.open_folder): gptpar's needs its
    manifest, of a universal copy, every file whole; one DeepSpeed wrote carries no checksums (said in one line)
    and its files are checked for being whole torch files when read_meta maps them."""
    fix = fix or rebuild_fix(directory)
    try:
        verifier = open_folder(directory, fix, log, verify, "asked not to verify", checks, defer, quiet)
    except UniversalCheckpointError:
        raise
    except Exception as e:  # CheckpointError of the manifest: the universal readers' own class
        raise UniversalCheckpointError(str(e)) from None
    if verifier.manifest is not None and verifier.manifest.kind != UNIVERSAL:
        raise UniversalCheckpointError(f"{directory} is a {verifier.manifest.kind} folder, not a universal checkpoint")
    return verifier


def rebuild_fix(directory: str) -> str:
    """How to replace a damaged or incomplete universal copy."""
    return (f"rebuild it: delete {directory} and resume again (the next start converts its checkpoint anew), or "
            f"convert it again with `python tools/convert_checkpoint.py --load CHECKPOINT --to universal --output "
            f"{directory}`")


def read_meta(verifier: Verifier, config: Optional[GPTConfig] = None) -> dict:
    """The universal checkpoint's metadata, read through `verifier` (open_universal's); UniversalCheckpointError if
    it is not one. A folder DeepSpeed wrote (`is_deepspeed_universal`) has none of gptpar's: its model shape is
    `config` (the run's), its names are mapped by `deepspeed_parameter_names`, and it carries no counters.
    meta["names"] maps each GPTModel name to its folder under zero/."""
    directory = verifier.folder
    if is_deepspeed_universal(directory):
        if config is None:
            raise UniversalCheckpointError(f"{directory} is a universal folder written by DeepSpeed, which records no "
                                           "model config gptpar reads: give the model's config (checkpoint.load "
                                           "and checkpoint.init_from use the run's)")
        return _deepspeed_meta(verifier, config)
    path = os.path.join(directory, META)
    try:
        meta = json.loads(verifier.read_text(path))
    except (OSError, ValueError) as e:
        raise UniversalCheckpointError(f"{path} is missing or unreadable ({e}): {directory} is not a complete "
                                       f"universal checkpoint; {verifier.fix}") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise UniversalCheckpointError(f"{path}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                                       f"this gptpar reads {FORMAT!r} version {VERSION}")
    meta["names"] = {name: name for name in meta["parameters"]}
    return meta


def read_state(verifier: Verifier, name: str, key: str, meta: dict) -> torch.Tensor:
    """One full tensor (`key` in STATES, or "step") of GPTModel parameter `name`, read through `verifier` with
    unpickling disabled and memory-mapped: a rank that takes its tp slice of it reads only that slice's pages (a
    rank that verifies the file reads it whole, once). The file is found under the folder's own name, checked
    against the model's shape, and a word embedding's rows past model.vocab_size (a foreign folder's padding) are
    left out."""
    path = state_path(verifier.folder, meta["names"][name], key)
    fix = f": the universal checkpoint {verifier.folder} is incomplete or damaged; {verifier.fix}"
    problem = file_problems([path])
    if problem:
        raise UniversalCheckpointError(f"{problem[0]}{fix}")
    try:
        value = verifier.torch_load(path, weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise UniversalCheckpointError(
            f"{path} holds objects other than tensors and plain values, which gptpar does not unpickle "
            f"(torch.load(weights_only=True) refused: {str(e).splitlines()[0]}): write it with tensors, numbers "
            "and strings only") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        if isinstance(e, UniversalCheckpointError):
            raise
        if isinstance(e, CheckpointError):  # the verifier's: unlisted, damaged, unreadable (it names the file)
            raise UniversalCheckpointError(str(e)) from None
        raise UniversalCheckpointError(f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]})"
                                       f"{fix}") from None
    if key == "step":
        return value
    if not isinstance(value, dict) or not torch.is_tensor(value.get(PARAM)):
        raise UniversalCheckpointError(f"{path} is not a dict with a tensor under {PARAM!r}, as DeepSpeed's "
                                       "universal checkpoint files are")
    return _fitted(value[PARAM], meta["parameters"][name], path)


def _fitted(tensor: torch.Tensor, tag: dict, path: str) -> torch.Tensor:
    """`tensor` checked against the model's shape `tag["shape"]`; a word embedding keeps at most the real
    vocabulary rows (fewer start at zero, as gptpar.model.sharding pads them)."""
    shape = list(tag["shape"])
    if tag["vocab_tensor"]:
        tensor = tensor[:shape[0]]
        shape[0] = tensor.shape[0]
    if list(tensor.shape) != shape:
        raise UniversalCheckpointError(f"{path} has shape {list(tensor.shape)}, the model {tag['shape']}: the "
                                       "folder holds a model of another shape (set the model fields to its shape)")
    return tensor


def read_weights(directory: str, config: Optional[GPTConfig] = None, log: Callable[[str], None] = print,
                 verify: bool = True) -> Tuple[Dict[str, torch.Tensor], GPTConfig]:
    """GPTModel-named full fp32 weights (real vocab rows) and the model config of a universal checkpoint
    (`config`: the model of a folder DeepSpeed wrote, which records none gptpar reads), every file verified as
    it is read."""
    verifier = open_universal(directory, log, verify)
    meta = read_meta(verifier, config)
    return ({name: read_state(verifier, name, "fp32", meta) for name in meta["parameters"]},
            GPTConfig(**meta["model"]))


# ---------------------------------------------------------------------------------------------
# Reading a universal folder written by DeepSpeed's ds_to_universal.py (gptpar's or Megatron-DeepSpeed's names)
# ---------------------------------------------------------------------------------------------

# Megatron-DeepSpeed's module names -> GPTModel's, applied in order to a name already in GPTModel's form of
# prefixes: its non-pipeline prefixes, the sub-modules of its transformer layer, its embedding LayerNorm
# (BLOOM's `word_embeddings.norm`) and its final LayerNorm (a bare LayerNorm, no `.norm`).
_MEGATRON_NAMES = ((r"^language_model\.embedding\.", "embedding."),
                   (r"^language_model\.encoder\.layers\.", "layers."),
                   (r"^language_model\.encoder\.final_layernorm\.", "final_layernorm."),
                   (r"^(layers\.\d+\.)(self_attention|mlp)\.", r"\1"),
                   (r"^embedding\.word_embeddings\.norm\.", "embedding.word_embeddings_layernorm."),
                   (r"^final_layernorm\.(weight|bias)$", r"final_layernorm.norm.\1"))


def deepspeed_parameter_names(names: Iterable[str], num_layers: int) -> Dict[str, str]:
    """{name in a DeepSpeed universal folder: GPTModel's name}, for the names of docs/checkpoints.md: GPTModel's
    own (gptpar at pp = 1), a PipelineModule's `tied_modules.embed.*` and `{layer index}.*` (gptpar at pp > 1,
    Megatron-DeepSpeed's GPTModelPipe) and Megatron-DeepSpeed's non-pipeline `language_model.*`. The pipeline
    indices depend on the layer specs (embedding weight, Megatron's lambdas), so they are taken in order: the
    first `num_layers` are the transformer layers, the last the final LayerNorm; renumbered to gptpar's specs,
    gptpar.model.pipeline.gpt_parameter_name names them. Unknown names come back as they are (no model has them)."""
    names = list(names)
    indices = sorted({int(n.split(".", 1)[0]) for n in names if n.split(".", 1)[0].isdigit()})
    if indices and len(indices) != num_layers + 1:
        raise UniversalCheckpointError(
            f"the folder's pipeline layers {indices} are not {num_layers} transformer layers and a final LayerNorm "
            f"(model.num_layers = {num_layers}): set model.num_layers to the checkpoint's")
    spec_index = {index: 1 + k for k, index in enumerate(indices)}  # embedding weight 1: layers 1.., final 1 + L
    mapped = {}
    for name in names:
        head, _, rest = name.partition(".")
        gpt = name
        if head == "tied_modules" or head.isdigit():
            pipeline_name = f"{spec_index[int(head)]}.{rest}" if head.isdigit() else name
            gpt = gpt_parameter_name(pipeline_name, True, num_layers)
        for pattern, replacement in _MEGATRON_NAMES:
            gpt = re.sub(pattern, replacement, gpt)
        mapped[name] = gpt
    return mapped


def _deepspeed_meta(verifier: Verifier, config: GPTConfig) -> dict:
    """read_meta of a folder DeepSpeed wrote: every parameter folder under zero/ mapped to a GPTModel name of
    `config`'s model (any other is an error naming it), every parameter of the model present once."""
    directory = verifier.folder
    zero = os.path.join(directory, "zero")
    folders = sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))
    tags = parameter_tags(config)
    names = {}
    for folder, name in deepspeed_parameter_names(folders, config.num_layers).items():
        if name not in tags:
            raise UniversalCheckpointError(
                f"{directory}: zero/{folder} (read as {name!r}) is no parameter of the model the config describes: "
                "gptpar reads GPTModel's, DeepSpeed's pipeline and Megatron-DeepSpeed's GPT/BLOOM names "
                "(docs/checkpoints.md); check the model fields (embed_layernorm, position_embedding_type)")
        if name in names:
            raise UniversalCheckpointError(f"{directory}: zero/{names[name]} and zero/{folder} are both {name!r}")
        names[name] = folder
    missing = sorted(set(tags) - set(names))
    if missing:
        raise UniversalCheckpointError(f"{directory} has no zero/ folder for the model's {missing[:5]}: check the "
                                       "model fields (embed_layernorm, position_embedding_type, num_layers)")
    meta = {"format": "deepspeed-universal", "model": dataclasses.asdict(config), "parameters": tags,
            "names": names, "counters": {}, "source": {"path": os.path.abspath(directory)}}
    problems = file_problems(state_path(directory, folder, key) for folder in names.values()
                             for key in STATES + ("step",))
    if problems:
        raise UniversalCheckpointError(f"universal checkpoint {directory} is damaged: " + "; ".join(problems[:5])
                                       + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
                                       + ": convert it again from its checkpoint, or load another one")
    for name in tags:  # every shape checked now, before anything is built (the files are mapped, not read)
        read_state(verifier, name, "fp32", meta)
    return meta


# ---------------------------------------------------------------------------------------------
# Writing one from a gptpar (DeepSpeed) checkpoint
# ---------------------------------------------------------------------------------------------

# Which optimizer files DeepSpeed writes at ZeRO-1 for each training.precision: (the file names' prefix,
# whether they hold fp16's dynamic loss scaler). A checkpoint loads straight into a run of another precision only
# when both write the same kind (gptpar.checkpoint.checkpointer.plan_load): bf16's BF16_Optimizer files are another
# layout, and fp32's hold a static loss scale of 1 that DeepSpeed would put in place of fp16's dynamic one. fp8
# keeps bf16's optimizer (gptpar.config.deepspeed_precision maps it), so fp8 <-> bf16 is no change.
OPTIMIZER_FILES = {"fp32": ("", False), "fp16": ("", True), "bf16": ("bf16_", False)}
CONVERTED_KINDS = (OPTIMIZER_FILES["fp32"], OPTIMIZER_FILES["bf16"])  # what the converter reads


def optimizer_files(precision: str) -> Tuple[str, bool]:
    """The kind of optimizer files a run of `precision` writes at ZeRO-1 (see OPTIMIZER_FILES); fp8 is bf16 to
    DeepSpeed (gptpar.config.deepspeed_precision) and writes bf16's files."""
    return OPTIMIZER_FILES[deepspeed_precision(precision)]


def optimizer_states_file(precision: str, dp_rank: int, mp_rank: int) -> str:
    """DeepSpeed's ZeRO-1 optimizer partition of data-parallel rank `dp_rank`, model-parallel rank `mp_rank`."""
    return f"{optimizer_files(precision)[0]}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def _deepspeed_file(verifier: Verifier, path: str) -> dict:
    """A DeepSpeed checkpoint file, memory-mapped: its tensors stay on disk until read, and the mapping goes
    with the last tensor that uses it; verified against the manifest the first time it is opened (read whole
    once; its later mappings read from the page cache). A pickle: see above."""
    if not os.path.isfile(path):
        raise UniversalCheckpointError(f"missing checkpoint file {path}: the checkpoint is incomplete; {verifier.fix}")
    try:
        return verifier.torch_load(path, weights_only=False, mmap=True)
    except UniversalCheckpointError:
        raise
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as e:
        if type(e).__name__ == "CheckpointError":  # the verifier's: a file that does not match its sha256
            raise UniversalCheckpointError(str(e)) from None
        raise UniversalCheckpointError(f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}): "
                                       f"{verifier.fix}") from None


@dataclasses.dataclass(frozen=True)
class Source:
    """What the converter needs to know of a gptpar checkpoint folder, read from its config.json and file names
    (`read_source`): its run config and model, (tp, pp, dp), precision and pipeline embedding weight."""

    path: str
    run_config: dict
    tp: int
    pp: int
    dp: int
    precision: str
    embedding_weight: int

    @property
    def model(self) -> GPTConfig:
        return GPTConfig(**self.run_config["model"])


def read_source(ckpt: str, verifier: Optional[Verifier] = None) -> Source:
    """The checkpoint `ckpt` as the converter reads it, or UniversalCheckpointError saying why it cannot be
    converted and what to do instead; reads config.json only (through `verifier` when given) and lists the
    folder. dp is the recorded one; checkpoints of runs that left parallel.data_parallel_size at null (before it
    was recorded resolved) give it through their optimizer files' names."""
    path = os.path.join(ckpt, "config.json")
    try:
        if verifier is not None:
            run_config = json.loads(verifier.read_text(path))
        else:
            with open(path) as f:
                run_config = json.load(f)
        GPTConfig(**run_config["model"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UniversalCheckpointError(f"{path} is missing or unreadable ({type(e).__name__}: {e}): {ckpt} is not "
                                       "a complete gptpar checkpoint") from None
    parallel, training = run_config.get("parallel", {}), run_config.get("training", {})
    tp = parallel.get("tensor_model_parallel_size", 1)
    pp = parallel.get("pipeline_model_parallel_size", 1)
    precision, zero_stage = training.get("precision", "fp32"), training.get("zero_stage", 1)
    if zero_stage != 1:
        raise UniversalCheckpointError(
            f"{ckpt} was saved with training.zero_stage={zero_stage}: its optimizer state is DeepSpeed's per-(tp, "
            "pp) copy, not ZeRO-1 partitions, and gptpar does not convert it to the universal form. Resume it at "
            f"its (tp, pp) = ({tp}, {pp}) with training.zero_stage=0 (any dp: every dp rank holds the whole "
            "state), or start from its weights at the new shape with checkpoint.init_from (a fresh optimizer)")
    if optimizer_files(precision) not in CONVERTED_KINDS:
        raise UniversalCheckpointError(
            f"{ckpt} was saved with training.precision={precision}, whose optimizer files (with the dynamic loss "
            "scaler) the universal converter does not read: resume it at the shape and precision it was saved "
            "with, or start from its weights with checkpoint.init_from")
    dp = parallel.get("data_parallel_size") or _dp_of_files(ckpt, precision)
    return Source(ckpt, run_config, tp, pp, dp, precision, parallel.get("embedding_weight") or 1)


def _dp_of_files(ckpt: str, precision: str) -> int:
    """The data-parallel size of a checkpoint, counted from its first model-parallel rank's optimizer files."""
    pattern = re.compile("^" + re.escape(optimizer_states_file(precision, 0, 0)).replace("_0_", r"_(\d+)_", 1) + "$")
    ranks = sorted(int(m.group(1)) for m in map(pattern.match, os.listdir(ckpt)) if m)
    if not ranks:
        raise UniversalCheckpointError(f"{ckpt} records no data_parallel_size and holds no optimizer file "
                                       f"{optimizer_states_file(precision, 0, 0)}: not a ZeRO-1 checkpoint of "
                                       f"training.precision={precision}")
    return ranks[-1] + 1  # a missing rank in between is named when its file is opened


class _StageShards:
    """The optimizer shards of one pipeline stage: per tp rank, the parameter shapes of its model-states file
    and the paths of its dp ranks' ZeRO partitions, from which `tp_slice` copies one parameter's state out."""

    def __init__(self, source: Source, stage: int, verifier: Verifier):
        ckpt, tp, dp = source.path, source.tp, source.dp
        self.verifier, self.stage = verifier, stage
        self.shapes, self.files = [], []
        for t in range(tp):
            mp_rank = stage * tp + t  # DeepSpeed's model-parallel rank: tp fastest within a stage
            self.shapes.append(_deepspeed_file(verifier, os.path.join(ckpt, model_states_file(mp_rank)))
                               ["param_shapes"])
            self.files.append([os.path.join(ckpt, optimizer_states_file(source.precision, d, mp_rank))
                               for d in range(dp)])
        steps = {float(state["step"]) for paths in self.files for path in paths
                 for state in _deepspeed_file(verifier, path)["optimizer_state_dict"]["base_optimizer_state"]
                 ["state"].values()}
        if len(steps) != 1:
            raise UniversalCheckpointError(f"{ckpt}: the optimizer shards of stage {stage} disagree on (or lack) "
                                           f"Adam's step count: {sorted(steps)}")
        self.step = steps.pop()

    def tp_slice(self, t: int, group: int, name: str, key: str) -> torch.Tensor:
        """Tp rank t's slice of parameter `name`'s state `key` (STATES): its pieces of the dp ranks' flat
        partitions, in order (ZeRO cuts the group's flat buffer into contiguous dp partitions), copied straight
        out of each mapped file, which is unmapped before the next is opened."""
        shape = self.shapes[t][group][name]
        out = torch.empty(shape.numel(), dtype=torch.float32)
        filled = 0
        for path in self.files[t]:
            sd = _deepspeed_file(self.verifier, path)["optimizer_state_dict"]
            where = sd["param_slice_mappings"][group].get(name)
            if where is not None and filled + where.numel <= out.numel():
                flat = (sd["single_partition_of_fp32_groups"][group] if key == "fp32"
                        else sd["base_optimizer_state"]["state"][group][key])
                out.narrow(0, filled, where.numel).copy_(flat.narrow(0, where.start, where.numel))
            filled += where.numel if where is not None else 0
            del sd
        if filled != out.numel():
            raise UniversalCheckpointError(f"{name} ({key}): the ZeRO shards hold {filled} of its {out.numel()} "
                                           "elements: the checkpoint's optimizer files do not fit together")
        return out.view(shape)


def convert_deepspeed_checkpoint(ckpt: str, out_dir: str, log: Callable[[str], None] = print,
                                 counters: Optional[dict] = None, source_files: Optional[dict] = None,
                                 owner: Optional[dict] = None, verify: bool = True, replace: bool = False,
                                 fix: str = "resume from or convert an earlier checkpoint") -> dict:
    """Write the universal form of gptpar checkpoint folder `ckpt` (any tp x pp x dp, ZeRO-1 in fp32 or bf16)
    to `out_dir` (one that exists is swapped out only with `replace`: a stale copy), in this process. Returns its
    metadata. The steps are those a conversion over several ranks takes (`stage_parameters`, `conversion_plan`,
    `split_shares`, `convert_share` on each rank, `finish_conversion`), with one share.

    Every file read from `ckpt` is checked against its manifest before it is parsed (`verify`; `fix` ends the message
    of a damaged one). The copy is one durable write (gptpar.checkpoint.durable): `{out_dir}.tmp-PID`, every file
    hashed as written and fsynced, the metadata, the manifest last, the folder fsynced and renamed, the parent
    fsynced. `counters`: the run's counters and client state to carry. `source_files`: what identifies the exact
    files converted (layout.fingerprint), kept in the metadata so that a copy is never reused once its checkpoint
    was rewritten. `owner`: the job converting (pid, host, start time), written first into the temporary folder,
    so that the next start can tell a killed conversion's leftover from a live one's."""
    source_verifier = open_folder(ckpt, fix, log, verify, "asked not to verify", quiet=True)
    source = read_source(ckpt, source_verifier)
    if os.path.exists(out_dir) and not replace:
        raise UniversalCheckpointError(f"{out_dir} exists: choose a new output folder (nothing is overwritten)")
    staged = start_conversion(out_dir, owner)
    try:
        plan = conversion_plan(source, {stage: stage_parameters(source, source_verifier, stage)
                                        for stage in range(source.pp)})
        records, steps = convert_share(source, source_verifier, staged.tmp, plan)
        meta = finish_conversion(staged, source, plan, records, steps, counters, source_files, owner, log, replace)
    except BaseException:
        staged.abandon()
        raise
    return meta


def start_conversion(out_dir: str, owner: Optional[dict] = None, token: Optional[str] = None) -> StagedFolder:
    """The staged folder of a conversion into `out_dir`, created, with `owner` (the job) recorded in it first."""
    staged = StagedFolder(out_dir, token)
    tmp = staged.create()
    if owner is not None:
        with open(os.path.join(tmp, OWNER), "w") as f:
            json.dump(owner, f)
    return staged


def stage_parameters(source: Source, verifier: Verifier, stage: int) -> List[Tuple[int, str]]:
    """(parameter group, DeepSpeed name) of every parameter of pipeline stage `stage`, in its flat buffers' order,
    from tp rank 0's model-states file of the stage (read through `verifier`, which checks it whole)."""
    path = os.path.join(source.path, model_states_file(stage * source.tp))
    return [(group, ds_name) for group, shapes in enumerate(_deepspeed_file(verifier, path)["param_shapes"])
            for ds_name in shapes]


def conversion_plan(source: Source, stages: Dict[int, List[Tuple[int, str]]]) -> List[Tuple[int, int, str, str]]:
    """Every parameter of `source` once, in the order the copy is written: (pipeline stage, parameter group,
    DeepSpeed name, GPTModel name), from each stage's `stage_parameters`, the stages in order; the last stage's tied
    copy of the word embedding is left out. Raises UniversalCheckpointError for a parameter the model lacks or one it
    has that no stage holds."""
    config, pp = source.model, source.pp
    tags = parameter_tags(config)
    plan, seen = [], set()
    for stage in range(pp):
        for group, ds_name in stages[stage]:
            name = gpt_parameter_name(ds_name, pp > 1, config.num_layers, source.embedding_weight)
            if name in seen:  # the last stage's tied copy of the word embedding
                continue
            if name not in tags:
                raise UniversalCheckpointError(f"{source.path}: parameter {ds_name} ({name}) is not in the model "
                                               "its config.json describes")
            seen.add(name)
            plan.append((stage, group, ds_name, name))
    missing = sorted(set(tags) - seen)
    if missing:
        raise UniversalCheckpointError(f"{source.path}: no optimizer state for {missing[:5]}: incomplete checkpoint")
    return plan


def stage_ranks(pp: int, ranks: int) -> List[List[int]]:
    """The ranks that convert each pipeline stage, contiguous: with no more ranks than stages one rank per stage
    (about pp/ranks stages each), else about ranks/pp ranks per stage. The first of a stage's ranks reads its
    parameter list (`stage_parameters`); a rank verifies the shards of its stages only."""
    if ranks <= pp:
        return [[stage * ranks // pp] for stage in range(pp)]
    return [list(range(stage * ranks // pp, (stage + 1) * ranks // pp)) for stage in range(pp)]


def split_shares(plan: Sequence[tuple], sizes: Dict[str, int], ranks: int, pp: int) -> List[List[tuple]]:
    """`plan` cut into `ranks` contiguous shares following `stage_ranks`: a stage's parameters go to its ranks, split
    among them by elements (`sizes`: GPTModel name -> elements; each to the rank its middle element falls in)."""
    shares = [[] for _ in range(ranks)]
    owners = stage_ranks(pp, ranks)
    for stage in range(pp):
        items = [item for item in plan if item[0] == stage]
        total, done, mine = sum(sizes[item[3]] for item in items), 0, owners[stage]
        for item in items:
            part = int((done + sizes[item[3]] / 2) * len(mine) / total) if total else 0
            shares[mine[min(len(mine) - 1, part)]].append(item)
            done += sizes[item[3]]
    return shares


def convert_share(source: Source, verifier: Verifier, tmp: str, items: Sequence[tuple],
                  cancel: Optional[Callable[[], bool]] = None) -> Tuple[Dict[str, dict], Dict[int, float]]:
    """Write `items` (of `conversion_plan`) into the staged folder `tmp`: each parameter's states put together
    from its tp slices, one stage's shards open at a time. Returns (the files' records, {stage: Adam's step}).
    `cancel()` true (another rank's share failed) stops it between two parameters with ConversionCancelled."""
    tags = parameter_tags(source.model)
    records, steps, shards = {}, {}, None
    for stage, group, ds_name, name in items:
        if cancel is not None and cancel():
            raise ConversionCancelled("cancelled: another rank's share of the conversion failed")
        if shards is None or shards.stage != stage:
            shards = None  # the last stage's mapped files go before the next stage's are opened
            shards = _StageShards(source, stage, verifier)
        steps[stage] = shards.step
        records.update(_write_parameter(tmp, name, tags[name], source.tp, shards.step,
                                        read=lambda t, key: shards.tp_slice(t, group, ds_name, key)))
    return records, steps


class ConversionCancelled(UniversalCheckpointError):
    """A rank's share stopped because another rank's failed."""


def finish_conversion(staged: StagedFolder, source: Source, plan: Sequence[tuple], records: Dict[str, dict],
                      steps: Dict[int, float], counters: Optional[dict], source_files: Optional[dict],
                      owner: Optional[dict], log: Callable[[str], None], replace: bool) -> dict:
    """Once every share is written into `staged` (their `records` and `steps` put together): the metadata, then
    the manifest last and the rename (StagedFolder.commit). Returns the metadata."""
    ckpt, tp, pp = source.path, source.tp, source.pp
    step = steps[max(steps)]  # the last stage's (every stage's agree: _StageShards checks its own)
    parallel = source.run_config.get("parallel", {})
    meta = {"format": FORMAT, "version": VERSION, "model": source.run_config["model"],
            "parameters": parameter_tags(source.model),
            "source": {"path": os.path.abspath(ckpt), "tensor_model_parallel_size": tp,
                       "pipeline_model_parallel_size": pp, "data_parallel_size": source.dp,
                       "partition_method": parallel.get("partition_method"), "embedding_weight": source.embedding_weight,
                       "precision": source.precision, "zero_stage": 1, "files": source_files},
            "step": step, "counters": counters or {}, "config": source.run_config}
    with open(os.path.join(staged.tmp, META), "w") as f:
        json.dump(meta, f, indent=1)
    if owner is not None:
        os.remove(os.path.join(staged.tmp, OWNER))
    staged.commit(UNIVERSAL, records, log=log, replace=replace)
    log(f"wrote universal checkpoint {staged.target}: {len(plan)} parameters, Adam step {step:g}")
    return meta


def _write_parameter(out: str, name: str, tag: dict, tp: int, step: float, read) -> Dict[str, dict]:
    """Write each state of one parameter, put together from its tp slices (`read(tp_rank, key)`) along its
    partition dim without the vocab padding rows: one full state and one slice are in memory at a time. Each
    file is hashed as written and fsynced; returns their records (relative to `out`)."""
    folder = os.path.join(out, "zero", name)
    os.makedirs(folder, exist_ok=True)
    records = {}
    for key in STATES:
        full = _full_tensor(name, tag, tp, lambda t: read(t, key))
        path = os.path.join(folder, f"{key}.pt")
        records[os.path.relpath(path, out)] = write_file(
            {PARAM: full, CAT_DIM: tag["partition_dim"] or 0, VOCAB_TENSOR: tag["vocab_tensor"], MARK: True}, path,
            checksums=True)
        del full
    path = os.path.join(folder, "step.pt")
    records[os.path.relpath(path, out)] = write_file(torch.tensor(step, dtype=torch.float32), path, checksums=True)
    return records


def _full_tensor(name: str, tag: dict, tp: int, read) -> torch.Tensor:
    """The full tensor of shape tag["shape"] from tp slices `read(t)`: a replicated parameter is slice 0; a
    split one is filled slice by slice, rows past the real vocabulary (tp-dependent padding) left out."""
    shape = torch.Size(tag["shape"])
    if not tag["tensor_model_parallel"]:
        full = read(0)
        if full.shape != shape:
            raise UniversalCheckpointError(f"{name}: the checkpoint holds shape {list(full.shape)}, the model "
                                           f"{list(shape)}")
        return full
    dim = tag["partition_dim"]
    full, offset = torch.empty(shape, dtype=torch.float32), 0
    for t in range(tp):
        piece = read(t)
        rows = max(0, min(piece.shape[dim], shape[dim] - offset))
        if list(piece.shape[:dim]) + list(piece.shape[dim + 1:]) != list(shape[:dim]) + list(shape[dim + 1:]):
            raise UniversalCheckpointError(f"{name}: tp slice {t} has shape {list(piece.shape)}, which does not "
                                           f"fit the model's {list(shape)}")
        if rows:  # (a slice holding only padding rows has nothing to give)
            full.narrow(dim, offset, rows).copy_(piece.narrow(dim, 0, rows))
        offset += piece.shape[dim]
    if offset < shape[dim] or (offset != shape[dim] and not tag["vocab_tensor"]):
        raise UniversalCheckpointError(f"{name}: its {tp} tp slices hold {offset} along dim {dim}, the model "
                                       f"{shape[dim]}")
    return full


__all__ = ["META", "OWNER", "STATES", "UniversalCheckpointError", "gpt_parameter_name", "OPTIMIZER_FILES",
           "optimizer_files", "optimizer_states_file", "Source", "read_source", "open_universal", "rebuild_fix",
           "parameter_tags", "deepspeed_universal_info", "is_universal", "is_deepspeed_universal", "state_path",
           "read_meta", "read_state", "read_weights", "deepspeed_parameter_names", "convert_deepspeed_checkpoint",
           "start_conversion", "stage_parameters", "conversion_plan", "stage_ranks", "split_shares", "convert_share",
           "ConversionCancelled",
           "finish_conversion"]
