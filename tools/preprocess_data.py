"""Tokenise a jsonl corpus into Megatron-compatible MMIDIDX files, one pair per json key.

The code is gptpar/tools/preprocess_data.py; `python tools/preprocess_data.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.preprocess_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
