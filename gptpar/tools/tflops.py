"""TFLOPs per GPU from seconds per iteration, or recomputed for every line of a Megatron-format log.

    python tools/tflops.py --config configs/181b_48nodes.json --gpus 384 --sec-per-iter 120.85
    python tools/tflops.py --num-layers 8 --hidden-size 14400 --vocab-size 250880 --seq-length 2048 \\
        --global-batch-size 2048 --tensor-model-parallel-size 8 --gpus 8 --sec-per-iter 769.99 --formula legacy
    python tools/tflops.py --config configs/200b.json --gpus 80 --log train.log

--vocab-size is the padded size as given; from a config the vocab is padded for its tp. The config is read and
checked as pretrain_gpt.py reads it (--set overrides a key); recompute is the config's
training.activation_checkpointing (with flags alone full recompute, as the reference Megatron-DeepSpeed runs did);
--no-recompute turns it off.
Formula: improved (Narayanan) unless --formula legacy. --gpu KIND (a100-80gb, h100-80gb, h200) adds the model FLOPs
utilisation against that kind's dense bf16/fp16 peak (`mfu`). Options are never abbreviated (--gpu is the kind,
--gpus the GPU count).
"""
import argparse
import json
import os
import sys


from gptpar.estimate.flops import model_flops_per_iteration, tflops_per_gpu
from gptpar.estimate.kinds import kind_names, load_kind
from gptpar.estimate.settings import require
from gptpar.tools.model_flags import add_model_flags, settings_from_args
from gptpar.training.reporting import parse_log_line

def parse_log(path: str):
    """[(iteration, sec_per_iter, global_batch_size or None, printed TFLOPs or None)] of the log's iteration lines,
    read by the trainer's own parser (gptpar.training.reporting.parse_log_line)."""
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                r = parse_log_line(line, strict=False)
            except ValueError:  # not an iteration line
                continue
            if r["elapsed_s"] is not None:
                rows.append((r["iteration"], r["elapsed_s"], r["global_batch_size"], r["tflops"]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    add_model_flags(parser)
    parser.add_argument("--log", help="a training log with Megatron-format iteration lines")
    parser.add_argument("--gpu", metavar="KIND", help="a GPU kind whose peak the MFU is against (a100-80gb, "
                                                      "h100-80gb, h200); the GPU count is --gpus")
    args = parser.parse_args(argv)
    try:
        if args.log and not os.path.isfile(args.log):   # before any model flag is asked for
            raise ValueError(f"--log {args.log!r}: no such file")
        if args.gpu and args.gpu.isdigit():   # --gpu once abbreviated --gpus
            raise ValueError(f"--gpu takes a GPU kind ({', '.join(kind_names())}); the number of GPUs is "
                             f"--gpus {args.gpu}")
        peak = load_kind(args.gpu)["peak_tflops"] if args.gpu else None
        s = settings_from_args(args)
        require(s, "num_layers", "hidden_size", "seq_length", "vocab_size", "gpus")
        kw = dict(num_layers=s["num_layers"], hidden_size=s["hidden_size"], vocab_size=s["padded_vocab_size"],
                  seq_length=s["seq_length"], num_gpus=s["gpus"], recompute=s["recompute"], formula=s["formula"],
                  tp_size=s["tp_size"], ffn_hidden_size=s["ffn_hidden_size"],
                  glu=s.get("activation", "gelu").endswith("glu"))
        if args.log:
            rows = parse_log(args.log)
            if not rows:
                raise ValueError(f"--log {args.log}: no 'iteration ... elapsed time per iteration' lines found")
            per_iter = []
            for it, sec, gbs, printed in rows:
                gbs = gbs or s["global_batch_size"]
                if not gbs:
                    raise ValueError("the log has no 'global batch size' field: pass --global-batch-size")
                per_iter.append({"iteration": it, "sec_per_iter": sec, "global_batch_size": gbs,
                                 "printed_tflops": printed,
                                 "tflops": tflops_per_gpu(global_batch_size=gbs, sec_per_iter=sec, **kw)})
            out = {"tflops": sum(r["tflops"] for r in per_iter) / len(per_iter), "formula": s["formula"],
                   "recompute": s["recompute"], "gpus": s["gpus"], "iterations": per_iter}
        else:
            require(s, "global_batch_size", "sec_per_iter")
            tf = tflops_per_gpu(global_batch_size=s["global_batch_size"], sec_per_iter=s["sec_per_iter"], **kw)
            flops = model_flops_per_iteration(global_batch_size=s["global_batch_size"],
                                              **{k: v for k, v in kw.items() if k != "num_gpus"})
            out = {"tflops": tf, "flops_per_iteration": flops, "formula": s["formula"], "recompute": s["recompute"],
                   "gpus": s["gpus"], "sec_per_iter": s["sec_per_iter"], "global_batch_size": s["global_batch_size"],
                   "padded_vocab_size": s["padded_vocab_size"]}
        if peak:
            out.update(gpu=args.gpu, peak_tflops=peak, mfu=out["tflops"] / peak)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"formula {out['formula']}, recompute {out['recompute']}, {out['gpus']} GPUs")
    if args.log:
        print(f"{'iteration':>9} {'s/it':>9} {'gbs':>6} {'printed':>8} {'TFLOPs':>8}")
        for r in out["iterations"]:
            printed = "" if r["printed_tflops"] is None else f"{r['printed_tflops']:.2f}"
            print(f"{r['iteration']:>9} {r['sec_per_iter']:>9.2f} {r['global_batch_size']:>6} {printed:>8} "
                  f"{r['tflops']:>8.2f}")
        print(f"mean TFLOPs per GPU: {out['tflops']:.2f}")
    else:
        print(f"FLOPs per iteration: {out['flops_per_iteration']:.4e}")
        print(f"TFLOPs per GPU: {out['tflops']:.2f}")
    if peak:
        print(f"MFU on {args.gpu}: {100 * out['mfu']:.1f}% of {peak} TFLOPs (dense bf16/fp16 peak)")
    return 0
