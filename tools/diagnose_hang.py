"""Name the rank a hung or failed job waited for, from the files its ranks wrote (gptpar.training.diagnostics):

The code is gptpar/tools/diagnose_hang.py; `python tools/diagnose_hang.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.diagnose_hang import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
