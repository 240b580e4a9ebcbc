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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    parser.add_argument("--tp", type=int, help="--to gptpar: tensor-parallel size of the layout (default 1)")
    parser.add_argument("--pp", type=int, help="--to gptpar: pipeline-parallel size of the layout (default 1)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the third-party warnings held back by default (gptpar.quiet)")
    args = parser.parse_args(argv)
    if not args.verbose:
        from gptpar.quiet import hold_back_warnings

        hold_back_warnings()  # before transformers imports torchao
    if args.to != "gptpar" and (args.tp or args.pp):
        parser.error("--tp / --pp set the layout of --to gptpar only")
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

    from gptpar.checkpoint.weights import (ConversionError, check_layout, check_weight_files, load_hf, read_weights,
                                      read_weights_config, save_hf, save_weights_only)

    from gptpar.config import ConfigError, load_config

    try:
        model = load_config(args.config).model if args.config else None
    except ConfigError as e:
        parser.error(f"--config: {e}")
    start = time.time()
    if args.to == "universal":
        return to_universal(args.load, args.tag, args.output, start)
    try:
        source = args.load or args.from_hf
        if args.to == "gptpar":  # a layout the model cannot take fails before any weight is read
            check_layout(read_weights_config(source, args.tag, model), args.tp or 1, args.pp or 1)
        check_weight_files(source, args.tag, model)  # every file it will read whole, before reading one
        # --load may also be a weights-only or a universal checkpoint
        state, config = read_weights(args.load, args.tag, model) if args.load else load_hf(args.from_hf)
        print(f"read {len(state)} tensors, {sum(t.numel() for t in state.values()):,} parameters "
              f"({config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size})")
        if args.to == "hf":
            save_hf(state, config, args.output)
        else:
            save_weights_only(state, config, args.output, tp=args.tp or 1, pp=args.pp or 1)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - writing failed (a full disk): nothing is left at --output
        return write_failed(args.output, e)
    print(f"wrote {args.output} in {time.time() - start:.1f}s")
    return 0


def bad_path(message: str) -> int:
    """A path that cannot be used: one line, exit 2, before anything is read."""
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
    from gptpar.checkpoint.layout import describe_write_failure, is_write_failure

    if not is_write_failure(error):
        raise error
    print(f"error: could not write {output}: {describe_write_failure(os.path.dirname(os.path.abspath(output)), error)}"
          ". Nothing was left there; free space or choose another --output", file=sys.stderr)
    return 1


def to_universal(load: str, tag, output: str, start: float) -> int:
    """The universal form of the checkpoint `load` (and `tag`) names, written to `output` (outside it)."""
    from gptpar.checkpoint import universal
    from gptpar.checkpoint.weights import ConversionError, resolve_checkpoint_dir
    from gptpar.checkpoint.checkpointer import CheckpointError, carried_counters, read_rank_state
    from gptpar.checkpoint.layout import LoadTarget, damaged, fingerprint, state_file, verify_digests

    try:
        ckpt = resolve_checkpoint_dir(load, tag)
        for folder in {os.path.abspath(load), os.path.abspath(ckpt)}:
            if os.path.commonpath([os.path.abspath(output), folder]) == folder:
                raise ConversionError(f"--output {output} is inside the checkpoint folder {folder}: write the "
                                      "universal checkpoint outside it (nothing is written there)")
        problems = verify_digests(ckpt)  # every file the conversion reads, against the manifest's checksums
        if problems:
            folder = os.path.normpath(ckpt)
            raise CheckpointError(damaged(LoadTarget(os.path.dirname(folder), os.path.basename(folder)), problems))
        has_state = os.path.isfile(os.path.join(ckpt, state_file(0)))
        counters = carried_counters(read_rank_state(ckpt)) if has_state else {}
        universal.convert_deepspeed_checkpoint(ckpt, output, counters=counters, source_files=fingerprint(ckpt))
    except (ConversionError, CheckpointError, universal.UniversalCheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - writing failed (a full disk): the converter removed its partial folder
        return write_failed(output, e)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"wrote {output} in {time.time() - start:.1f}s; peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
