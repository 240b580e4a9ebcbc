"""Parallel state: one immutable object with the tp / pp / dp sizes, ranks and process groups.

The rank grid is DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model; model fastest):

    rank = pp_rank * (dp_size * tp_size) + dp_rank * tp_size + tp_rank

so tensor-parallel peers are neighbouring ranks (one node on GPUs), and pipeline stages are the
outermost axis. There is no module-level state: `init_parallel` returns a `ParallelState` that
is passed to whatever needs a group. Layers only ever see the single group they need.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from gptpar.topology import coords_of, group_ranks, rank_of, resolve_sizes  # noqa: F401 (re-exported)


# ---------------------------------------------------------------------------------------------
# The state object
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParallelState:
    """Sizes, ranks and groups of one rank. Groups are None only in a single-process world."""

    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    tp_group: Optional[dist.ProcessGroup]
    pp_size: int
    pp_rank: int
    pp_group: Optional[dist.ProcessGroup]
    dp_size: int
    dp_rank: int
    dp_group: Optional[dist.ProcessGroup]
    device: torch.device
    backend: Optional[str] = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"pp={self.pp_rank}/{self.pp_size}, dp={self.dp_rank}/{self.dp_size}, "
                f"device={self.device}, backend={self.backend})")


def check_topology_agrees(topo, tp_size: int, pp_size: int, dp_size: int) -> None:
    """Raise if DeepSpeed's topology numbers ranks differently from `rank_of`."""
    for rank in range(tp_size * pp_size * dp_size):
        p, d, t = coords_of(rank, tp_size, pp_size, dp_size)
        ds_rank = topo.get_rank(pipe=p, data=d, model=t)
        if ds_rank != rank:
            raise RuntimeError(f"DeepSpeed topology puts (pipe={p}, data={d}, model={t}) on rank {ds_rank}, "
                               f"gptpar on {rank}: the rank grids disagree")


def free_port() -> int:
    """A free TCP port on the loopback interface (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device() -> torch.device:
    """The accelerator of this rank: cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


class LaunchError(RuntimeError):
    """The launch itself cannot work (the master port is taken); the message names the fix."""


# The flight recorder keeps each rank's recent collectives (operation, group, sequence number, sizes) for the
# diagnostics written when a collective fails (gptpar.training.diagnostics); users launch with plain torchrun, so
# gptpar asks for it itself, before the first process group reads the variable.
FLIGHT_RECORDER_ENTRIES = "2000"


def init_distributed(backend: Optional[str] = None, timeout_minutes: float = 30.0) -> None:
    """Initialise torch.distributed from the launcher's environment (RANK, WORLD_SIZE, MASTER_*).

    A plain `python script.py` (no launcher variables) becomes a one-rank world on a free local port.
    NCCL on CUDA, gloo otherwise. The timeout bounds how long a stalled collective waits.

    Under torchrun (TORCHELASTIC_RESTART_COUNT set) the process group lives on a PrefixStore of that attempt:
    torchrun's agent keeps its TCPStore across in-job restarts (--max-restarts), so ranks restarted on the bare
    store would read the keys of the attempt before (gloo's peer addresses) and hang or fail connecting to dead
    ranks. A master port already in use raises LaunchError naming it.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = "0", "1", "0"
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        default_device()  # bind this rank's GPU before NCCL creates its communicator
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    try:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None:
            dist.init_process_group(backend=backend, timeout=timeout)
            return
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"gptpar_attempt_{attempt}/", store),
                                rank=rank, world_size=world_size, timeout=timeout)
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
            raise
        port = os.environ.get("MASTER_PORT")
        raise LaunchError(f"the master port {port} (MASTER_PORT) on {os.environ.get('MASTER_ADDR')} is already in "
                          "use (another job, or one still ending): launch on another port, e.g. deepspeed "
                          f"--master_port {free_port()}, torchrun / python -m gptpar.launch --master-port N, or "
                          "MASTER_PORT=N") from None


def init_parallel(tp: int = 1, pp: int = 1, dp: Optional[int] = None, *, backend: Optional[str] = None,
                  timeout_minutes: float = 30.0) -> ParallelState:
    """Build the tp x pp x dp grid over all ranks and return this rank's `ParallelState`.

    Initialises torch.distributed if needed (see `init_distributed`). `dp=None` takes whatever the
    world size leaves; a world size that is not tp * pp * dp raises ValueError before any group is made.
    Every rank must call this with the same sizes (group creation is collective).
    """
    if dist.is_initialized():
        resolve_sizes(dist.get_world_size(), tp, pp, dp)
    elif "WORLD_SIZE" in os.environ:
        resolve_sizes(int(os.environ["WORLD_SIZE"]), tp, pp, dp)  # fail before any process group exists
    init_distributed(backend, timeout_minutes)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    tp, pp, dp = resolve_sizes(world_size, tp, pp, dp)
    pp_rank, dp_rank, tp_rank = coords_of(rank, tp, pp, dp)

    mine = {}
    for axis, lists in group_ranks(tp, pp, dp).items():
        for ranks in lists:  # every rank creates every group, in the same order
            group = dist.new_group(ranks, timeout=datetime.timedelta(minutes=timeout_minutes))  # else 30 min
            if rank in ranks:
                mine[axis] = group
    return ParallelState(
        world_size=world_size, rank=rank,
        tp_size=tp, tp_rank=tp_rank, tp_group=mine["tp"],
        pp_size=pp, pp_rank=pp_rank, pp_group=mine["pp"],
        dp_size=dp, dp_rank=dp_rank, dp_group=mine["dp"],
        device=default_device(), backend=dist.get_backend(),
    )


def single_process_state(device: Optional[torch.device] = None) -> ParallelState:
    """A one-rank state without torch.distributed: every size 1, every group None."""
    return ParallelState(world_size=1, rank=0, tp_size=1, tp_rank=0, tp_group=None, pp_size=1, pp_rank=0,
                         pp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         device=device or torch.device("cpu"))


def host_group(timeout_minutes: float = 30.0):
    """A new gloo group of every rank, for host values (CPU tensors) that the ranks agree on without touching a
    device stream; None for one process. Collective: every rank calls it, in the same order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))


def destroy_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_collective_timeout(exc: BaseException) -> bool:
    """A collective that waited past the process group's timeout (parallel.distributed_timeout_minutes): gloo's
    `Timed out waiting Nms for recv operation`, NCCL's `DistBackendError` naming a timeout."""
    return isinstance(exc, RuntimeError) and ("timed out" in str(exc).lower() or "timeout" in str(exc).lower())


# What gloo and NCCL say when the process at the other end of a connection is gone.
PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
             "remote process exited", "socket closed", "ncclremoteerror")


def is_peer_lost(exc: BaseException) -> bool:
    """A collective that failed because another rank's process is gone (killed, crashed, its node lost)."""
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in PEER_LOST)


__all__: List[str] = ["ParallelState", "LaunchError", "init_parallel", "init_distributed", "is_peer_lost", "single_process_state",
                      "destroy_parallel", "host_group", "is_collective_timeout", "rank_of", "coords_of", "group_ranks",
                      "resolve_sizes", "check_topology_agrees"]
