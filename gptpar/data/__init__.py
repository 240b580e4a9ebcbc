"""The data pipeline: tokenizer, Megatron MMIDIDX files, GPT samples with blending, masks (see docs/data.md).

    from gptpar.data import load_tokenizer, build_train_valid_test_datasets, build_batch

Names resolve lazily, so importing the numpy-only parts never imports torch.
"""
from gptpar.lazy import lazy_exports

_EXPORTS = {
    "DataError": "gptpar.data.indexed",
    "IndexedDataset": "gptpar.data.indexed",
    "IndexedDatasetBuilder": "gptpar.data.indexed",
    "load_tokenizer": "gptpar.data.tokenizer",
    "build_train_valid_test_datasets": "gptpar.data.gpt_dataset",
    "build_masks": "gptpar.data.masks",
    "build_batch": "gptpar.data.masks",
    "random_prefix_lengths": "gptpar.data.masks",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
