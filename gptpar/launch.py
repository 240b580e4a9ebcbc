"""torchrun that ends quietly when it is stopped: `python -m gptpar.launch [torchrun options] script [args]`.

    python -m gptpar.launch --nproc_per_node 2 pretrain_gpt.py --config configs/cpu_dp2.json

torchrun forwards SIGTERM / SIGINT to the ranks and waits for them (30 s, then SIGKILL); gptpar's ranks finish
the iteration, save a checkpoint and exit 0. torchrun itself then raises `SignalException` and prints a
traceback, which reads like a crash of a run that stopped as asked. This wrapper is torchrun (same options,
same agent, same environment for the ranks) that prints one line instead and exits 128 + the signal number,
as a shell reports a signalled command. Everything else torchrun does or prints is unchanged.
"""
from __future__ import annotations

import signal
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(list(sys.argv[1:] if argv is None else argv))
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        print(f"gptpar.launch: torchrun received {sig.name} and passed it to the ranks, which save after their "
              "current iteration and exit (see the ranks' last lines)", file=sys.stderr, flush=True)
        return 128 + int(sig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
