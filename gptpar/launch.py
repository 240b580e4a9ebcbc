"""torchrun that restarts crashed ranks, stops on a refusal and ends in one line:
`python -m gptpar.launch [torchrun options] script [args]`.

    python -m gptpar.launch --nproc_per_node 2 pretrain_gpt.py --config configs/cpu_dp2.json
    python -m gptpar.launch --nproc_per_node 8 --max-restarts 3 pretrain_gpt.py --config c.json   # load = save

It is torchrun (same options, same agent, same environment for the ranks), with these differences:

    --max-restarts N     as torchrun: when a rank dies the agent stops the others and starts all of them again, up
                         to N times; with checkpoint.load = checkpoint.save they resume from `latest`. Each attempt's
                         process group lives on its own PrefixStore (gptpar.parallel.init_distributed), since the
                         agent keeps its TCPStore across attempts. A rank that exits 2 (a refusal: a config,
                         checkpoint or data error, the same on every attempt) ends the job there, restarts left or
                         not, with exit 2.
    a failed job         one line naming the rank, its exit code or signal and what follows, instead of torchrun's
                         ChildFailedError traceback; exit 2 when a rank refused, else 1. The ranks' own lines (above
                         it) say why.
    SIGTERM / SIGINT     torchrun passes them to the ranks, which save after the current iteration and exit 0; then
                         one line and exit 128 + the signal number (torchrun raises SignalException there).
    the master port      when this node hosts the rendezvous store (the static rendezvous on node rank 0, or a c10d
                         endpoint on this host) and the port is already in use, one line naming it and how to choose
                         another, exit 2, before any rank starts.

torch internals relied on (torch 2.11 to 2.13): `torch.distributed.run.parse_args` / `main`, the agent class
`LocalElasticAgent` and its `_monitor_workers(worker_group) -> RunResult` (`.state`, `.failures`: global rank ->
ProcessFailure with `.exitcode`, `.pid`), `_remaining_restarts` and `_worker_group.spec.max_restarts`, and
`ChildFailedError.failures`. tests/integration/test_launch_restart.py runs each.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket
import sys
from typing import Optional, Sequence

REFUSED = 2  # pretrain_gpt.py's and the tools' exit code for "refused before anything changed"


def describe_exit(exitcode: int) -> str:
    """`exit 2`, or `SIGKILL` for a rank killed by a signal (a negative exit code)."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit {exitcode}"


def first_failure(failures: dict):
    """(global rank, ProcessFailure) of a refusal if any rank refused, else of the likeliest cause: a rank killed by
    a signal (its peers then fail on the lost connection), else the earliest failure."""
    refused = [(rank, f) for rank, f in failures.items() if f.exitcode == REFUSED]
    ordered = sorted(refused or failures.items(), key=lambda item: (item[1].exitcode >= 0, item[1].timestamp,
                                                                    item[0]))
    return ordered[0]


@contextlib.contextmanager
def restart_policy():
    """While torchrun runs: a failed worker group with a refusal among its failures is not restarted, and each
    restart is said in one line."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    real = LocalElasticAgent._monitor_workers

    def monitor(self, worker_group):
        result = real(self, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
            rank, failure = first_failure(result.failures)
            if failure.exitcode == REFUSED:
                self._remaining_restarts = 0
            elif self._remaining_restarts > 0:
                total = worker_group.spec.max_restarts
                say(f"rank {rank} (pid {failure.pid}) ended ({describe_exit(failure.exitcode)}): restarting every "
                    f"rank of this node (restart {total - self._remaining_restarts + 1} of {total}, "
                    "--max-restarts); with checkpoint.load = checkpoint.save they resume from `latest`")
        return result

    LocalElasticAgent._monitor_workers = monitor
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = real


def store_address(args) -> Optional[tuple]:
    """(host, port, flag) of the rendezvous store this node's agent will bind, when it binds one: the static
    rendezvous's master on node rank 0, or a c10d endpoint naming this host; None otherwise (--standalone picks a
    free port itself)."""
    if args.standalone:
        return None
    if args.rdzv_backend == "static":
        if args.master_port is None:  # torch >= 2.12: one node takes a free port, several torchrun's 29500
            return None if str(args.nnodes).split(":")[-1] == "1" else (args.master_addr, 29500, "--master-port")
        return (args.master_addr, args.master_port, "--master-port") if args.node_rank == 0 else None
    if args.rdzv_backend == "c10d" and args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if host and port.isdigit() and is_this_host(host):
            return host, int(port), "--rdzv-endpoint HOST:PORT"
    return None


def is_this_host(host: str) -> bool:
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address.startswith("127.") or address in socket.gethostbyname_ex(socket.gethostname())[2]


def port_taken(host: str, port: int) -> bool:
    """Whether another process listens on (host, port): a bind with SO_REUSEADDR, as the store's, fails."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if host in ("", "0.0.0.0") else socket.gethostbyname(host), port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def say(message: str) -> None:
    print(f"gptpar.launch: {message}", file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    from torch.distributed.run import parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    address = store_address(parse_args(argv))
    if address is not None and port_taken(address[0], address[1]):
        from gptpar.parallel import free_port

        say(f"port {address[1]} on {address[0]} (the rendezvous store's) is already in use (another job, or one "
            f"still ending): choose another with {address[2]}, e.g. --master-port {free_port()}")
        return REFUSED
    # The per-process lines torch's multiprocessing logs for a failure (`failed (exitcode: 2) ...`, `Sending process
    # ... closing signal`) are said once below instead.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        with restart_policy():
            torchrun(argv)
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        say(f"torchrun received {sig.name} and passed it to the ranks, which save after their current iteration "
            "and exit (see the ranks' last lines)")
        return 128 + int(sig)
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        if failure.exitcode == REFUSED:
            return REFUSED  # the rank's own line says why; nothing to add, nothing restarted
        say(f"rank {rank} (pid {failure.pid}) ended the job ({describe_exit(failure.exitcode)}; its last lines above "
            "say why), no restart left (--max-restarts)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
