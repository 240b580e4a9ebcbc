"""Generate text from a checkpoint, or score held-out text, at any tensor-parallel size (pp = 1).

The code is gptpar/tools/generate.py; `python tools/generate.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
