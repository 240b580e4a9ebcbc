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
                         one line and exit 128 + the signal number (143, 130; torchrun raises SignalException
                         there). The agent SIGKILLs ranks still running after its shutdown timeout (30 s by
                         default, less than an iteration and a save of a large model): gptpar.launch sets
                         `--shutdown-timeout` from the run (gptpar.checkpoint.stop_grace: the config's
                         checkpoint.shutdown_grace_seconds, else twice the last iteration + save measured in
                         checkpoint.save plus a minute, at least 5 minutes) unless given one, and says it in its
                         first line. Ranks killed at the end of it are named in the last line.
    a restart            its line names the rank whose process ended first, by itself (not one the agent then
                         stopped), and how.
    the master port      when this node hosts the rendezvous store (the static rendezvous on node rank 0, or a c10d
                         endpoint on this host) and the port is already in use, one line naming it and how to choose
                         another, exit 2, before any rank starts.

torch internals relied on (torch 2.11 to 2.13): `torch.distributed.run.parse_args` / `main`, the agent class
`LocalElasticAgent` and its `_monitor_workers(worker_group) -> RunResult` (`.state`, `.failures`: global rank ->
ProcessFailure with `.exitcode`, `.pid`), `_remaining_restarts`, `_worker_group.spec.max_restarts` and `_pcontext`,
`ChildFailedError.failures`, torchrun's `--shutdown-timeout` (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and the process
context's `close()` (`PContext`, which `_poll` calls once a worker failed, before stopping the others) with its
`_failures` ({local rank: ProcessFailure}) and `subprocess_handlers[local rank].proc`.
tests/integration/test_launch_restart.py and test_launch_signals.py run each.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from typing import Optional, Sequence, Tuple

REFUSED = 2  # pretrain_gpt.py's and the tools' exit code for "refused before anything changed"


def describe_exit(exitcode: int) -> str:
    """`exit 2`, or `SIGKILL` for a rank killed by a signal (a negative exit code)."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit {exitcode}"


# pids of the workers that had ended by themselves when the agent began stopping the others (`ended_alone`)
_ENDED_ALONE: set = set()


def first_failure(failures: dict):
    """(global rank, ProcessFailure) of a refusal if any rank refused, else of the likeliest cause: a rank that
    ended by itself before the agent stopped the others (those it stopped show its SIGTERM), among them one killed
    by a signal (its peers then fail on the lost connection), else the earliest failure."""
    refused = [(rank, f) for rank, f in failures.items() if f.exitcode == REFUSED]
    ordered = sorted(refused or failures.items(), key=lambda item: (item[1].pid not in _ENDED_ALONE,
                                                                    item[1].exitcode >= 0, item[1].timestamp,
                                                                    item[0]))
    return ordered[0]


@contextlib.contextmanager
def ended_alone():
    """While torchrun runs: note which workers had failed by themselves when the process context starts closing the
    rest (`_poll` captures the failures, then closes; the ones it then kills fail with its SIGTERM in the same
    second, and ProcessFailure's timestamps are whole seconds)."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    real = PContext.close

    def close(self, *args, **kwargs):
        failed = getattr(self, "_failures", None) or {}
        if failed and not any(f.pid in _ENDED_ALONE for f in failed.values()):
            _ENDED_ALONE.update(f.pid for f in failed.values())
        return real(self, *args, **kwargs)

    PContext.close = close
    try:
        yield
    finally:
        PContext.close = real


AGENT = [None]  # the agent of this launch, once it monitors its workers (the ranks killed at a stop's end)


@contextlib.contextmanager
def restart_policy():
    """While torchrun runs: a failed worker group with a refusal among its failures is not restarted, and each
    restart is said in one line."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    real = LocalElasticAgent._monitor_workers

    def monitor(self, worker_group):
        AGENT[0] = self
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


def run_config(args):
    """The gptpar config the ranks will read (the script's `--config` and `--set`s), or None: no config given, or
    one that does not load (the ranks then refuse it themselves, in their own line)."""
    from gptpar.config import ConfigError, load_config
    from gptpar.training.cli import parse_args as script_args

    try:
        config_path, overrides, _ = script_args(args.training_script_args)
        return load_config(config_path, overrides) if config_path else None
    except (ConfigError, OSError, ValueError):
        return None


def shutdown_grace(args) -> Tuple[Optional[int], str]:
    """(seconds to pass as --shutdown-timeout, or None to leave torchrun's; the start line's clause)."""
    if args.shutdown_timeout is not None or "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ:
        seconds = args.shutdown_timeout if args.shutdown_timeout is not None else \
            os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
        return None, f"{seconds} s (--shutdown-timeout, as given)"
    cfg = run_config(args)
    if cfg is None:
        return None, "30 s (torchrun's default: the script's gptpar config was not read)"
    from gptpar.checkpoint.stop_grace import grace_seconds

    seconds, why = grace_seconds(cfg)
    return seconds, f"{seconds} s (--shutdown-timeout from {why})"


def killed_at_stop() -> list:
    """Global ranks of this node that the agent SIGKILLed at the end of the shutdown grace."""
    agent = AGENT[0]
    pcontext = getattr(agent, "_pcontext", None)
    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    group = getattr(agent, "_worker_group", None)
    ranks = {w.local_rank: w.global_rank for w in getattr(group, "workers", [])}
    return sorted(ranks.get(local, local) for local, h in handlers.items()
                  if h.proc.returncode == -int(signal.SIGKILL))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    from torch.distributed.run import parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    address = store_address(args)
    if address is not None and port_taken(address[0], address[1]):
        from gptpar.parallel import free_port

        say(f"port {address[1]} on {address[0]} (the rendezvous store's) is already in use (another job, or one "
            f"still ending): choose another with {address[2]}, e.g. --master-port {free_port()}")
        return REFUSED
    grace, clause = shutdown_grace(args)
    if grace is not None:
        argv = ["--shutdown-timeout", str(grace)] + argv
    say(f"on SIGTERM or SIGINT the ranks finish their iteration, save and exit; they get {clause} before they are "
        "killed")
    # The per-process lines torch's multiprocessing logs for a failure (`failed (exitcode: 2) ...`, `Sending process
    # ... closing signal`) are said once below instead.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        with restart_policy(), ended_alone():
            torchrun(argv)
    except KeyboardInterrupt:  # before torchrun's handlers were installed (the rendezvous): no rank trained yet
        say("interrupted (SIGINT) while starting the ranks: stopped before any training")
        return 128 + int(signal.SIGINT)
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        killed = killed_at_stop()
        if killed:
            say(f"torchrun received {sig.name} and passed it to the ranks; rank{'s' if len(killed) > 1 else ''} "
                f"{', '.join(map(str, killed))} had not ended after the shutdown grace of {clause.split(' (')[0]} "
                f"and {'were' if len(killed) > 1 else 'was'} killed (SIGKILL): a save in progress is lost (the next "
                "start deletes what it left) "
                "and `latest` names the last checkpoint written before. Raise checkpoint.shutdown_grace_seconds "
                "(or give --shutdown-timeout)")
        else:
            say(f"torchrun received {sig.name} and passed it to the ranks, which save after their current "
                "iteration and exit (see the ranks' last lines)")
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
