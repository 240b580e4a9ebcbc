"""Memory per GPU for every pipeline stage: weights, gradients, optimizer, activations, CUDA context.

    python tools/memory.py --config configs/200b.json
    python tools/memory.py --config configs/181b_48nodes.json --pipeline-model-parallel-size 12 --gpus 384
    python tools/memory.py --config configs/cpu_tiny.json --set training.precision=bf16
    python tools/memory.py --config configs/104b.json --set training.optimizer=adamw8bit

The config is read and checked as pretrain_gpt.py reads it (its defaults: fp32, ZeRO-0, no recompute): the
figures are the ones `pretrain_gpt.py --config X --dry-run` prints. dp = --gpus / (tp * pp) when --gpus is
given, else the config's data_parallel_size (or 1).
"""
import argparse
import json
import sys


from gptpar.estimate.memory import GIB
from gptpar.estimate.settings import memory_of, require
from gptpar.tools.model_flags import add_model_flags, settings_from_args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser)
    args = parser.parse_args(argv)
    try:
        s = settings_from_args(args)
        require(s, "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                "global_batch_size", "gpus")
        if s["gpus"] % (s["tp_size"] * s["pp_size"]):
            raise ValueError(f"--gpus {s['gpus']} must divide by tp x pp = {s['tp_size'] * s['pp_size']}")
        dp = s["gpus"] // (s["tp_size"] * s["pp_size"])
        mem = memory_of(dict(s, dp_size=dp))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = {"tp_size": s["tp_size"], "pp_size": s["pp_size"], "dp_size": dp, "micro_batch_size": s["micro_batch_size"],
           "precision": s["precision"], "optimizer": s["optimizer"], "zero_stage": s["zero_stage"],
           "stages": mem["stages"],
           "max_stage": mem["max"]["stage"], "max_gib": mem["max"]["total"] / GIB}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"tp={s['tp_size']} pp={s['pp_size']} dp={dp} micro batch {s['micro_batch_size']} {s['precision']} "
          f"{s['optimizer']} ZeRO-{s['zero_stage']} recompute {s['activation_checkpointing']} (GiB)")
    # activ+: the heaviest phase over the model states (activations, pipeline buffers, ...: gptpar.estimate.memory)
    print(f"{'stage':>5} {'params/rank':>14} {'weights':>8} {'grads':>8} {'optim':>8} {'activ+':>8} {'reserve':>8} "
          f"{'ctx':>6} {'total':>8}")
    for st in mem["stages"]:
        transient = st["peak_allocated"] - st["weights"] - st["gradients"] - st["optimizer"]
        print(f"{st['stage']:>5} {st['params']:>14,} {st['weights'] / GIB:>8.1f} {st['gradients'] / GIB:>8.1f} "
              f"{st['optimizer'] / GIB:>8.1f} {transient / GIB:>8.1f} {st['allocator_reserve'] / GIB:>8.1f} "
              f"{st['cuda_context'] / GIB:>6.1f} {st['total'] / GIB:>8.1f}")
    print(f"heaviest: stage {out['max_stage']}, {out['max_gib']:.1f} GiB")
    return 0
