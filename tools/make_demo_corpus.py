"""Write a jsonl corpus of real text already on this machine: the Python standard library's sources.

The code is gptpar/tools/make_demo_corpus.py; `python tools/make_demo_corpus.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.make_demo_corpus import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
