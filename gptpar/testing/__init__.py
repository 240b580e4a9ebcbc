"""What gptpar's tests, benchmarks and examples share (nothing here is used by a training run):

    harness.py         run_distributed: a function on N local gloo ranks; fork_ranks_from_server; the byte flips
                       that damage a checkpoint file (inside a tensor, or at offsets spread over the file); LiveTensorBytes, a peak-memory count without CUDA;
                       load_script, a script outside the package (bench/, tools/) imported by its path
    freeze_gc.py       imported last by the rank server of fork_ranks_from_server
    runs.py            the trainer's runs: the tiny config, ranks of pretrain_gpt.py started by hand, the trainer's
                       main inside harness ranks, and the contract's formulas written out (lr, batch ramp-up, TFLOPs)
    faults.py          pretrain_gpt.py with test-only faults injected from outside the package (FAULTS is its path)
    tiny_tokenizer.py  a small Hugging Face fast tokenizer trained on gptpar's own sources
    corpus.py          a generated multilingual jsonl corpus (prose in eight languages, code, emoji)
    indexed_reference.py  an independent reader and writer of the indexed dataset format (.bin/.idx)
    data_index_reference.py  the data index as first written (numpy and a Python loop): what the fast one must equal

ROOT is the source checkout this package was imported from: runs.py and faults.py start its pretrain_gpt.py, and the
tests read its configs/ and docs/ (pip install -e .).
"""
import os

from gptpar.testing.harness import (LiveTensorBytes, flip_a_byte_inside_a_tensor, flip_byte_at, fork_ranks_from_server,
                                    free_port, load_script, run_distributed, spread_offsets)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source checkout
FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults.py")

__all__ = ["FAULTS", "ROOT", "LiveTensorBytes", "flip_a_byte_inside_a_tensor", "flip_byte_at", "fork_ranks_from_server",
           "free_port", "load_script", "run_distributed", "spread_offsets"]
