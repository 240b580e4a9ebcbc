"""Train a SentencePiece tokenizer (BPE or unigram) from jsonl or plain-text files.

The code is gptpar/tools/train_tokenizer.py; `python tools/train_tokenizer.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.train_tokenizer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
