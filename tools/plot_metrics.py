"""Loss curves as a picture: the metrics files of one or more runs, overlaid, against consumed tokens.

The code is gptpar/tools/plot_metrics.py; `python tools/plot_metrics.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.plot_metrics import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
