"""Convert checkpoints: gptpar (any tp x pp x dp) -> Hugging Face (GPT2LMHeadModel, or BloomForCausalLM for an
ALiBi + embedding-LayerNorm model), a universal checkpoint, or a weights-only gptpar checkpoint at another tp x pp;
and Hugging Face (GPT-2 or BLOOM) -> a weights-only gptpar checkpoint.

    python tools/convert_checkpoint.py --load checkpoints/demo --to hf --output exported/demo_hf
    python tools/convert_checkpoint.py --load checkpoints/demo --to universal --output demo_universal
    python tools/convert_checkpoint.py --from-hf exported/demo_hf --to gptpar --output demo_w --tp 2 --pp 2
    python tools/convert_checkpoint.py --load checkpoints/demo --to gptpar --output demo_w_tp2 --tp 2

The universal checkpoint (a folder; layout in docs/checkpoints.md) holds every parameter's full fp32 master
weight and Adam moments and the run's counters: `checkpoint.load` resumes it at any (tp, pp, dp), and
`gptpar.checkpoint.weights.read_weights` reads its weights. It streams: one pipeline stage's shard files mapped,
one full parameter in memory at a time (the peak RSS is printed at the end).
A weights-only gptpar checkpoint (`--to gptpar`) is a checkpoint folder laid out for (--tp, --pp) without optimizer
state (gptpar.checkpoint.weights.save_weights_only): `checkpoint.load` or `checkpoint.init_from` starts a run from it
at iteration 0, at any tp x pp.
"""
import argparse
import os
import resource
import sys
import time



def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help="a gptpar checkpoint directory, or the save directory holding `latest`")
    src.add_argument("--from-hf", help="a local Hugging Face GPT-2 or BLOOM model directory")
    parser.add_argument("--tag", help="checkpoint tag inside --load (default: what `latest` points at)")
    parser.add_argument("--to", choices=("hf", "universal", "gptpar"), required=True)
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--config", help="a gptpar run config whose `model` section describes the weights: needed "
                             "for a universal folder written by DeepSpeed's ds_to_universal.py (it records no model "
                             "gptpar reads); ignored for the other sources, which carry their own")
    parser.add_argument("--tokenizer", help="--to hf: the tokenizer to export beside the weights (default: the run's "
                             "data.tokenizer_model, or the Hugging Face directory's own)")
    parser.add_argument("--no-verify", action="store_true", help="do not check the files read against the sha256 "
                             "their manifest records (checked by default, before each is parsed)")
    parser.add_argument("--tp", type=int, help="--to gptpar: tensor-parallel size of the layout (default 1)")
    parser.add_argument("--pp", type=int, help="--to gptpar: pipeline-parallel size of the layout (default 1)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the third-party warnings held back by default (gptpar.quiet)")
    args = parser.parse_args(argv)
    if not args.verbose:
        from gptpar.quiet import hold_back_warnings

        hold_back_warnings()  # before transformers imports torchao
    if args.to != "gptpar" and (args.tp is not None or args.pp is not None):
        parser.error("--tp / --pp set the layout of --to gptpar only")
    for flag, size in (("--tp", args.tp), ("--pp", args.pp)):
        if size is not None and size < 1:
            return bad_path(f"{flag} {size}: a parallel size is >= 1 (1 = not split; leave it out for 1)")
    if args.to != "hf" and args.tokenizer:
        parser.error("--tokenizer is exported with --to hf only")
    if os.path.exists(args.output) and (args.to == "universal" or not os.path.isdir(args.output)
                                        or os.listdir(args.output)):
        return bad_path(f"--output {args.output} exists: choose a new path (nothing is overwritten)")
    blocked = blocking_file(args.output)
    if blocked:
        return bad_path(f"--output {args.output} cannot be created: {blocked} is a file, not a folder; choose a "
                        "path under a folder")
    if args.to == "universal" and not args.load:
        parser.error("--to universal needs --load: a universal checkpoint carries a training run's optimizer state, "
                     "which a Hugging Face model does not have")

    from gptpar.checkpoint.exceptions import CheckpointError
    from gptpar.checkpoint.huggingface import save_hf
    from gptpar.checkpoint.weights import (check_layout, check_weight_files, read_weights, read_weights_config,
                                           save_weights_only)
    from gptpar.config import ConfigError, load_config
    from gptpar.data.indexed import DataError

    try:
        model = load_config(args.config).model if args.config else None
    except ConfigError as e:
        parser.error(f"--config: {e}")
    start = time.time()
    if args.to == "universal":
        return to_universal(args.load, args.tag, args.output, start, not args.no_verify)
    try:
        source = args.load or args.from_hf
        if args.to == "gptpar":  # a layout the model cannot take fails before any weight is read
            check_layout(read_weights_config(source, args.tag, model), args.tp or 1, args.pp or 1)
        check_weight_files(source, args.tag, model)  # every file it will read whole, before reading one
        if args.to == "hf":  # a tokenizer the model cannot take is refused before any weight is read
            tokenizer = export_tokenizer_path(source, args.tag, args.tokenizer)
            if tokenizer:
                check_export_tokenizer(read_weights_config(source, args.tag, model), tokenizer)
        # --load may be a training, weights-only or universal checkpoint, or a Hugging Face directory
        state, config = read_weights(source, args.tag, model, verify=not args.no_verify)
        print(f"read {len(state)} tensors, {sum(t.numel() for t in state.values()):,} parameters "
              f"({config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size})")
        if args.to == "hf":
            if tokenizer is None:
                print(f"note: {source} names no tokenizer: the export holds the model only; pass --tokenizer PATH to "
                      "add the one it was trained with", file=sys.stderr)
            save_hf(state, config, args.output, tokenizer)
        else:
            save_weights_only(state, config, args.output, tp=args.tp or 1, pp=args.pp or 1)
    except (CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - writing failed (a full disk): nothing is left at --output
        return write_failed(args.output, e)
    print(f"wrote {args.output} in {time.time() - start:.1f}s")
    return 0


def export_tokenizer_path(source: str, tag, given):
    """The tokenizer an HF export carries: --tokenizer, else the checkpoint's own (None when it names none)."""
    from gptpar.checkpoint.exceptions import ConversionError
    from gptpar.checkpoint.model_loading import tokenizer_path

    try:
        return tokenizer_path(source, tag, given)
    except ValueError as e:
        raise ConversionError(f"{e} (or --tokenizer PATH)") from None


def check_export_tokenizer(config, path: str) -> None:
    """ConversionError unless every id the tokenizer at `path` makes has a row in the model's embedding: the check
    generate.py makes (gptpar.checkpoint.model_loading.check_tokenizer_fits)."""
    from gptpar.checkpoint.exceptions import ConversionError
    from gptpar.checkpoint.model_loading import check_tokenizer_fits
    from gptpar.data.tokenizer import load_tokenizer

    try:
        check_tokenizer_fits(config, load_tokenizer(path))
    except ValueError as e:
        raise ConversionError(f"--tokenizer {path}: {e}") from None


def bad_path(message: str) -> int:
    """A path or a size that cannot be used: one line, exit 2, before anything is read."""
    print(f"convert_checkpoint.py: error: {message}", file=sys.stderr)
    return 2


def blocking_file(path: str):
    """The nearest existing ancestor of `path` when it is not a folder (so `path` cannot be created), else None."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return None if os.path.isdir(parent) else parent


def write_failed(output: str, error: BaseException) -> int:
    """One line for a write that failed (a full disk, an I/O error), as pretrain_gpt.py's failed save: exit 1.
    Anything else is a bug, re-raised with its traceback."""
    from gptpar.checkpoint.durable import describe_write_failure, is_write_failure

    if not is_write_failure(error):
        raise error
    print(f"error: could not write {output}: {describe_write_failure(os.path.dirname(os.path.abspath(output)), error)}"
          ". Nothing was left there; free space or choose another --output", file=sys.stderr)
    return 1


def to_universal(load: str, tag, output: str, start: float, verify: bool = True) -> int:
    """The universal form of the checkpoint `load` (and `tag`) names, written to `output` (outside it); every file
    read checked against the checkpoint's manifest before it is parsed."""
    from gptpar.checkpoint import universal
    from gptpar.checkpoint.exceptions import CheckpointError
    from gptpar.checkpoint.layout import fingerprint, state_file
    from gptpar.checkpoint.manifest import open_folder
    from gptpar.checkpoint.resume import carried_counters, read_rank_state
    from gptpar.checkpoint.weights import resolve_checkpoint_dir

    fix = "convert an earlier checkpoint instead"
    try:
        ckpt = resolve_checkpoint_dir(load, tag)
        for folder in {os.path.abspath(load), os.path.abspath(ckpt)}:
            if os.path.commonpath([os.path.abspath(output), folder]) == folder:
                raise CheckpointError(f"--output {output} is inside the checkpoint folder {folder}: write the "
                                      "universal checkpoint outside it (nothing is written there)")
        verifier = open_folder(ckpt, fix, print, verify, "--no-verify")
        if verifier.manifest is None:
            raise CheckpointError(f"{ckpt} is not a gptpar checkpoint (no manifest): give a training checkpoint")
        has_state = verifier.manifest.record(os.path.join(ckpt, state_file(0))) is not None
        counters = carried_counters(read_rank_state(ckpt, 0, verifier)) if has_state else {}
        universal.convert_deepspeed_checkpoint(ckpt, output, counters=counters, source_files=fingerprint(ckpt),
                                               verify=verify, fix=fix)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - writing failed (a full disk): the converter removed its partial folder
        return write_failed(output, e)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"wrote {output} in {time.time() - start:.1f}s; peak RSS {peak:.0f} MiB")
    return 0
