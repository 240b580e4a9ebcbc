"""Convert checkpoints: gptpar (any tp x pp) -> Hugging Face (GPT2LMHeadModel, or BloomForCausalLM for an ALiBi +
embedding-LayerNorm model) or a universal tp=1 file, and HF (GPT-2 or BLOOM) -> universal.

    python tools/convert_checkpoint.py --load checkpoints/demo --to hf --output exported/demo_hf
    python tools/convert_checkpoint.py --load checkpoints/demo --to universal --output demo_full.pt
    python tools/convert_checkpoint.py --from-hf exported/demo_hf --to universal --output demo_full.pt

The universal file is {"model": GPTModel state dict at tp=1 (real vocab rows), "config": the model config};
`gptpar.model.sharding.load_full_state_dict(model, state, tp_group)` loads it into any tp.
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
    parser.add_argument("--to", choices=("hf", "universal"), required=True)
    parser.add_argument("--output", required=True, help="output directory (hf) or file (universal)")
    args = parser.parse_args(argv)
    if os.path.exists(args.output) and (args.to == "universal" or os.listdir(args.output)):
        parser.error(f"--output {args.output} exists: choose a new path (nothing is overwritten)")

    import dataclasses

    import torch

    from gptpar.model.convert import ConversionError, load_hf, load_universal, save_hf

    start = time.time()
    try:
        if args.load:
            state, config, _ = load_universal(args.load, args.tag)
        else:
            state, config = load_hf(args.from_hf)
        print(f"read {len(state)} tensors, {sum(t.numel() for t in state.values()):,} parameters "
              f"({config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size})")
        if args.to == "hf":
            save_hf(state, config, args.output)
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
