"""The flags tools/model_size.py, tflops.py and memory.py share: the trainer's `--config FILE --set
section.key=value` (read and checked by gptpar.config) and Megatron-style flags that override them or
stand alone. A helper of the tools, not of the library: `python tools/X.py` finds it beside the script."""
from __future__ import annotations

from gptpar.estimate.settings import settings_of
from gptpar.model.config import check_tp_divides
from gptpar.config import Config, config_from_dict, load_config


def add_model_flags(parser) -> None:
    """The flags shared by tools/model_size.py, tflops.py and memory.py: the trainer's `--config FILE` and
    `--set section.key=value`, and Megatron-style flags that override them (or stand alone)."""
    parser.add_argument("--config", help="JSON config (configs/*.json), read as pretrain_gpt.py reads it")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key, as pretrain_gpt.py --set (repeatable)")
    for flag in ("num-layers", "hidden-size", "num-attention-heads", "seq-length", "vocab-size",
                 "global-batch-size", "tensor-model-parallel-size", "pipeline-model-parallel-size", "gpus"):
        parser.add_argument(f"--{flag}", type=int)
    parser.add_argument("--sec-per-iter", type=float)
    parser.add_argument("--formula", default="improved", help="improved (default) or legacy")
    parser.add_argument("--no-recompute", action="store_true", help="activation recompute off (factor 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# Megatron-style flag -> (settings key, config key it overrides)
_MODEL_FLAGS = (("num_layers", "num_layers", "model.num_layers"), ("hidden_size", "hidden_size", "model.hidden_size"),
                ("num_attention_heads", "num_attention_heads", "model.num_attention_heads"),
                ("seq_length", "seq_length", "model.seq_length"),
                ("global_batch_size", "global_batch_size", "training.global_batch_size"),
                ("tensor_model_parallel_size", "tp_size", "parallel.tensor_model_parallel_size"),
                ("pipeline_model_parallel_size", "pp_size", "parallel.pipeline_model_parallel_size"))


def settings_from_args(args) -> dict:
    """Settings from `--config` + `--set` (through the trainer's reader and checks) overridden by explicit flags,
    or from the flags alone on the trainer's defaults. --vocab-size is taken as the padded size as given."""
    if args.formula not in ("improved", "legacy"):
        raise ValueError(f"--formula {args.formula!r}: use --formula improved or --formula legacy")
    s = _settings_from_config_args(args) if args.config else _settings_from_flags(args)
    s["sec_per_iter"] = args.sec_per_iter
    s["formula"] = args.formula
    return s


def _settings_from_config_args(args) -> dict:
    cfg = load_config(args.config, args.set)
    overrides = [f"{key}={getattr(args, flag)}" for flag, _, key in _MODEL_FLAGS if getattr(args, flag) is not None]
    if args.hidden_size is not None and args.hidden_size != cfg.model.hidden_size:
        overrides.append(f"model.ffn_hidden_size={4 * args.hidden_size}")  # a new width: Megatron's default ffn
    if args.vocab_size is not None:
        overrides += [f"model.vocab_size={args.vocab_size}", "model.make_vocab_size_divisible_by=1"]
    if args.gpus is not None:
        overrides.append("parallel.data_parallel_size=null")  # --gpus is the world: dp is what tp x pp leave
    if overrides:
        cfg = config_from_dict(cfg.to_dict(), overrides)
    p = cfg.parallel
    gpus = args.gpus if args.gpus is not None else \
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * (p.data_parallel_size or 1)
    _, _, dp = cfg.check(gpus)  # the trainer's checks, as pretrain_gpt.py --dry-run runs them on this world
    s = settings_of(cfg, dp)
    s["gpus"] = gpus
    s["recompute"] = "none" if args.no_recompute else s["activation_checkpointing"]
    return s


def _settings_from_flags(args) -> dict:
    defaults = Config()  # the trainer's defaults for what no flag sets (precision, ZeRO, micro batch, ...)
    s = {key: None for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                               "global_batch_size", "max_position_embeddings", "padded_vocab_size")}
    s.update({k: v for k, v in settings_of(defaults).items() if k not in s and k not in ("ffn_hidden_size",)})
    s["make_vocab_size_divisible_by"] = 1
    for flag, key, _ in _MODEL_FLAGS:
        if getattr(args, flag) is not None:
            s[key] = getattr(args, flag)
    s["ffn_hidden_size"] = 4 * s["hidden_size"] if s["hidden_size"] else None
    if args.vocab_size is not None:
        s["vocab_size"] = s["padded_vocab_size"] = args.vocab_size
    s["gpus"] = args.gpus if args.gpus is not None else s["tp_size"] * s["pp_size"] * s["dp_size"]
    # full recompute (factor 4), as the reference Megatron-DeepSpeed runs did, unless --no-recompute
    s["recompute"] = "none" if args.no_recompute else "full"
    check_tp(s)
    return s


def check_tp(s: dict) -> None:
    """The flags' tp and pp: positive integers, tp splitting heads, hidden and ffn (`check_tp_divides`)."""
    tp = s.get("tp_size") or 1
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tensor-model-parallel-size must be a positive integer, got {tp!r}")
    check_tp_divides(tp, **{key: s.get(key) or None for key in ("num_attention_heads", "hidden_size",
                                                                 "ffn_hidden_size")})
    if s.get("pp_size") is not None and (not isinstance(s["pp_size"], int) or s["pp_size"] < 1):
        raise ValueError(f"--pipeline-model-parallel-size must be a positive integer, got {s['pp_size']!r}")


__all__ = ["add_model_flags", "settings_from_args", "check_tp"]
