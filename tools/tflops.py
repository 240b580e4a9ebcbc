"""TFLOPs per GPU from seconds per iteration, or recomputed for every line of a Megatron-format log.

The code is gptpar/tools/tflops.py; `python tools/tflops.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.tflops import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
