"""One transformer layer as one GPU of a tensor-parallel model sees it: seconds per layer (forward + backward)
and TFLOPs per GPU with none / selective / full recompute, written as a calibration file for the planner.

    python bench/bench_layer.py --config configs/200b.json --device cuda --json cal_h200.json
    python bench/bench_layer.py --config configs/200b.json --device cuda --dtype fp8 --json cal_h100_fp8.json
    python bench/bench_layer.py --config configs/200b.json --device cuda --dtype fp8 --compile --modes none
    python bench/bench_layer.py --tiny            # CPU smoke: a 64-wide layer at tp 2, seconds (--dtype fp8 too)
    python tools/plan_topology.py --config configs/200b.json --nodes 40 --calibration cal_h200.json

At configs/200b.json's shape and tp 8 one GPU holds hidden 14400, 96/8 = 12 heads (head dim 150) and an FFN
slice of 57600/8 = 7200: QKV (5400, 14400), attention output (14400, 1800), fc1 (7200, 14400), fc2
(14400, 7200), micro-batch 2 x seq 2048. The layer is gptpar's own `TransformerLayer`, built with a
tensor-parallel group of tp ranks from torch's *fake* process group: this one process holds rank 0's shards,
and every collective returns at once without moving data. **The tensor-parallel all-reduces are excluded**
(per layer 2 forward + 2 backward of s x b x h values, 2 more under full recompute); the planner adds them
from its bandwidth model. Parameters are in the config's precision (bf16: DeepSpeed's bf16 mode keeps the
module in bf16), the input (s, b, h) requires grad as inside a pipeline stage, the backward gets a random
output gradient; no optimizer step. Modes: `none`; `selective` (the layer recomputes its attention core);
`full` (gptpar's tracker-aware checkpoint around the layer, as the trainer does).

`--dtype fp8` is training.precision fp8: bf16 parameters with the four GEMMs in float8 through torchao
(`--fp8-recipe` tensorwise | rowwise; gptpar.tensor_parallel.float8), padded or kept in bf16 as the run would (at
200B tp 8 query_key_value and dense are padded: the JSON's `float8_gemms` says so). Without CUDA it runs torchao's
emulation, whose times say nothing about float8 speed (the CPU smoke only checks that it runs).

Under fp8 with the tensorwise recipe `sec_per_layer` is the layer as a training step's micro-batches see it: the
weights' float8 casts made once (gptpar.tensor_parallel.float8.refresh_float8_weights, as TrainEngine does per
optimizer step) and read from the cache; `sec_per_layer_uncached`, timed first in the same run, casts them every
micro-batch (forward and backward), as rowwise does.

`--compile` compiles the layer as training.compile does (gptpar.model.gpt.compile_transformer_layers): float8
GEMMs pay only compiled (their casts and scales are fused then; eager fp8 was 2.6x slower than bf16 on an H100).

TFLOPs per GPU = gptpar.estimate.flops.model_flops_per_iteration for one layer and this micro-batch (no vocab), / tp,
counting each mode's recompute as the trainer's log line does (`tflops`), and without it (`model_tflops`,
MFU-style useful work). Times are medians of --iters forward + backward passes after --warmup, between
device synchronisations. The JSON (--json) is the calibration file `gptpar.estimate.planner.load_calibration` reads.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gptpar.estimate.flops import model_flops_per_iteration  # noqa: E402
from gptpar.model.config import RECOMPUTE_MODES, GPTConfig  # noqa: E402
from gptpar.model.gpt import TransformerLayer  # noqa: E402
from gptpar.tensor_parallel.float8 import GEMM_NAMES  # noqa: E402
from gptpar.tensor_parallel.random import checkpoint, model_parallel_seed  # noqa: E402

CALIBRATION_VERSION = 1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}


def fake_tp_group(tp: int):
    """A process group of `tp` ranks in which this process is rank 0 and no collective moves data."""
    if tp == 1:
        return None
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    if dist.get_world_size() != tp:
        raise RuntimeError(f"a process group of {dist.get_world_size()} ranks exists already; need {tp}")
    return dist.group.WORLD


def build_layer(config: GPTConfig, tp: int, device, dtype, tracker, float8=None) -> TransformerLayer:
    """Rank 0's shard of one layer, allocated directly on the device (the seeded full-size init that gptpar
    slices per rank would need the whole 200B layer in host memory); N(0, 0.02) weights, unit LayerNorms.
    `float8`: a gptpar.tensor_parallel.float8.Float8Matmul for the fp8 GEMMs."""
    layer = TransformerLayer(config, 0, tp_group=fake_tp_group(tp), rng_tracker=tracker, float8=float8,
                             device="meta", dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, config.init_method_std)
            elif "layernorm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
    return layer.train()


def sdpa_backends(config: GPTConfig, tp: int, mbs: int, device, dtype) -> dict:
    """Which SDPA kernels accept this rank's attention (b, nh/tp, s, d) with the model's dropout, causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    nh, d, s = config.num_attention_heads // tp, config.head_dim, config.seq_length
    q = torch.randn(mbs, nh, s, d, device=device, dtype=dtype, requires_grad=True)
    out = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with sdpa_kernel([backend]):
                y = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=config.attention_dropout,
                                                                     is_causal=True)
                y.sum().backward()
            out[name.lower()] = "ok"
        except Exception as e:  # noqa: BLE001 - "not eligible" comes as RuntimeError with the reason
            out[name.lower()] = f"unavailable: {str(e).splitlines()[0][:160]}"
        q.grad = None
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_mode(layer, mode: str, x, grad, tracker, device, warmup: int, iters: int) -> dict:
    layer.recompute_core_attention = mode == "selective"

    def step():
        y = checkpoint(layer, x, tracker=tracker) if mode == "full" else layer(x)
        y.backward(grad)
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    for _ in range(warmup):
        step()
    sync(device)
    out = {}
    if device.type == "cuda":   # the activations (and the gradients) one fwd + bwd adds to what is resident
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        out["peak_memory_above_resident_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 30
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    out.update(sec_per_layer=statistics.median(times), sec_per_layer_all=times)
    return out


def outputs(layer, mode: str, x, grad, tracker) -> dict:
    """One forward + backward: the output, the input's and the first weight's gradients (fp32 copies)."""
    y = checkpoint(layer, x, tracker=tracker) if mode == "full" else layer(x)
    y.backward(grad)
    weight = next(p for p in layer.parameters() if p.dim() == 2)
    out = {"output": y.detach().float(), "input_grad": x.grad.float(), "weight_grad": weight.grad.float()}
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    return out


def layer_flops_per_gpu(config: GPTConfig, tp: int, mbs: int, mode) -> float:
    """FLOPs of one layer's forward + backward (+ the mode's recompute) for one micro-batch, on one of tp GPUs."""
    return model_flops_per_iteration(num_layers=1, hidden_size=config.hidden_size, vocab_size=0,
                                     seq_length=config.seq_length, global_batch_size=mbs, recompute=mode,
                                     ffn_hidden_size=config.ffn_hidden_size) / tp


def run(config: GPTConfig, *, tp: int, mbs: int, device, dtype, modes, warmup: int, iters: int, seed: int = 0,
        fp8_recipe=None, compile: bool = False) -> dict:
    """`fp8_recipe` (tensorwise | rowwise): the GEMMs in float8 (bf16 `dtype` around them); None: in `dtype`.
    `compile`: the layer compiled as training.compile does (the first warm-up pass compiles)."""
    tracker = model_parallel_seed(seed, device=device)
    float8 = None
    if fp8_recipe is not None:
        from gptpar.tensor_parallel.float8 import Float8Matmul

        float8 = Float8Matmul(fp8_recipe, emulate=device.type != "cuda")
    layer = build_layer(config, tp, device, dtype, tracker, float8)
    if compile:
        from gptpar.model.gpt import compile_transformer_layers

        compile_transformer_layers(layer)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, s = config.hidden_size, config.seq_length
    x = torch.randn(s, mbs, h, device=device, dtype=dtype, generator=gen).requires_grad_()
    grad = torch.randn(s, mbs, h, device=device, dtype=dtype, generator=gen)
    cached = float8 is not None and float8.caches_weights
    results = {}
    for mode in modes:
        uncached = None
        if cached:  # the weights cast per micro-batch (no cache), then as training's micro-batches see them
            from gptpar.tensor_parallel.float8 import invalidate_float8_weights, refresh_float8_weights

            invalidate_float8_weights(layer, free=True)
            uncached = time_mode(layer, mode, x, grad, tracker, device, warmup, iters)
            rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                   tracker.get_states())
            before = outputs(layer, mode, x, grad, tracker)
            refresh_float8_weights(layer)  # once, as TrainEngine does at the start of a step
        r = time_mode(layer, mode, x, grad, tracker, device, warmup, iters)
        if uncached is not None:
            torch.set_rng_state(rng[0])  # the same dropout draws as `before`'s
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], device)
            tracker.set_states(rng[2])
            after = outputs(layer, mode, x, grad, tracker)
            r.update(sec_per_layer_uncached=uncached["sec_per_layer"],
                     sec_per_layer_uncached_all=uncached["sec_per_layer_all"],
                     cached_vs_uncached_max_abs_diff={k: (after[k] - before[k]).abs().max().item() for k in before})
        r["flops_per_layer_per_gpu"] = layer_flops_per_gpu(config, tp, mbs, mode)
        r["tflops"] = r["flops_per_layer_per_gpu"] / r["sec_per_layer"] / 1e12
        r["model_tflops"] = layer_flops_per_gpu(config, tp, mbs, "none") / r["sec_per_layer"] / 1e12
        results[mode] = r
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "kind": "gptpar layer calibration", "version": CALIBRATION_VERSION,
        "gpu": gpu or f"cpu: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)",
        "device": device.type,
        "gpu_mem_gib": (torch.cuda.get_device_properties(device).total_memory / 2 ** 30 if gpu else None),
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dtype": str(dtype).replace("torch.", ""), "compiled": compile,
        "float8": float8.describe() if float8 is not None else None,
        "float8_gemms": ([getattr(layer, name).float8_gemm.describe(name) for name in GEMM_NAMES]
                         if float8 is not None else None),
        "float8_weight_cache_bytes": (sum(getattr(layer, name).float8_weight_cache.nbytes for name in GEMM_NAMES
                                          if getattr(layer, name).float8_weight_cache is not None)
                                      if float8 is not None else None),
        "shape": {"hidden_size": h, "num_attention_heads": config.num_attention_heads,
                  "ffn_hidden_size": config.ffn_hidden_size, "seq_length": s, "micro_batch_size": mbs,
                  "tp_size": tp, "heads_per_rank": config.num_attention_heads // tp,
                  "ffn_per_rank": config.ffn_hidden_size // tp, "head_dim": config.head_dim,
                  "attention_dropout": config.attention_dropout, "hidden_dropout": config.hidden_dropout},
        "tp_communication": "excluded: fake process group, every all-reduce returns without moving data",
        "sdpa_backends": sdpa_backends(config, tp, mbs, device, dtype),
        "warmup": warmup, "iters": iters, "modes": results,
    }


def config_from_file(path: str):
    with open(path) as f:
        d = json.load(f)
    m = dict(d["model"])
    m["num_layers"] = 1
    keep = {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
            "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by", "hidden_dropout",
            "attention_dropout", "layernorm_epsilon", "init_method_std", "activation"}
    t, par = d.get("training", {}), d.get("parallel", {})
    return (GPTConfig(**{k: v for k, v in m.items() if k in keep}), par.get("tensor_model_parallel_size", 1),
            t.get("micro_batch_size", 1), t.get("precision", "bf16"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/200b.json", help="model shape, tp, micro-batch, precision")
    p.add_argument("--tp", type=int, default=None, help="default: the config's tensor_model_parallel_size")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the config's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: the config's precision on CUDA, fp32 on CPU; fp8 = bf16 with float8 GEMMs")
    p.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise"), default="tensorwise",
                   help="with --dtype fp8: torchao's scaling recipe")
    p.add_argument("--compile", action="store_true", help="compile the layer as training.compile does")
    p.add_argument("--modes", default=",".join(RECOMPUTE_MODES), help="comma-separated: none,selective,full")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="write the calibration file here")
    p.add_argument("--tiny", action="store_true", help="64 wide, 8 heads, seq 32, tp 2: seconds on a CPU")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    config, tp, mbs, precision = config_from_file(args.config)
    warmup, iters = args.warmup, args.iters
    if args.tiny:
        config = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=8, seq_length=32, vocab_size=128,
                           attention_dropout=0.1, hidden_dropout=0.1)
        tp, mbs, warmup, iters = 2, 2, 1, 3
        if device.type == "cpu":   # at this size a second thread only waits at every op's barrier (and on a
            torch.set_num_threads(1)   # shared machine for a descheduled peer: ~8 ms per op, measured)
    tp, mbs = args.tp or tp, args.micro_batch_size or mbs
    config.check_parallel(tp, 1)
    name = args.dtype or (precision if device.type == "cuda" else "fp32")
    dtype = DTYPES[name]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in RECOMPUTE_MODES:
            raise SystemExit(f"--modes: {m!r} is not one of {RECOMPUTE_MODES}")
    res = run(config, tp=tp, mbs=mbs, device=device, dtype=dtype, modes=modes, warmup=warmup, iters=iters,
              fp8_recipe=args.fp8_recipe if name == "fp8" else None, compile=args.compile)
    sh = res["shape"]
    if res["float8"]:
        print(f"{res['float8']}\n  " + "\n  ".join(res["float8_gemms"]))
    print(f"{res['gpu']} | {res['dtype']}{' + float8 GEMMs' if res['float8'] else ''}"
          f"{', compiled' if res['compiled'] else ''} | one layer at tp {tp}: "
          f"hidden {sh['hidden_size']}, {sh['heads_per_rank']} "
          f"heads x {sh['head_dim']}, ffn slice {sh['ffn_per_rank']}, mbs {mbs}, seq {sh['seq_length']} "
          f"(tp all-reduces excluded)")
    print(f"sdpa kernels: {', '.join(k for k, v in res['sdpa_backends'].items() if v == 'ok')}")
    for mode, r in res["modes"].items():
        mem = (f", +{r['peak_memory_above_resident_gib']:.2f} GiB peak" if "peak_memory_above_resident_gib" in r
               else "")
        print(f"  {mode:<9} {r['sec_per_layer'] * 1e3:9.3f} ms per layer fwd+bwd, {r['tflops']:8.2f} TFLOPs/GPU "
              f"({r['model_tflops']:.2f} without recompute){mem}")
        if "sec_per_layer_uncached" in r:
            print(f"  {'':<9} {r['sec_per_layer_uncached'] * 1e3:9.3f} ms with the weights cast every micro-batch "
                  f"(above: cast once per step, {res['float8_weight_cache_bytes'] / 2 ** 20:.1f} MiB cached)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"calibration written to {args.json}")


if __name__ == "__main__":
    main()
