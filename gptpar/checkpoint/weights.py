"""Checkpoint conversion: a gptpar training checkpoint of any tp x pp -> one full (tp = 1) state dict,
and from there to a Hugging Face GPT-2 or BLOOM (gptpar.model.hf.hf_architecture) or to any other tp.

The full form is `GPTModel`'s state dict at tp = 1 with the word embedding trimmed to the real
vocabulary: padding rows depend on tp (Megatron pads the vocab to a multiple of 128 x tp), so they are
dropped here and re-added by `gptpar.model.sharding.load_full_state_dict` for the target tp. (Universal
checkpoints, with the optimizer state, are gptpar.checkpoint.universal's.)

Which files DeepSpeed writes (one checkpoint directory, e.g. {save}/iter_0000300):
  pp = 1   mp_rank_{tp:02d}_model_states.pt                 key 'module': GPTModel's state dict
  pp > 1   layer_{idx:02d}-model_{tp:02d}-model_states.pt   one pipeline layer's state dict
           with the spec indices of gptpar.model.pipeline.layer_specs (`gpt_layer_prefixes`: embedding 0,
           transformer layer i at w + i, final LayerNorm at w + L; w = embedding weight).
Shards are merged and split by the parameters' own tags (`tensor_model_parallel`, `partition_dim`) read off a
`meta`-device model, never by name patterns.

A weights-only checkpoint (`save_weights_only`, tools/convert_checkpoint.py --to gptpar) holds the same model-state
files for its (tp, pp), written with plain tensors only, beside config.json and a manifest marked weights-only.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
from typing import Dict, List, Optional, Tuple

import torch

from gptpar.checkpoint import universal
from gptpar.model.config import GPTConfig
from gptpar.model.partition import partition_layers
from gptpar.model.pipeline import gpt_layer_prefixes
from gptpar.checkpoint.weight_files import HF_WEIGHT_FILES, file_problems, hf_weight_files, load_torch_file

StateDict = Dict[str, torch.Tensor]


class ConversionError(RuntimeError):
    """A checkpoint that cannot be read as a gptpar GPT; the message names the file and the problem."""


def resolve_checkpoint_dir(path: str, tag: Optional[str] = None) -> str:
    """`path` may be a checkpoint directory itself or a save directory holding `latest`."""
    if not os.path.exists(path):
        raise ConversionError(f"{path} does not exist: give a gptpar checkpoint directory (e.g. "
                              "checkpoints/run/iter_0000100), its save directory, a universal checkpoint or a local "
                              "Hugging Face model directory")
    if not os.path.isdir(path):
        raise ConversionError(f"{path} is a file, not a checkpoint directory: give the folder that holds it")
    if tag:
        path = os.path.join(path, tag)
    elif os.path.isfile(os.path.join(path, "latest")):
        with open(os.path.join(path, "latest")) as f:
            path = os.path.join(path, f.read().strip())
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConversionError(f"{path} holds no config.json: pass a gptpar checkpoint directory "
                              f"(e.g. checkpoints/run/iter_0000100) or the save directory with its `latest` file")
    return path


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConversionError(f"missing checkpoint file {path}: the checkpoint is incomplete")
    return load_torch_file(path, ConversionError, ": the checkpoint is damaged (use an earlier one)",
                           weights_only=False)


def model_states_file(tp_rank: int) -> str:
    """DeepSpeed's model-states file of tp rank `tp_rank` at pp = 1 (key 'module': GPTModel's state dict)."""
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def layer_file(index: int, tp_rank: int) -> str:
    """DeepSpeed's file of pipeline layer spec `index` (gptpar.model.pipeline.gpt_layer_prefixes) of tp rank
    `tp_rank` at pp > 1: that layer's state dict."""
    return f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt"


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


def _read_shards(files: List[List[Tuple[str, str]]], pipelined: bool):
    """For each tp rank, GPTModel-named tensors of that rank (all pipeline stages put together)."""
    shards = []
    for rank_files in files:
        sd = {}
        for path, prefix in rank_files:
            state = _load(path)
            for key, value in (state if pipelined else state["module"]).items():
                sd[prefix + key] = value
        shards.append(sd)
    return shards


def _run_config(ckpt: str) -> Tuple[dict, GPTConfig]:
    path = os.path.join(ckpt, "config.json")
    try:
        with open(path) as f:
            run_config = json.load(f)
        return run_config, GPTConfig(**run_config["model"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"{path} is unreadable ({type(e).__name__}: {e}): not a whole gptpar "
                              "checkpoint") from None


def read_checkpoint_weights(path: str, tag: Optional[str] = None) -> Tuple[StateDict, GPTConfig, dict]:
    """Read a gptpar checkpoint (any tp x pp) into one tp = 1 state dict with the real vocab rows.

    Returns (state dict, model config, the run's full config dict)."""
    from gptpar.model.gpt import GPTModel

    ckpt = resolve_checkpoint_dir(path, tag)
    run_config, config = _run_config(ckpt)
    parallel = run_config.get("parallel", {})
    tp = parallel.get("tensor_model_parallel_size", 1)
    if not glob.glob(os.path.join(ckpt, "*model_states.pt")):
        raise ConversionError(f"{ckpt} holds no DeepSpeed model states (*model_states.pt)")
    shards = _read_shards(_shard_files(ckpt, config, parallel), parallel.get("pipeline_model_parallel_size", 1) > 1)

    reference = GPTModel(config, device="meta")  # carries the sharding tags
    full: StateDict = {}
    for name, param in reference.named_parameters():
        missing = [t for t, sd in enumerate(shards) if name not in sd]
        if missing:
            raise ConversionError(f"{ckpt}: tensor {name} missing on tp rank(s) {missing}")
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            full[name] = torch.cat([sd[name].float() for sd in shards], dim=param.partition_dim)
        else:
            full[name] = shards[0][name].float()
    emb = "embedding.word_embeddings.weight"
    full[emb] = full[emb][:config.vocab_size].clone()
    return full, config, run_config


def is_hf_model_dir(path: str) -> bool:
    """A local Hugging Face model directory: its config.json names a `model_type` (gptpar's names `model`)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    try:
        with open(config) as f:
            return "model_type" in json.load(f)
    except (OSError, ValueError, TypeError) as e:
        raise ConversionError(f"{config} is unreadable ({type(e).__name__}: {e})") from None


def check_weight_files(path: str, tag: Optional[str] = None, config: Optional[GPTConfig] = None,
                       states: Tuple[str, ...] = ("fp32",)) -> None:
    """ConversionError naming every file `read_weights(path, tag, config)` would read that is missing, empty,
    truncated or unreadable, before anything is read or built (for a universal checkpoint, its `states`;
    read_weights reads fp32, a resume every state)."""
    if not os.path.exists(path):
        resolve_checkpoint_dir(path)  # its "does not exist" message
    if os.path.isdir(path) and (universal.is_universal(path) or universal.is_deepspeed_universal(path)):
        try:
            universal.check_files(path, universal.read_meta(path, config), states)
        except universal.UniversalCheckpointError as e:
            raise ConversionError(str(e)) from None
        return
    if os.path.isdir(path) and is_hf_model_dir(path):
        files = hf_weight_files(path)
        if not files:
            raise ConversionError(f"{path} holds a Hugging Face config.json but no weights "
                                  f"({' or '.join(HF_WEIGHT_FILES)}, or a sharded index): an export that did not "
                                  "finish? Export or download the model again")
    else:
        ckpt = resolve_checkpoint_dir(path, tag)
        run_config, model = _run_config(ckpt)
        files = [file for rank_files in _shard_files(ckpt, model, run_config.get("parallel", {}))
                 for file, _ in rank_files]
    problems = file_problems(files)
    if problems:
        raise ConversionError("unreadable weights: " + "; ".join(problems[:5])
                              + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
                              + ": use another checkpoint, or copy, convert or export this one again")


def read_weights(path: str, tag: Optional[str] = None,
                 config: Optional[GPTConfig] = None) -> Tuple[StateDict, GPTConfig]:
    """Full (tp = 1) weights with the real vocab rows, and the model config, from whatever `path` holds:
    a gptpar checkpoint (any tp x pp; a checkpoint directory or the save directory holding `latest`), a
    universal checkpoint (its fp32 master weights, read with unpickling disabled; one written by DeepSpeed's
    ds_to_universal.py records no model gptpar reads, so it needs `config`) or a local Hugging Face model
    directory. The one reader for every tool that starts from existing weights."""
    if os.path.isdir(path) and (universal.is_universal(path) or universal.is_deepspeed_universal(path)):
        try:
            return universal.read_weights(path, config)
        except universal.UniversalCheckpointError as e:
            raise ConversionError(str(e)) from None
    if os.path.isdir(path) and is_hf_model_dir(path):
        return load_hf(path)
    state, config, _ = read_checkpoint_weights(path, tag)
    return state, config


def read_weights_config(path: str, tag: Optional[str] = None, config: Optional[GPTConfig] = None) -> GPTConfig:
    """The model config of what `read_weights(path, tag, config)` returns, read without the tensors where the
    source keeps it apart (a Hugging Face or a gptpar checkpoint's config.json), so that shapes are checked
    before any weight is read; a universal folder is its metadata's model (gptpar's) or `config` once its names
    and shapes are checked against it (DeepSpeed's); any other source through `read_weights` itself."""
    if os.path.isdir(path) and (universal.is_universal(path) or universal.is_deepspeed_universal(path)):
        try:
            return GPTConfig(**universal.read_meta(path, config)["model"])
        except universal.UniversalCheckpointError as e:
            raise ConversionError(str(e)) from None
    if os.path.isdir(path) and is_hf_model_dir(path):
        return _hf_config(path)
    return _run_config(resolve_checkpoint_dir(path, tag))[1]


def _hf_config(model_dir: str) -> GPTConfig:
    """The GPTConfig of a Hugging Face directory's config.json; ConversionError for one gptpar does not read."""
    import transformers

    from gptpar.model.hf import config_from_hf

    try:
        return config_from_hf(transformers.AutoConfig.from_pretrained(model_dir))
    except (ValueError, KeyError, OSError) as e:  # an unknown or unsupported model_type, a broken config.json
        raise ConversionError(f"{model_dir}: {str(e).splitlines()[0]}") from None


def check_layout(config: GPTConfig, tp: int, pp: int) -> None:
    """ConversionError unless the model splits tp x pp ways (heads, ffn, hidden by tp; layers over pp)."""
    try:
        config.check_parallel(tp, pp)
        if pp > 1:
            partition_layers(config.num_layers, pp)
    except ValueError as e:
        raise ConversionError(f"cannot lay this model out at tp {tp} x pp {pp}: {e}") from None


def save_weights_only(state: StateDict, config: GPTConfig, out_dir: str, tp: int = 1, pp: int = 1) -> None:
    """Write full (tp = 1) weights as a weights-only gptpar checkpoint laid out for (tp, pp): DeepSpeed-named
    model-state files as a training checkpoint of that shape holds them (plain tensors only, so they load with
    `torch.load(weights_only=True)`), config.json (model, parallel) and a manifest marked weights-only; no
    optimizer or per-rank state. `read_weights` reads it back; as `checkpoint.load` it starts a run at
    iteration 0. Written under a temporary name and renamed at the end: `out_dir` must not exist or be empty."""
    from gptpar.model.gpt import GPTModel
    from gptpar.model.pipeline import padded_config
    from gptpar.model.sharding import split_tensor
    from gptpar.checkpoint.layout import write_manifest

    check_layout(config, tp, pp)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConversionError(f"{out_dir} exists and is not empty: choose a new folder (nothing is overwritten)")
    params = dict(GPTModel(padded_config(config, tp), device="meta").named_parameters())  # tags, target shapes
    missing = sorted(set(params) - set(state))
    if missing:
        raise ConversionError(f"the weights lack {missing[:5]}: not a gptpar GPT of this config")
    tmp = f"{os.path.normpath(out_dir)}.tmp-{os.getpid()}"
    os.makedirs(tmp)
    try:
        blocks = {name: split_tensor(state[name], param, tp) for name, param in params.items()}  # views
        for t in range(tp):  # clone: torch.save of a view would write the whole tensor it views
            _save_shard({name: b[t].clone() for name, b in blocks.items()}, tmp, t, config.num_layers, pp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({"model": dataclasses.asdict(config),
                       "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                    "partition_method": "auto", "embedding_weight": 1}}, f, indent=1)
        write_manifest(tmp, 0, tp * pp, weights_only=True)
        os.replace(tmp, out_dir)  # an empty out_dir is replaced; a partial conversion never has its name
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_shard(shard: StateDict, ckpt: str, tp_rank: int, num_layers: int, pp: int) -> None:
    """One tp rank's GPTModel-named tensors, in the files `_read_shards` reads (embedding weight 1)."""
    if pp == 1:
        torch.save({"module": shard}, os.path.join(ckpt, model_states_file(tp_rank)))
        return
    for index, prefix in gpt_layer_prefixes(num_layers).items():
        layer = {name[len(prefix):]: t for name, t in shard.items() if name.startswith(prefix)}
        torch.save(layer, os.path.join(ckpt, layer_file(index, tp_rank)))


def _empty_hf_model(config: GPTConfig):
    """A transformers model of `config`'s architecture (GPT2LMHeadModel or BloomForCausalLM), random weights."""
    import transformers

    from gptpar.model.hf import hf_architecture

    try:
        architecture = hf_architecture(config)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    common = dict(vocab_size=config.vocab_size, layer_norm_epsilon=config.layernorm_epsilon,
                  initializer_range=config.init_method_std, bos_token_id=0, eos_token_id=0)
    if architecture == "bloom":
        # seq_length is not a BloomConfig field: kept as an extra attribute so that importing restores it.
        return transformers.BloomForCausalLM(transformers.BloomConfig(
            n_layer=config.num_layers, hidden_size=config.hidden_size, n_head=config.num_attention_heads,
            hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
            seq_length=config.seq_length, **common))
    act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}[config.activation]
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=config.num_layers, n_embd=config.hidden_size, n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size, n_positions=config.max_position_embeddings, activation_function=act,
        resid_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout, embd_pdrop=config.hidden_dropout,
        **common))


def save_hf(state: StateDict, config: GPTConfig, out_dir: str) -> None:
    """Write a Hugging Face directory (config.json + weights) loadable offline: `BloomForCausalLM` for an ALiBi
    model with the embedding LayerNorm, `GPT2LMHeadModel` for learned positions."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConversionError("exporting to Hugging Face needs transformers: pip install transformers") from e
    from gptpar.model.hf import to_hf_state_dict

    model = _empty_hf_model(config)
    missing, unexpected = model.load_state_dict(to_hf_state_dict(state, config), strict=False)
    missing = [k for k in missing if not k.endswith(".attn.bias") and not k.endswith(".attn.masked_bias")]
    if missing or unexpected:
        raise ConversionError(f"Hugging Face {type(model).__name__} did not take the weights: missing {missing}, "
                              f"unexpected {unexpected}")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConversionError(f"{out_dir} exists and is not empty: choose a new folder (nothing is overwritten)")
    tmp = f"{os.path.normpath(out_dir)}.tmp-{os.getpid()}"
    try:  # written whole under a temporary name: a failed export never leaves a folder with only config.json
        model.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_hf(model_dir: str) -> Tuple[StateDict, GPTConfig]:
    """A local Hugging Face GPT-2 or BLOOM directory (told apart by its config's model_type) -> (universal
    state dict, GPTConfig)."""
    import transformers

    from gptpar.model.hf import from_hf_state_dict

    config = _hf_config(model_dir)
    check_weight_files(model_dir)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    except (OSError, ValueError, RuntimeError) as e:  # a weight file damaged in a way its header does not show
        raise ConversionError(f"{model_dir}: transformers could not load its weights ({type(e).__name__}: "
                              f"{str(e).splitlines()[0]})") from None
    return from_hf_state_dict(model.state_dict(), config), config
