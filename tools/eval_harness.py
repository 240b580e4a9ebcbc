"""Evaluate a checkpoint with EleutherAI's lm-evaluation-harness, at any tensor-parallel size.

The code is gptpar/tools/eval_harness.py; `python tools/eval_harness.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.eval_harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
