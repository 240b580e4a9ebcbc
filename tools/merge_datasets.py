"""Concatenate several MMIDIDX datasets (same dtype) into one.

The code is gptpar/tools/merge_datasets.py; `python tools/merge_datasets.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.merge_datasets import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
