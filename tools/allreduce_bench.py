"""All-reduce bandwidth over message sizes, with nccl-tests' definitions, launched like the trainer.

The code is gptpar/tools/allreduce_bench.py; `python tools/allreduce_bench.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.allreduce_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
