"""Tensor parallelism: communication primitives, layers, the vocab-parallel loss and RNG streams."""
from gptpar.tensor_parallel.comm import (
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region)
from gptpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from gptpar.tensor_parallel.float8 import Float8Matmul, plan_float8_gemm
from gptpar.tensor_parallel.layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, init_normal)
from gptpar.tensor_parallel.random import TENSOR_PARALLEL_STREAM, RNGStatesTracker, model_parallel_seed

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "init_normal", "Float8Matmul", "plan_float8_gemm", "RNGStatesTracker", "model_parallel_seed", "TENSOR_PARALLEL_STREAM",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region", "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
]
