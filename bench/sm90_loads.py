"""How the compiled loss kernels load the logits on an H100, checked on a machine without a GPU.

    pip install --no-deps --target /tmp/triton triton==3.9.0      # Triton's compiler, kept out of the venv
    PYTHONPATH=/tmp/triton python bench/sm90_loads.py [--source DIR]

Inductor writes the Triton code it would run on a GPU (its `cpu_backend = "triton"`, with Triton told the device
is an sm_90 one), and Triton compiles each kernel to sm_90 PTX, where this counts the global loads and stores by
width: `ld.global...b16` loads one bf16 value, `ld.global...v4.b32` eight. Nothing runs; the launch that follows
fails and is ignored. The rows are the 1.3B config's: 50304 columns, 50257 of them real (`_real_mask`). Block sizes
are one representative choice (on a GPU inductor autotunes them). `--source DIR` checks another checkout's gptpar
(e.g. `git archive <commit> gptpar | tar -x -C DIR`). Relies on inductor's and Triton's internals (its driver
registry, `AsyncCompile.triton`); written against torch 2.13 / Triton 3.9, also run with torch 2.11 / Triton 3.6
(the GPU image's: its CUDA wheel imports on a CPU machine once its CUDA libraries are installed beside it).
"""
import argparse
import collections
import importlib.util
import os
import re
import sys
import tempfile


class _Sm90Driver:
    """What inductor asks Triton's active driver while it writes code, answered as for one H100."""

    @staticmethod
    def is_active():
        return True

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        import torch
        return torch.cpu

    def get_benchmarker(self):
        raise RuntimeError("no GPU: nothing is run")


def kernel_sources(rows: int, width: int, real: int):
    """(name, Triton source) of every kernel inductor writes for the compiled loss's forward and backward."""
    import torch
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config
    import torch._inductor.fx_passes.post_grad as post_grad
    from gptpar.tensor_parallel import cross_entropy

    inductor_config.cpu_backend, inductor_config.fx_graph_cache = "triton", False
    post_grad.prepare_softmax_extra_check = lambda match: True  # inductor's CUDA-only check for online softmax
    sources = []
    async_compile.AsyncCompile.triton = lambda self, name, source, *a, **k: sources.append((name, source))
    logits = torch.randn(rows, width, dtype=torch.bfloat16)
    target, here = torch.randint(0, real, (rows,)), torch.ones(rows, dtype=torch.bool)
    lse, g = torch.randn(rows), torch.rand(rows)
    for kernel, args in ((cross_entropy._rows_forward, (logits, target, here, real, False)),
                         (cross_entropy._rows_backward_, (logits, lse, target, here, g, real, 0.0, real))):
        torch._dynamo.reset()
        try:
            cross_entropy._compiled.__wrapped__(kernel)(*args)
        except Exception:  # noqa: BLE001 - the launch of code compiled for no device
            pass
    return sources


def sm90_memory_ops(name: str, source: str):
    """Block sizes chosen and {PTX global load/store mnemonic: count} of one inductor kernel compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = eval(re.search(r"'signature': (\{[^}]*\})", source).group(1))  # noqa: S307 - inductor's own text
    code = re.sub(r"@triton_heuristics\.\w+\((.|\n)*?\)\n@triton.jit", "@triton.jit", source, count=1)
    code = code.replace("triton_helpers.set_driver_to_cpu()", "")
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")  # triton.jit reads the function's source file
    with open(path, "w") as f:
        f.write(code)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    blocks = {"XBLOCK": 1024}
    if "YBLOCK" in signature:
        blocks = {"YBLOCK": 8, "XBLOCK": 256}
    if "R0_BLOCK" in signature:
        blocks = {"XBLOCK": 1, "R0_BLOCK": 2048}
    aligned = {(i,): [["tt.divisibility", 16]] for i, (arg, kind) in enumerate(signature.items())
               if kind.startswith("*") or arg.endswith("numel")}
    compiled = triton.compile(ASTSource(getattr(module, name), signature, constexprs=blocks, attrs=aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    return blocks, collections.Counter(re.findall(r"(?:ld|st)\.global[.:\w]*", compiled.asm["ptx"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", help="a directory holding the gptpar package to check (default: this one)")
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    sys.path.insert(0, args.source or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton.runtime import driver
    driver.set_active(_Sm90Driver())
    for name, source in kernel_sources(args.rows, 50304, 50257):
        blocks, ops = sm90_memory_ops(name, source)
        print(f"{name}\n    blocks {blocks}, 8 warps: " + ", ".join(f"{n} x {op}" for op, n in sorted(ops.items())))


if __name__ == "__main__":
    main()
