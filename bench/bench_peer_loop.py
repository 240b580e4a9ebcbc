"""The peer: a nanoGPT-style single-device training loop, written without gptpar, as the baseline the trainer
must beat (gptpar's tokens/s >= 1.05 x this loop compiled, same shape, batch and GPU: bench/gpu_summary.py's target).

    python bench/bench_peer_loop.py --config configs/1.3b.json --device cuda --compile --json peer.json
    python bench/bench_peer_loop.py --config configs/1.3b.json --device cuda             # eager
    python bench/bench_peer_loop.py --tiny                                                # CPU smoke, seconds
    python bench/bench_peer_loop.py --config configs/1.3b.json --device cuda --compile --gptpar   # + gptpar's model

`--gptpar` also times gptpar's GPTModel in the same process, right after the peer and the same way: the same shape,
dropout, data, micro-batches, autocast, clipping and fused AdamW, its transformer layers compiled as
training.compile does (`compile_transformer_layers`) when --compile is given, its output layer fused with the loss
(`lm_loss`), the tensor-parallel RNG tracker the trainer seeds; the JSON then holds both loops and the ratio of
their tokens/s (gptpar / peer). What the trainer adds on top (DeepSpeed's engine, ZeRO, the data pipeline) is
measured by running pretrain_gpt.py itself.

What an expert would write for one GPU (Karpathy's nanoGPT `model.py` + `train.py`): fused QKV linear,
SDPA causal attention (flash on a GPU), tanh-GELU MLP, pre-LayerNorm, the output layer tied to the word
embedding, the vocabulary padded to a multiple of 64 (50257 -> 50304, as nanoGPT does and as gptpar's
padding to 128 also gives), bf16 autocast over fp32 parameters, fused AdamW (betas 0.9/0.95, weight decay
0.1 on matrices), gradient accumulation over micro-batches, clipping at 1.0, dropout from the config (0.1
at 1.3B), and optionally `torch.compile` of the whole model. The shape comes from a gptpar config
(model section; micro-batch from its training section), the global batch from --global-batch-size
(default 32 sequences: 8 micro-batches of 4 at 1.3B).

Data are random tokens made on the device before timing (gptpar's synthetic data, in spirit). After
--warmup iterations (the compile happens in the first), each of --iters iterations is timed between
device synchronisations. The JSON line printed last (and written to --json) gives the median seconds per
iteration, tokens/s and TFLOPs per GPU by gptpar's log-line formula (`gptpar.estimate.flops.tflops_per_gpu`, no
recompute, the padded vocab): the only thing taken from gptpar, so that the two loops' TFLOPs compare.
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gptpar.estimate.flops import tflops_per_gpu  # noqa: E402 (the shared FLOP formula; the peer's loop uses
# nothing else from gptpar; --profile reports with the trainer's profiler, --gptpar builds gptpar's model)


# The peer's MLP activation, as gptpar's config names it: nanoGPT's tanh GELU (also BLOOM's, and Megatron's fused
# bias-GELU). The gptpar config the peer takes its shape from must ask for the same one, or the two loops (and
# --gptpar's model alone) would time different functions.
ACTIVATION = "gelu_tanh"


@dataclass
class PeerConfig:
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int        # sequence length
    vocab_size: int        # the tokenizer's; the embedding holds padded_vocab rows
    dropout: float = 0.0

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / 64) * 64   # nanoGPT: 50257 -> 50304


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)   # q, k, v in one GEMM
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, d)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # ACTIVATION


class Block(nn.Module):
    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT (Hugging Face GPT-2 parameter names, nn.Linear instead of Conv1D)."""

    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.padded_vocab, cfg.n_embd), wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout), h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd)))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight   # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():   # GPT-2: residual projections scaled by 1/sqrt(2 L)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))   # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))   # (B, T, padded vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def configure_optimizer(model, lr, weight_decay, device_type):
    """nanoGPT's AdamW: decay on matrices (dim >= 2), not on biases and LayerNorms; fused kernel."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_peer(cfg: PeerConfig, device, compile_model: bool, seed: int):
    """(the model whose parameters the optimizer steps, loss_fn(x, y))."""
    model = GPT(cfg).to(device).train()
    step_model = torch.compile(model) if compile_model else model
    return model, step_model


def build_gptpar(model_section: dict, device, compile_model: bool, seed: int):
    """gptpar's GPTModel of the config's model section, as the trainer builds it at tp = pp = 1."""
    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import GPTModel, compile_transformer_layers
    from gptpar.tensor_parallel.random import model_parallel_seed

    tracker = model_parallel_seed(seed, device=device)
    model = GPTModel(GPTConfig(**model_section), rng_tracker=tracker, seed=seed, device=device).train()
    if compile_model:
        compile_transformer_layers(model)
    return model, lambda x, y: model(x, labels=y)


def run(cfg: PeerConfig, *, micro_batch_size, global_batch_size, device, dtype, compile_model, iters, warmup,
        clip=1.0, lr=2e-4, seed=0, gptpar_model: dict = None, profile: int = 0, turns=None) -> dict:
    """Time the peer loop, or with `gptpar_model` (a config's model section) gptpar's model in the same loop;
    then, with `profile`, run that many more iterations under torch.profiler (the trainer's logging.profile
    report: the top kernels by device time and the device's busy share), printed and kept under "profile".
    With `turns` (bench/rounds.py's `Turns`) the timed iterations are its rounds' instead of `iters` in a row
    (`run_turns`), and the memory peaks cover the whole run."""
    if global_batch_size % micro_batch_size:
        raise SystemExit(f"--global-batch-size {global_batch_size} must divide by the micro-batch {micro_batch_size}")
    accum = global_batch_size // micro_batch_size
    torch.manual_seed(seed)
    if device.type == "cuda":   # nanoGPT's train.py sets these (they matter for fp32 matmuls only)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if gptpar_model is None:
        model, step_model = build_peer(cfg, device, compile_model, seed)
    else:
        model, step_model = build_gptpar(gptpar_model, device, compile_model, seed)
    optimizer = configure_optimizer(model, lr, 0.1, device.type)
    ctx = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    gen = torch.Generator(device=device).manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (accum, micro_batch_size, cfg.block_size + 1), device=device,
                         generator=gen)

    def iteration() -> float:
        total = 0.0
        for micro in range(accum):
            x, y = data[micro, :, :-1], data[micro, :, 1:]
            with ctx:
                loss = step_model(x, y) / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    def timed() -> float:
        sync(device)
        t0 = time.perf_counter()
        loss = iteration()
        sync(device)
        losses.append(float(loss))
        return time.perf_counter() - t0

    start = time.perf_counter()
    losses = []
    for _ in range(warmup):
        losses.append(float(iteration()))
    sync(device)
    warmup_s = time.perf_counter() - start
    tokens = global_batch_size * cfg.block_size
    rounds = None
    if turns is not None:
        rounds = run_turns(turns, iteration, timed, device, tokens)
        times = [t for r in rounds for t in r["sec_per_iter"]]
    else:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = [timed() for _ in range(iters)]
    sec = statistics.median(times)
    tflops = tflops_per_gpu(num_layers=cfg.n_layer, hidden_size=cfg.n_embd, vocab_size=cfg.padded_vocab,
                            seq_length=cfg.block_size, global_batch_size=global_batch_size, sec_per_iter=sec,
                            num_gpus=1, recompute="none", ffn_hidden_size=4 * cfg.n_embd)
    out = {"loop": "peer (nanoGPT-style)" if gptpar_model is None else "gptpar GPTModel", "compiled": compile_model, "device": device_name(device),
           "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""), "config": asdict(cfg),
           "padded_vocab_size": cfg.padded_vocab, "micro_batch_size": micro_batch_size,
           "global_batch_size": global_batch_size, "micro_batches": accum, "warmup_iters": warmup,
           "warmup_s": warmup_s, "iters": iters, "sec_per_iter": times, "sec_per_iter_median": sec,
           "tokens_per_s": tokens / sec, "tflops": tflops, "losses": losses}
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    if rounds is not None:
        out["rounds"] = rounds
    if profile:
        from gptpar.training.profiling import IterationProfiler

        reports = []
        profiler = IterationProfiler(f"1-{profile}", None, 0, device, reports.append, rows=40)
        for n in range(1, profile + 1):
            profiler.before(n)
            iteration()
            profiler.after(n)
        out["profile"] = reports[0].replace("logging.profile:", f"{out['loop']} profile:", 1)
        print(out["profile"])
    return out


def run_turns(turns, iteration, timed, device, tokens_per_iteration: int) -> list:
    """bench/rounds.py's turns: in each, `turns.warmup` untimed iterations, `turns.timed` timed ones (`timed()`),
    the device's work finished, then `done` with the turn's seconds per iteration; the last adds the memory peaks
    over the whole run (`memory_peaks`). Returns the turns' records."""
    records = []
    for r in range(1, turns.rounds + 1):
        turns.wait(r)
        for _ in range(turns.warmup):
            float(iteration())
        record = {"sec_per_iter": [timed() for _ in range(turns.timed)], "tokens_per_iteration": tokens_per_iteration}
        sync(device)
        if r == turns.rounds:
            record["memory_bytes"] = memory_peaks(device)
        turns.done(r, record)
        records.append(record)
    return records


def memory_peaks(device) -> dict:
    """This process's memory peaks in bytes, labelled as the trainer's memory report labels them: on CUDA the
    caching allocator's max allocated and max reserved; on a CPU the peak resident set."""
    if device.type == "cuda":
        return {"max allocated": float(torch.cuda.max_memory_allocated(device)),
                "max reserved": float(torch.cuda.max_memory_reserved(device))}
    import resource

    return {"max resident": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or 'cpu'} ({torch.get_num_threads()} threads)"


def config_from_file(path: str):
    """(PeerConfig, micro-batch size, the model section as gptpar reads it)."""
    with open(path) as f:
        d = json.load(f)
    m, t = d["model"], d.get("training", {})
    if m.get("ffn_hidden_size") not in (None, 4 * m["hidden_size"]):
        raise SystemExit(f"{path}: the peer loop has nanoGPT's 4h MLP; ffn_hidden_size {m['ffn_hidden_size']}")
    activation = m.get("activation", "gelu")  # gptpar's default
    if activation != ACTIVATION:
        raise SystemExit(f"{path}: model.activation is {activation!r}, the peer loop's MLP computes nanoGPT's tanh "
                         f"GELU: set model.activation to {ACTIVATION!r} so that both loops train the same model")
    return PeerConfig(n_layer=m["num_layers"], n_embd=m["hidden_size"], n_head=m["num_attention_heads"],
                      block_size=m["seq_length"], vocab_size=m["vocab_size"],
                      dropout=m.get("hidden_dropout", 0.0)), t.get("micro_batch_size", 1), m


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/1.3b.json", help="gptpar config: the model shape, dropout, micro-batch")
    p.add_argument("--global-batch-size", type=int, default=32, help="sequences per iteration (default 32)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the config's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="autocast dtype (default bf16 on "
                                                                         "CUDA, fp32 on CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the whole model (nanoGPT's --compile)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--tiny", action="store_true", help="a 2 x 64 model at seq 32: seconds on a CPU (smoke)")
    p.add_argument("--gptpar", action="store_true", help="also time gptpar's GPTModel the same way (see above)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile N more iterations of each loop (top kernels, device busy share)")
    p.add_argument("--rounds", action="store_true", help="time bench/rounds.py's turns (it starts this script "
                                                         "with the environment that says which) instead of --iters")
    args = p.parse_args(argv)
    turns = None
    if args.rounds:
        from rounds import Turns  # bench/rounds.py, beside this script

        turns = Turns.from_env()
        if turns is None or args.gptpar:
            raise SystemExit("bench_peer_loop.py: --rounds runs under bench/rounds.py, without --gptpar")

    device = torch.device(args.device)
    cfg, mbs, model_section = config_from_file(args.config)
    gbs, iters, warmup = args.global_batch_size, args.iters, args.warmup
    if args.tiny:
        cfg = PeerConfig(n_layer=2, n_embd=64, n_head=2, block_size=32, vocab_size=500, dropout=0.1)
        model_section = dict(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=32, vocab_size=500,
                             hidden_dropout=0.1, attention_dropout=0.1, activation=ACTIVATION)
        mbs, gbs, iters, warmup = 2, 4, 2, 1
    mbs = args.micro_batch_size or mbs
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    kw = dict(micro_batch_size=mbs, global_batch_size=gbs, device=device, dtype=dtype, compile_model=args.compile,
              iters=iters, warmup=warmup, profile=args.profile, turns=turns)
    res = run(cfg, **kw)
    print(summary_line(res, cfg, mbs, gbs, args.compile))
    if args.gptpar:
        res = {"peer": res, "gptpar": run(cfg, gptpar_model=model_section, **kw)}
        print(summary_line(res["gptpar"], cfg, mbs, gbs, args.compile))
        res["ratio_gptpar_vs_peer_tokens_per_s"] = res["gptpar"]["tokens_per_s"] / res["peer"]["tokens_per_s"]
        print(f"gptpar / peer tokens/s ({'both compiled' if args.compile else 'both eager'}): "
              f"{res['ratio_gptpar_vs_peer_tokens_per_s']:.3f}")
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def summary_line(res: dict, cfg: PeerConfig, mbs: int, gbs: int, compiled: bool) -> str:
    return (f"{res['loop']} {'compiled' if compiled else 'eager'} | {res['device']} | {cfg.n_layer}x{cfg.n_embd} "
            f"s{cfg.block_size} mbs {mbs} gbs {gbs} {res['dtype']}: {res['sec_per_iter_median']:.3f} s/iter, "
            f"{res['tokens_per_s']:,.0f} tokens/s, {res['tflops']:.1f} TFLOPs, first {res['warmup_iters']} "
            f"iteration(s) {res['warmup_s']:.1f} s" + (f", peak {res['peak_memory_gib']:.1f} GiB"
                                                       if "peak_memory_gib" in res else ""))


if __name__ == "__main__":
    main()
