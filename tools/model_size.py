"""Model size, exact parameter count, and parameters per pipeline stage / tensor-parallel rank.

The code is gptpar/tools/model_size.py; `python tools/model_size.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.model_size import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
