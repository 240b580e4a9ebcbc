"""Scratch: eager vs compiled (layer.compile()) one tp-8 layer of a config, bf16 vs fp8, fwd+bwd, mode none."""
import importlib.util, sys, time, traceback
import torch
sys.path.insert(0, ".")
spec = importlib.util.spec_from_file_location("bl", "bench/bench_layer.py"); bl = importlib.util.module_from_spec(spec); spec.loader.exec_module(bl)
from gptpar.tensor_parallel.float8 import Float8Matmul
from gptpar.tensor_parallel.random import model_parallel_seed
dev = torch.device("cuda")
for cfgname in sys.argv[1:]:
    config, tp, mbs, _ = bl.config_from_file(f"configs/{cfgname}.json")
    for kind, compiled in (("bf16", True), ("fp8", True), ("rowwise", True), ("bf16", False)):
        t0 = time.perf_counter()
        layer = None
        try:
            torch._dynamo.reset()
            tracker = model_parallel_seed(0, device=dev)
            f8 = None if kind == "bf16" else Float8Matmul("rowwise" if kind == "rowwise" else "tensorwise", emulate=False)
            layer = bl.build_layer(config, tp, dev, torch.bfloat16, tracker, f8)
            if compiled:
                layer.compile()
            x = torch.randn(config.seq_length, mbs, config.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
            r = bl.time_mode(layer, "none", x, torch.randn_like(x), tracker, dev, warmup=3, iters=10)
            print(f"RESULT {cfgname} {kind} {'compiled' if compiled else 'eager'}: {r['sec_per_layer'] * 1e3:.2f} ms fwd+bwd, "
                  f"peak +{r['peak_memory_above_resident_gib']:.2f} GiB ({time.perf_counter() - t0:.0f} s incl. compile)", flush=True)
        except Exception as e:
            print(f"RESULT {cfgname} {kind} compiled={compiled}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            traceback.print_exc(limit=2)
        del layer
        torch.cuda.empty_cache()
