"""Rank (tp, pp, dp, micro batch) layouts for a model on N nodes by predicted seconds per iteration.

The code is gptpar/tools/plan_topology.py; `python tools/plan_topology.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.plan_topology import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
