"""Convert checkpoints: gptpar (any tp x pp) -> Hugging Face (GPT2LMHeadModel, or BloomForCausalLM for an ALiBi +
embedding-LayerNorm model), a universal tp=1 file, or a weights-only gptpar checkpoint at another tp x pp; and HF
(GPT-2 or BLOOM) -> universal or a weights-only gptpar checkpoint.

    python tools/convert_checkpoint.py --load checkpoints/demo --to hf --output exported/demo_hf
    python tools/convert_checkpoint.py --load checkpoints/demo --to universal --output demo_full.pt
    python tools/convert_checkpoint.py --from-hf exported/demo_hf --to universal --output demo_full.pt
    python tools/convert_checkpoint.py --from-hf exported/demo_hf --to gptpar --output demo_w --tp 2 --pp 2
    python tools/convert_checkpoint.py --load checkpoints/demo --to gptpar --output demo_w_tp2 --tp 2

The universal file is {"model": GPTModel state dict at tp=1 (real vocab rows), "config": the model config};
`gptpar.model.sharding.load_full_state_dict(model, state, tp_group)` loads it into any tp.
A weights-only gptpar checkpoint (`--to gptpar`) is a checkpoint folder laid out for (--tp, --pp) without optimizer
state (gptpar.model.convert.save_weights_only): `checkpoint.load` or `checkpoint.init_from` starts a run from it
at iteration 0, at any tp x pp.
"""
import argparse
import os
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
    parser.add_argument("--output", required=True, help="output directory (hf, gptpar) or file (universal)")
    parser.add_argument("--tp", type=int, help="--to gptpar: tensor-parallel size of the layout (default 1)")
    parser.add_argument("--pp", type=int, help="--to gptpar: pipeline-parallel size of the layout (default 1)")
    args = parser.parse_args(argv)
    if args.to != "gptpar" and (args.tp or args.pp):
        parser.error("--tp / --pp set the layout of --to gptpar only")
    if os.path.exists(args.output) and (args.to == "universal" or not os.path.isdir(args.output)
                                        or os.listdir(args.output)):
        parser.error(f"--output {args.output} exists: choose a new path (nothing is overwritten)")

    import dataclasses

    import torch

    from gptpar.model.convert import (ConversionError, check_layout, load_hf, load_universal, read_weights_config,
                                      save_hf, save_weights_only)

    start = time.time()
    try:
        if args.to == "gptpar":  # a layout the model cannot take fails before any weight is read
            check_layout(read_weights_config(args.load or args.from_hf, args.tag), args.tp or 1, args.pp or 1)
        if args.load:
            state, config, _ = load_universal(args.load, args.tag)
        else:
            state, config = load_hf(args.from_hf)
        print(f"read {len(state)} tensors, {sum(t.numel() for t in state.values()):,} parameters "
              f"({config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size})")
        if args.to == "hf":
            save_hf(state, config, args.output)
        elif args.to == "gptpar":
            save_weights_only(state, config, args.output, tp=args.tp or 1, pp=args.pp or 1)
        else:
            tmp = args.output + ".tmp"
            torch.save({"model": state, "config": dataclasses.asdict(config)}, tmp)
            os.replace(tmp, args.output)  # never leave a partial file under the final name
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
