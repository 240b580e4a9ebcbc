"""One folder for DeepSpeed's JIT-built ops, whichever way gptpar starts.

torch builds C++ extensions (DeepSpeed's CPU communication op) into `TORCH_EXTENSIONS_DIR`, or, when it is unset,
into ~/.cache/torch_extensions. `make` used to set it to the venv's folder while the README's commands, typed by
hand, did not: the op was built twice, in two places, and a lock left in one by a killed build stopped only some
ways of starting. `import gptpar` (every entry point: pretrain_gpt.py, gptpar.launch, the tools, the tests) sets a
default when it is unset: `torch_extensions` inside the virtual environment that runs it, its real path (the same
venv reached through a symlink is one folder). Outside a (writable) virtual environment torch's own default stays. Imports
nothing heavy: it runs at `import gptpar`.
"""
from __future__ import annotations

import os
import sys
from typing import Optional


def venv_extensions_dir() -> Optional[str]:
    """`<venv>/torch_extensions` for the virtual environment of this interpreter (real path), None outside one or
    where the venv is not writable (a shared, read-only install keeps torch's per-user default)."""
    if sys.prefix == sys.base_prefix or not os.access(sys.prefix, os.W_OK):
        return None
    return os.path.join(os.path.realpath(sys.prefix), "torch_extensions")


def use_default_extensions_dir() -> None:
    """Set TORCH_EXTENSIONS_DIR to `venv_extensions_dir()` unless it is set; children started from here inherit it."""
    default = venv_extensions_dir()
    if default is not None and not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = default
