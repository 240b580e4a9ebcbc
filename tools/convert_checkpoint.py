"""Convert checkpoints: gptpar (any tp x pp x dp) -> Hugging Face (GPT2LMHeadModel, or BloomForCausalLM for an

The code is gptpar/tools/convert_checkpoint.py; `python tools/convert_checkpoint.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.convert_checkpoint import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
