"""Write docs/config.md, the reference of every config key, from the config dataclasses (--check: exit 1 if stale).

The code is gptpar/tools/gen_config_docs.py; `python tools/gen_config_docs.py --help` says how to run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from gptpar.tools.gen_config_docs import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
