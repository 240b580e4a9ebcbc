"""Model size, exact parameter count, and parameters per pipeline stage / tensor-parallel rank.

    python tools/model_size.py --config configs/200b.json
    python tools/model_size.py --num-layers 96 --hidden-size 13312 --seq-length 2048 --vocab-size 150000
"""
import argparse
import json
import sys


from gptpar.estimate.flops import exact_model_params, model_size_formula, params_per_stage
from gptpar.estimate.settings import embedding_kind, require
from gptpar.tools.model_flags import add_model_flags, settings_from_args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser)
    args = parser.parse_args(argv)
    try:
        s = settings_from_args(args)
        require(s, "num_layers", "hidden_size", "seq_length", "vocab_size", "tp_size", "pp_size")
        shape = dict(num_layers=s["num_layers"], hidden_size=s["hidden_size"], vocab_size=s["vocab_size"],
                     seq_length=s["seq_length"], tp_size=s["tp_size"], ffn_hidden_size=s["ffn_hidden_size"],
                     max_position_embeddings=s["max_position_embeddings"],
                     make_vocab_size_divisible_by=s["make_vocab_size_divisible_by"], **embedding_kind(s))
        formula = model_size_formula(s["num_layers"], s["hidden_size"], s["vocab_size"], s["seq_length"])
        exact = exact_model_params(**shape)
        stage_kw = dict(shape, pp_size=s["pp_size"], partition_method=s["partition_method"])
        stages = params_per_stage(**stage_kw)
        per_rank = params_per_stage(**stage_kw, per_tp_rank=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = {"model_size_formula": formula, "model_size_b": round(formula / 1e9, 3), "exact_params": exact,
           "padded_vocab_size": s["padded_vocab_size"], "tp_size": s["tp_size"], "pp_size": s["pp_size"],
           "partition_method": s["partition_method"], "params_per_stage": stages, "params_per_tp_rank": per_rank}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"model size (formula L*(12h^2+13h) + V*h + s*h + 2h): {formula:,} = {formula / 1e9:.0f}B")
    print(f"exact parameters (padded vocab {s['padded_vocab_size']}, ffn {s['ffn_hidden_size']}): {exact:,}")
    print(f"{'stage':>5} {'params':>18} {'per tp rank':>16}   (tp={s['tp_size']}, pp={s['pp_size']}, "
          f"{s['partition_method']})")
    for i, (a, b) in enumerate(zip(stages, per_rank)):
        print(f"{i:>5} {a:>18,} {b:>16,}")
    return 0
