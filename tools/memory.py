"""Memory per GPU for every pipeline stage: weights, gradients, optimizer, activations, CUDA context.

The code is gptpar/tools/memory_estimate.py; `python tools/memory.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.memory_estimate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
