"""Tensor parallelism: communication primitives, layers, the vocab-parallel loss and RNG streams.

Names are resolved lazily, as gptpar's own, so that importing a torch-free module of this package (float8_shapes:
the float8 shape rules the estimate shares with the layers) does not import torch.
"""
from gptpar.lazy import lazy_exports

_EXPORTS = {
    "copy_to_tensor_parallel_region": "gptpar.tensor_parallel.comm",
    "reduce_from_tensor_parallel_region": "gptpar.tensor_parallel.comm",
    "scatter_to_tensor_parallel_region": "gptpar.tensor_parallel.comm",
    "gather_from_tensor_parallel_region": "gptpar.tensor_parallel.comm",
    "scatter_to_sequence_parallel_region": "gptpar.tensor_parallel.comm",
    "gather_from_sequence_parallel_region": "gptpar.tensor_parallel.comm",
    "reduce_scatter_to_sequence_parallel_region": "gptpar.tensor_parallel.comm",
    "vocab_parallel_cross_entropy": "gptpar.tensor_parallel.cross_entropy",
    "Float8Matmul": "gptpar.tensor_parallel.float8",
    "plan_float8_gemm": "gptpar.tensor_parallel.float8_shapes",
    "ColumnParallelLinear": "gptpar.tensor_parallel.layers",
    "RowParallelLinear": "gptpar.tensor_parallel.layers",
    "VocabParallelEmbedding": "gptpar.tensor_parallel.layers",
    "init_normal": "gptpar.tensor_parallel.layers",
    "RNGStatesTracker": "gptpar.tensor_parallel.random",
    "model_parallel_seed": "gptpar.tensor_parallel.random",
    "TENSOR_PARALLEL_STREAM": "gptpar.tensor_parallel.random",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
