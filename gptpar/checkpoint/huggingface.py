"""Hugging Face model directories: gptpar's export (`save_hf`: GPT2LMHeadModel, or BloomForCausalLM for an ALiBi
model with the embedding LayerNorm; gptpar.model.hf maps the tensors; the run's tokenizer beside the weights, its
special ids in config.json and generation_config.json) and reading one (`load_hf`).

An export is one durable write (gptpar.checkpoint.durable) with a manifest of kind `huggingface`, and its
config.json carries gptpar's mark, so that an export whose manifest went missing is refused as incomplete rather
than read unverified. Reading an export reads its safetensors through the Verifier (each file hashed, then
mapped; a weight file its manifest does not list is refused); a directory gptpar did not write is loaded by transformers and said to carry no checksums.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, Optional, Tuple

import torch

from gptpar.checkpoint.durable import StagedFolder
from gptpar.checkpoint.exceptions import CheckpointError, ConversionError
from gptpar.checkpoint.layout import CONFIG, MANIFEST
from gptpar.checkpoint.manifest import HUGGING_FACE, MARK, Verifier, open_folder
from gptpar.checkpoint.weight_files import HF_WEIGHT_FILES, file_problems, hf_weight_files
from gptpar.model.config import GPTConfig

StateDict = Dict[str, torch.Tensor]
FIX = "export or download the model again"


def hf_config(model_dir: str) -> GPTConfig:
    """The GPTConfig of a Hugging Face directory's config.json; ConversionError for one gptpar does not read."""
    import transformers

    from gptpar.model.hf import config_from_hf

    try:
        return config_from_hf(transformers.AutoConfig.from_pretrained(model_dir))
    except (ValueError, KeyError, OSError) as e:  # an unknown or unsupported model_type, a broken config.json
        raise ConversionError(f"{model_dir}: {str(e).splitlines()[0]}") from None


def _open(model_dir: str, log: Callable[[str], None], verify: bool, quiet: bool) -> Verifier:
    try:
        return open_folder(model_dir, FIX, log, verify, "--no-verify", quiet=quiet)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None


def check_hf_files(model_dir: str, log: Callable[[str], None] = print) -> None:
    """ConversionError unless `model_dir`'s weight files are there and whole (and, for gptpar's export, its
    manifest and every file it lists), before anything is read."""
    verifier = _open(model_dir, log, verify=False, quiet=True)
    files = hf_weight_files(model_dir)
    if not files:
        raise ConversionError(f"{model_dir} holds a Hugging Face config.json but no weights "
                              f"({' or '.join(HF_WEIGHT_FILES)}, or a sharded index): an export that did not "
                              f"finish? {FIX[0].upper() + FIX[1:]}")
    try:  # gptpar's export: its manifest is the list of what may be read
        for path in files:
            verifier.require_listed(path)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    problems = file_problems(files)
    if problems:
        raise ConversionError("unreadable weights: " + "; ".join(problems[:5])
                              + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "") + f": {FIX}")


def load_hf(model_dir: str, log: Callable[[str], None] = print, verify: bool = True) -> Tuple[StateDict, GPTConfig]:
    """A local Hugging Face GPT-2 or BLOOM directory (told apart by its config's model_type) -> (GPTModel's full
    state dict, GPTConfig). gptpar's export: its weight files read through the Verifier; any other: through
    transformers, unverified (it carries no checksums)."""
    from gptpar.model.hf import from_hf_state_dict

    config = hf_config(model_dir)
    check_hf_files(model_dir, log)
    verifier = _open(model_dir, log, verify, quiet=False)
    if verifier.manifest is not None:
        hf = {}
        for path in hf_weight_files(model_dir):
            hf.update(_read_weight_file(path, verifier))
        try:
            return from_hf_state_dict(hf, config), config
        except KeyError as e:
            raise ConversionError(f"{model_dir}: its weights lack {e}: {FIX}") from None
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    except (OSError, ValueError, RuntimeError) as e:  # a weight file damaged in a way its header does not show
        raise ConversionError(f"{model_dir}: transformers could not load its weights ({type(e).__name__}: "
                              f"{str(e).splitlines()[0]})") from None
    return from_hf_state_dict(model.state_dict(), config), config


def _read_weight_file(path: str, verifier: Verifier) -> StateDict:
    """One weight file of an export, verified before it is parsed."""
    try:
        if path.endswith(".safetensors"):
            return verifier.load_safetensors(path)
        return verifier.torch_load(path, weights_only=True)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    except (OSError, RuntimeError, ValueError) as e:
        raise ConversionError(f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}): {FIX}") from None


def _empty_hf_model(config: GPTConfig, special_ids: Optional[dict] = None):
    """A transformers model of `config`'s architecture (GPT2LMHeadModel or BloomForCausalLM), random weights, its
    config carrying gptpar's mark and the tokenizer's special ids (`special_ids`: bos/eos/pad_token_id)."""
    import transformers

    from gptpar.model.hf import hf_architecture

    try:
        architecture = hf_architecture(config)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    special_ids = special_ids or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    common = dict(vocab_size=config.vocab_size, layer_norm_epsilon=config.layernorm_epsilon,
                  initializer_range=config.init_method_std, **special_ids, **{MARK: True})
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


def save_hf(state: StateDict, config: GPTConfig, out_dir: str, tokenizer: Optional[str] = None,
            log: Callable[[str], None] = print) -> None:
    """Write a Hugging Face directory (config.json, generation_config.json, the weights and, given the run's
    `tokenizer`, the tokenizer `AutoTokenizer.from_pretrained` reads) loadable offline: `BloomForCausalLM` for an
    ALiBi model with the embedding LayerNorm, `GPT2LMHeadModel` for learned positions. The bos/eos/pad ids are the
    tokenizer's own (eos: its end-of-document token), none without a tokenizer. The export is loaded back with
    transformers (config, tokenizer, a forward pass giving the logits of the model written) before it is published
    (tools/convert_checkpoint.py refuses a tokenizer larger than the model's vocabulary before that). One durable write, with a manifest of kind
    huggingface; `out_dir` must not exist or be empty."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConversionError("exporting to Hugging Face needs transformers: pip install transformers") from e
    from gptpar.model.hf import to_hf_state_dict

    from gptpar.data.indexed import DataError
    from gptpar.data.tokenizer_export import export_tokenizer, special_token_ids

    try:
        special_ids = special_token_ids(tokenizer) if tokenizer else None
    except DataError as e:
        raise ConversionError(str(e)) from None
    model = _empty_hf_model(config, special_ids)
    missing, unexpected = model.load_state_dict(to_hf_state_dict(state, config), strict=False)
    missing = [k for k in missing if not k.endswith(".attn.bias") and not k.endswith(".attn.masked_bias")]
    if missing or unexpected:
        raise ConversionError(f"Hugging Face {type(model).__name__} did not take the weights: missing {missing}, "
                              f"unexpected {unexpected}")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConversionError(f"{out_dir} exists and is not empty: choose a new folder (nothing is overwritten)")
    staged = StagedFolder(out_dir)
    try:  # written whole under a temporary name: a failed export never leaves a folder with only config.json
        model.save_pretrained(staged.create())
        if tokenizer:
            export_tokenizer(tokenizer, staged.tmp)
        _check_loads_back(staged.tmp, model, out_dir, tokenizer is not None)
        staged.commit(HUGGING_FACE, log=log)
    except DataError as e:
        staged.abandon()
        raise ConversionError(str(e)) from None
    except BaseException:
        staged.abandon()
        raise


# What the export's own tokenizer encodes for the forward pass that checks the export loads back.
PROBE_TEXT = "def main():\n    return 0  # gptpar"


def _check_loads_back(folder: str, model, out_dir: str, with_tokenizer: bool) -> None:
    """Load the export written into `folder` as a user would (transformers' AutoConfig, AutoTokenizer when it has
    one, AutoModelForCausalLM) and run a forward pass: its logits must be those of `model`, the model written.
    ConversionError naming `out_dir` otherwise, before anything is published there."""
    import transformers
    from transformers.utils import logging as hf_logging

    where = f"the export to {out_dir} does not load back with transformers"
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a check, not a load the user asked for: no progress bar
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        ids = list(range(min(8, config.vocab_size)))
        if with_tokenizer:
            ids = transformers.AutoTokenizer.from_pretrained(folder)(PROBE_TEXT)["input_ids"] or ids
        outside = [i for i in ids if not 0 <= i < config.vocab_size]
        if outside:
            raise ConversionError(f"{where}: its tokenizer gives ids {outside[:5]} outside the model's vocabulary "
                                  f"[0, {config.vocab_size}); nothing was written")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config).eval()
        x = torch.tensor([ids[:getattr(config, "n_positions", None) or len(ids)]])
        with torch.no_grad():
            got, want = loaded(x).logits, model.eval()(x).logits
    except ConversionError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever transformers raises: the export is not published
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConversionError(f"{where} ({type(e).__name__}: {first}); nothing was written") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if got.shape != want.shape or not torch.equal(got, want):
        raise ConversionError(f"{where}: its forward pass differs from the model written (largest difference "
                              f"{(got - want).abs().max().item() if got.shape == want.shape else 'in shape'}); "
                              "nothing was written")


def is_gptpar_export(model_dir: str) -> bool:
    """Whether `model_dir` is gptpar's export (its manifest, or gptpar's mark in its config.json)."""
    if os.path.isfile(os.path.join(model_dir, MANIFEST)):
        return True
    try:
        with open(os.path.join(model_dir, CONFIG)) as f:
            return bool(json.load(f).get(MARK))
    except (OSError, ValueError, AttributeError):
        return False


__all__ = ["hf_config", "check_hf_files", "load_hf", "save_hf", "is_gptpar_export"]
