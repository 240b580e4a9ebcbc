"""gptpar: Megatron-style tensor / pipeline / data parallel GPT training on PyTorch + DeepSpeed.

The public API, importable from the package root:

    from gptpar import init_parallel, ColumnParallelLinear, RowParallelLinear, \
        VocabParallelEmbedding, vocab_parallel_cross_entropy

Names are resolved lazily so that `import gptpar` stays fast and never imports DeepSpeed.
"""
from gptpar.lazy import lazy_exports

from gptpar.extensions_dir import use_default_extensions_dir

__version__ = "0.1.0"

# Before anything can load a DeepSpeed op: one extensions folder per venv, whichever way gptpar starts.
use_default_extensions_dir()

_EXPORTS = {
    # parallel state
    "ParallelState": "gptpar.parallel",
    "init_parallel": "gptpar.parallel",
    "single_process_state": "gptpar.parallel",
    "destroy_parallel": "gptpar.parallel",
    # tensor-parallel layers and loss
    "ColumnParallelLinear": "gptpar.tensor_parallel.layers",
    "RowParallelLinear": "gptpar.tensor_parallel.layers",
    "VocabParallelEmbedding": "gptpar.tensor_parallel.layers",
    "vocab_parallel_cross_entropy": "gptpar.tensor_parallel.cross_entropy",
    "RNGStatesTracker": "gptpar.tensor_parallel.random",
    "model_parallel_seed": "gptpar.tensor_parallel.random",
    # model
    "GPTConfig": "gptpar.model.config",
    "GPTModel": "gptpar.model.gpt",
    "build_pipeline_model": "gptpar.model.pipeline",
    "partition_layers": "gptpar.model.partition",
    # training
    "load_config": "gptpar.config",
    "build_engine": "gptpar.training.engine",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
