"""Single-rank training speed: gptpar's GPTModel against Hugging Face GPT2LMHeadModel, and MFU.

    python bench/bench_single_rank.py                 # 6x384 s256 b8 and 12x768 s512 b4, fp32, + bf16 (~5 min, 2 cores)
    python bench/bench_single_rank.py --tiny          # seconds; the smoke test runs this
    python bench/bench_single_rank.py --device cuda --dtype bf16 --config configs/1.3b.json   # a GPU, ~1.3B, seq 2048
    bash bench/gpu.sh calibrate                       # on a GPU: per recompute mode, beside the layer calibration

Both models live in one process with the same thread count, shapes (layers, hidden, heads, vocab, seq,
micro-batch), dropout 0, the same activation (exact GELU) and the same optimizer (gptpar's `make_adamw`,
i.e. torch AdamW, which is also what Hugging Face's Trainer uses by default). One training step is
forward + backward + AdamW step + zero_grad. After warm-up, each round times one step of each model,
alternating which goes first, and one large `torch.matmul` (the machine's matmul peak for that dtype and
thread count); every figure is a median over rounds, the speed ratio is the median of the per-round ratios.
The `best` columns (MFU of the best round, ratio of the fastest steps) are printed beside them because on a
shared machine contention only ever adds time.
No DeepSpeed is involved, so this runs on a GPU machine without it; transformers is optional (`--no-hf`).

MFU = model FLOPs per step (gptpar.estimate.flops.model_flops_per_iteration, no recompute, gptpar's padded vocab) /
step time / the measured matmul peak. That count charges full (s x s) attention; the kernels compute the
causal half only, so the "causal" column subtracts the half they skip. `--breakdown` also times the model's
GEMMs and its attention alone: their sum is a floor on the step time, hence a ceiling on MFU.

bf16 means the usual mixed precision: fp32 parameters and AdamW, `torch.autocast(dtype=bfloat16)`.
"""
import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from gptpar.estimate.flops import model_flops_per_iteration  # noqa: E402
from gptpar.model.config import GPTConfig  # noqa: E402
from gptpar.model.gpt import GPTModel, compile_transformer_layers  # noqa: E402
from gptpar.model.kernels import make_adamw  # noqa: E402

HF_TARGET, MFU_TARGET_CPU, MFU_TARGET_GPU = 1.15, 0.90, 0.50
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int

    @property
    def name(self) -> str:
        return f"{self.layers}x{self.hidden} s{self.seq} b{self.batch}"

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """'LxHxSxB' (heads = H/64) or 'LxHxSxBxNH'."""
        parts = [int(p) for p in text.lower().split("x")]
        if len(parts) == 4:
            parts.append(max(1, parts[1] // 64))
        layers, hidden, seq, batch, heads = parts
        return cls(layers, hidden, heads, seq, batch)


def gptpar_config(shape: Shape, vocab_size: int) -> GPTConfig:
    return GPTConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                     seq_length=shape.seq, vocab_size=vocab_size, activation="gelu")


def model_flops(shape: Shape, config: GPTConfig, causal: bool = False) -> float:
    """gptpar's count for one step (no recompute); `causal` drops the half of QK^T and AV that a causal kernel skips."""
    flops = model_flops_per_iteration(num_layers=shape.layers, hidden_size=shape.hidden,
                                      vocab_size=config.padded_vocab_size(1), seq_length=shape.seq,
                                      global_batch_size=shape.batch, recompute=False,
                                      ffn_hidden_size=config.ffn_hidden_size)
    if causal:  # 4sh per token and layer forward (QK^T and AV), x3 with backward, half of it skipped
        flops -= 0.5 * 3 * shape.layers * 4 * shape.seq * shape.hidden * shape.batch * shape.seq
    return flops


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MatmulPeak:
    """A large n x n matmul in `dtype`: the attainable matmul rate with this process's threads / this GPU."""

    def __init__(self, n: int, dtype, device, repeats: int):
        self.n, self.device, self.repeats = n, device, repeats
        self.a = torch.randn(n, n, device=device).to(dtype)
        self.b = torch.randn(n, n, device=device).to(dtype)
        self.c = torch.empty(n, n, device=device, dtype=dtype)
        self.inner = 20 if device.type == "cuda" else 1  # GPU matmuls take ~1 ms: time a burst
        self.measure()  # warm-up

    def measure(self) -> float:
        """Best FLOP/s of `repeats` tries (the peak is a best case by definition)."""
        best = 0.0
        for _ in range(self.repeats):
            sync(self.device)
            start = time.perf_counter()
            for _ in range(self.inner):
                torch.matmul(self.a, self.b, out=self.c)
            sync(self.device)
            best = max(best, 2 * self.n ** 3 * self.inner / (time.perf_counter() - start))
        return best


def make_step(model, forward, optimizer, autocast_dtype, device):
    """One training step: forward, backward, AdamW step, zero_grad."""
    def step():
        ctx = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
        with ctx:
            loss = forward()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def build_gptpar(shape, vocab_size, tokens, device, autocast_dtype, activation_checkpointing="none",
                 compile_layers=False):
    config = gptpar_config(shape, vocab_size)
    model = GPTModel(config, device=device, activation_checkpointing=activation_checkpointing).train()
    if compile_layers:
        # training.compile: the transformer layers through one torch.compile'd function (inductor fuses the
        # LayerNorms, GELU, residual adds and casts around the matmuls); one graph for all the layers.
        compile_transformer_layers(model)
    opt = make_adamw(model.parameters(), lr=1e-4, weight_decay=0.01, device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return make_step(model, lambda: model(x, labels=y), opt, autocast_dtype, device), config


def build_hf(shape, vocab_size, tokens, device, autocast_dtype):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()

    cfg = GPT2Config(vocab_size=vocab_size, n_positions=shape.seq, n_embd=shape.hidden, n_layer=shape.layers,
                     n_head=shape.heads, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, layer_norm_epsilon=1e-5, use_cache=False,
                     bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, loss_type="ForCausalLM")
    cfg._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(cfg).to(device).train()
    opt = make_adamw(model.parameters(), lr=1e-4, weight_decay=0.01, device=device)
    x = tokens[:, :-1]  # HF shifts the labels itself: the same b x s tokens in, the same logits computed
    return make_step(model, lambda: model(input_ids=x, labels=x, use_cache=False).loss, opt, autocast_dtype, device)


def timed(step, device) -> float:
    sync(device)
    start = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - start


def bench_shape(shape: Shape, *, vocab_size, dtype, device, with_hf, rounds, warmup, peak_n, peak_repeats,
                mfu_target, profile=False, activation_checkpointing="none", compile_layers=False) -> dict:
    """Alternating rounds of gptpar / HF steps and a peak matmul; medians of each and of per-round ratios."""
    autocast_dtype = None if dtype == torch.float32 else dtype
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (shape.batch, shape.seq + 1), generator=gen).to(device)
    runners = {}
    torch.manual_seed(0)
    runners["gptpar"], config = build_gptpar(shape, vocab_size, tokens, device, autocast_dtype,
                                             activation_checkpointing, compile_layers)
    if with_hf:
        runners["hf"] = build_hf(shape, vocab_size, tokens, device, autocast_dtype)
    peak = MatmulPeak(peak_n, dtype, device, peak_repeats)
    peak_mem = {}
    for n, step in runners.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(warmup):
            step()
        if device.type == "cuda":  # includes the other model's resident states: compare the two, not absolutes
            peak_mem[n] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    names = list(runners)
    times = {n: [] for n in names}
    peaks = []
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            times[n].append(timed(runners[n], device))
        peaks.append(peak.measure())
    flops, flops_causal = model_flops(shape, config), model_flops(shape, config, causal=True)
    tokens_per_step = shape.batch * shape.seq
    out = {"shape": asdict(shape), "name": shape.name, "dtype": str(dtype).replace("torch.", ""),
           "compiled": compile_layers, "recompute": activation_checkpointing,
           "vocab_size": vocab_size, "padded_vocab_size": config.padded_vocab_size(1),
           "flops_per_step": flops, "flops_per_step_causal": flops_causal,
           "peak_flops_median": statistics.median(peaks), "peak_flops": peaks, "peak_matmul_n": peak_n,
           "rounds": rounds,
           "mfu_target": mfu_target}
    for n in names:
        out[n] = {
            "step_s": times[n], "step_s_median": statistics.median(times[n]),
            "tokens_per_s": tokens_per_step / statistics.median(times[n]),
            "mfu": statistics.median(flops / t / p for t, p in zip(times[n], peaks)),
            "mfu_causal": statistics.median(flops_causal / t / p for t, p in zip(times[n], peaks)),
            "tflops": flops / statistics.median(times[n]) / 1e12,
            # Contention only ever adds time: the best round is the least disturbed one.
            "mfu_best_round": max(flops / t / p for t, p in zip(times[n], peaks)),
        }
        if n in peak_mem:
            out[n]["peak_memory_gib"] = peak_mem[n]
    if with_hf:
        out["ratio"] = statistics.median(h / g for g, h in zip(times["gptpar"], times["hf"]))
        out["ratio_best"] = min(times["hf"]) / min(times["gptpar"])  # fastest step of each
        out["hf_target"] = HF_TARGET
    if profile:
        for n in names:
            print(f"profile of one {n} step, {shape.name} {out['dtype']} (self time per op, top 15):")
            print(profile_step(runners[n], device))
    del runners
    return out


def profile_step(step, device, rows: int = 15) -> str:
    """torch.profiler over one step: where the time goes, by operator (by kernel time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=50)


def breakdown(shape: Shape, vocab_size: int, dtype, device, peak_n: int, repeats: int = 3) -> dict:
    """The step's two big parts timed alone: every GEMM of the model (forward and both backward products,
    F.linear's (out, in) layout) and causal SDPA forward + backward, each the best of `repeats`, beside the
    matmul peak. Their sum is a floor on the step time, so flops / sum / peak is a ceiling on MFU."""
    t, h, v = shape.batch * shape.seq, shape.hidden, vocab_size
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            times.append(timed(fn, device))
        return min(times)

    gemm_s, gemm_flops = 0.0, 0.0
    for k, n, per_step in ((h, 3 * h, shape.layers), (h, h, shape.layers), (h, 4 * h, shape.layers),
                           (4 * h, h, shape.layers), (h, v, 1)):
        x, w, gy = rand(t, k), rand(n, k), rand(t, n)
        one = best(lambda: torch.nn.functional.linear(x, w)) + best(lambda: gy @ w) + best(lambda: gy.t() @ x)
        gemm_s += per_step * one
        gemm_flops += per_step * 3 * 2 * t * k * n
    nh, d = shape.heads, shape.hidden // shape.heads
    q, k_, v_ = (rand(shape.batch, nh, shape.seq, d).requires_grad_() for _ in range(3))
    grad = rand(shape.batch, nh, shape.seq, d)

    def attention():
        out = torch.nn.functional.scaled_dot_product_attention(q, k_, v_, is_causal=True)
        torch.autograd.grad(out, (q, k_, v_), grad)
    attention_s = shape.layers * best(attention)
    peak = MatmulPeak(peak_n, dtype, device, repeats).measure()
    return {"gemm_s": gemm_s, "gemm_tflops": gemm_flops / gemm_s / 1e12,
            "gemm_fraction_of_peak": gemm_flops / gemm_s / peak, "attention_s": attention_s,
            "peak_tflops": peak / 1e12, "floor_s": gemm_s + attention_s,
            "attention_flops_causal": shape.layers * 3 * 2 * shape.batch * shape.seq ** 2 * h}


def print_table(results):
    print(f"{'shape':<20} {'dtype':<9} {'model':<10} {'step s':>7} {'tokens/s':>9} {'TFLOP/s':>8} "
          f"{'peak':>7} {'MFU':>6} {'causal':>7} {'best':>6} {'vs HF':>7} {'best':>6}")
    for res in results:
        for n in ("gptpar", "hf"):
            if n not in res:
                continue
            m = res[n]
            ratio = f"{res['ratio']:.3f}x" if n == "gptpar" and "ratio" in res else ""
            best = f"{res['ratio_best']:.2f}x" if n == "gptpar" and "ratio" in res else ""
            label = "gptpar+tc" if n == "gptpar" and res.get("compiled") else n  # tc: torch.compile
            print(f"{res['name']:<20} {res['dtype']:<9} {label:<10} {m['step_s_median']:>7.3f} "
                  f"{m['tokens_per_s']:>9.0f} {m['tflops']:>8.3f} {res['peak_flops_median'] / 1e12:>7.3f} "
                  f"{m['mfu']:>6.1%} {m['mfu_causal']:>7.1%} {m['mfu_best_round']:>6.1%} {ratio:>7} {best:>6}")


def summary_line(results, mfu_shape: str) -> str:
    parts = []
    compared = [r for r in results if "ratio" in r]
    if compared:
        worst = min(compared, key=lambda r: r["ratio"])
        ratios = ", ".join(f"{r['name']} {r['ratio']:.2f}x (fastest steps {r['ratio_best']:.2f}x)" for r in compared)
        parts.append(f"gptpar/HF tokens/s {ratios} (target >= {HF_TARGET:.2f}x: "
                     f"{'met' if worst['ratio'] >= HF_TARGET else 'NOT met'})")
    mfu_rows = [r for r in results if r["name"] == mfu_shape] or results[-1:]
    for r in mfu_rows:
        m = r["gptpar"]["mfu"]
        parts.append(f"MFU {r['name']} {r['dtype']} {m:.1%} (target >= {r['mfu_target']:.0%}: "
                     f"{'met' if m >= r['mfu_target'] else 'NOT met'})")
    return "summary: " + "; ".join(parts)


def shapes_from_config(path: str, batch: int = None) -> Shape:
    with open(path) as f:
        d = json.load(f)
    m, t = d["model"], d.get("training", {})
    return Shape(m["num_layers"], m["hidden_size"], m["num_attention_heads"], m["seq_length"],
                 batch or t.get("micro_batch_size", 1)), m.get("vocab_size", 50257)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="6x384x256x8,12x768x512x4",
                   help="comma-separated LxHxSxB (layers x hidden x seq x micro-batch; heads = hidden/64)")
    p.add_argument("--bf16-shapes", default="6x384x256x8",
                   help="shapes also run in bf16 for gptpar alone on the CPU ('' to skip)")
    p.add_argument("--config", default=None, help="take the one shape from a gptpar JSON config (model section)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch with --config (default: its micro_batch_size)")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (CPU)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-n", type=int, default=None, help="matmul size for the peak (default 4096 CPU fp32, "
                                                            "2048 CPU bf16, 8192 GPU)")
    p.add_argument("--no-hf", action="store_true", help="gptpar alone (the default on a GPU)")
    p.add_argument("--hf", action="store_true", help="compare against Hugging Face on a GPU too (two 1.3B models "
                                                       "with AdamW peaked at 50.5 GiB on an H200)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="gptpar's activation recompute: the attention core (selective) or whole layers (full); "
                        "MFU still counts no recompute")
    p.add_argument("--activation-checkpointing", action="store_const", const="full", dest="recompute",
                   help="the same as --recompute full")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the model's GEMMs and attention alone: a floor on the step time, a ceiling on MFU")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile gptpar's transformer layers (Hugging Face stays eager)")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step per model")
    p.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    vocab_size = args.vocab_size
    if args.config:
        shape, vocab_size = shapes_from_config(args.config, args.batch)
        shapes = [shape]
    else:
        shapes = [Shape.parse(s) for s in args.shapes.split(",") if s]
    bf16_shapes = [Shape.parse(s) for s in args.bf16_shapes.split(",") if s] if device.type == "cpu" else []
    if dtype != torch.float32:
        bf16_shapes = []
    rounds, warmup = args.rounds, args.warmup
    if args.tiny:
        shapes, bf16_shapes, vocab_size, rounds, warmup = [Shape(2, 64, 2, 32, 2)], [Shape(2, 64, 2, 32, 2)], 500, 2, 1

    with_hf = not args.no_hf and (device.type == "cpu" or args.hf)
    if with_hf:
        try:
            import transformers
            hf_version = transformers.__version__
        except ImportError:
            print("transformers is not installed: gptpar alone")
            with_hf, hf_version = False, None
    else:
        hf_version = None

    def peak_n(dt):
        if args.peak_n:
            return args.peak_n
        if args.tiny:
            return 256
        return 8192 if device.type == "cuda" else (4096 if dt == torch.float32 else 2048)

    mfu_target = MFU_TARGET_GPU if device.type == "cuda" else MFU_TARGET_CPU
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(f"device {gpu or platform.processor() or 'cpu'} | torch {torch.__version__} | threads "
          f"{torch.get_num_threads()} | transformers {hf_version} | rounds {rounds} | load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    results = []
    for shape in shapes:
        results.append(bench_shape(shape, vocab_size=vocab_size, dtype=dtype, device=device, with_hf=with_hf,
                                   rounds=rounds, warmup=warmup, peak_n=peak_n(dtype), peak_repeats=3,
                                   mfu_target=mfu_target, profile=args.profile,
                                   activation_checkpointing=args.recompute,
                                   compile_layers=args.compile))
        print_table(results[-1:])
        if args.breakdown:
            b = breakdown(shape, results[-1]["padded_vocab_size"], dtype, device, peak_n(dtype))
            res = results[-1]
            b["mfu_ceiling"] = res["flops_per_step"] / b["floor_s"] / (b["peak_tflops"] * 1e12)
            res["breakdown"] = b
            print(f"breakdown {shape.name}: GEMMs alone {b['gemm_s']:.3f} s ({b['gemm_tflops']:.3f} TFLOP/s, "
                  f"{b['gemm_fraction_of_peak']:.0%} of the {b['peak_tflops']:.3f} peak) + causal attention alone "
                  f"{b['attention_s']:.3f} s ({b['attention_flops_causal'] / b['attention_s'] / 1e12:.3f} TFLOP/s) "
                  f"= {b['floor_s']:.3f} s vs the step's {res['gptpar']['step_s_median']:.3f} s; MFU ceiling "
                  f"{b['mfu_ceiling']:.1%}")
    for shape in bf16_shapes:
        results.append(bench_shape(shape, vocab_size=vocab_size, dtype=torch.bfloat16, device=device,
                                   with_hf=False, rounds=max(2, rounds - 2), warmup=1,
                                   peak_n=peak_n(torch.bfloat16), peak_repeats=2, mfu_target=mfu_target))
    print()
    print_table(results)
    fp = [r for r in results if r["dtype"] == str(dtype).replace("torch.", "")]
    mfu_shape = "12x768 s512 b4" if device.type == "cpu" else fp[-1]["name"]
    line = summary_line(fp, mfu_shape)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": gpu or platform.processor() or "cpu", "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "transformers": hf_version, "results": results,
                       "summary": line, "load_average_end": os.getloadavg()[0]}, f, indent=1)


if __name__ == "__main__":
    main()
