"""`make demo`: train a small GPT on real text over 2 CPU (gloo) ranks, show the log lines, save a checkpoint.

The code is gptpar/tools/demo.py; `python tools/demo.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.demo import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
