"""What gptpar holds back by default (shown with --verbose): third-party output known to be harmless.

- FutureWarnings raised inside torch.distributed and DeepSpeed: deprecations in their own calls (DeepSpeed's
  ZeRO-1 calls `all_gather_into_tensor`), nothing a user of gptpar can act on.
- torchao's `Failed to load .../_C_*.so` warnings at import (kernel libraries built for CUDA GPUs that this torch
  cannot load; gptpar's float8 training does not use them) and torch's pytree deprecation lines the same import
  writes. transformers imports torchao whenever it builds a model, so a conversion or a generation shows them.
- DeepSpeed's `DeepSpeed ...shm_comm_op built successfully`, printed by every rank as its communication starts
  although the op was built once (by the Makefile, or the first run) and is only loaded.

DeepSpeed's INFO lines are held back by gptpar.training.engine.quiet_deepspeed_log (in the ranks) and by the
launcher's own `--log_level warning` (tools/demo.py passes it).
"""
from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import warnings
from typing import Iterator, Sequence

# Whole lines of standard output held back (see the module docstring).
KNOWN_LINES = (re.compile(r"DeepSpeed \S+ built successfully"),)


def hold_back_warnings() -> None:
    """Filter the known-harmless warnings of this process (see the module docstring); call before the imports
    that raise them."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch\.distributed|deepspeed)(\.|$)")
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


class _LineFilter(io.TextIOBase):
    """A text stream that passes every whole line to `target` but those matching one of `patterns`."""

    def __init__(self, target, patterns: Sequence[re.Pattern]):
        self.target, self.patterns, self.pending = target, patterns, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not any(p.fullmatch(line) for p in self.patterns):
                self.target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def close_pending(self) -> None:
        if self.pending:
            self.target.write(self.pending)
            self.pending = ""


@contextlib.contextmanager
def held_back_lines(patterns: Sequence[re.Pattern] = KNOWN_LINES) -> Iterator[None]:
    """Inside the block, standard output without the lines matching `patterns` (Python-level writes only)."""
    original = sys.stdout
    filtered = _LineFilter(original, patterns)
    sys.stdout = filtered
    try:
        yield
    finally:
        sys.stdout = original
        filtered.close_pending()
        original.flush()


__all__ = ["KNOWN_LINES", "hold_back_warnings", "held_back_lines"]
