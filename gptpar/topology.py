"""The rank grid as pure functions, without torch: tp x pp x dp sizes and each rank's coordinates.

DeepSpeed's `PipeModelDataParallelTopology` order (axes pipe, data, model; model fastest):

    rank = pp_rank * (dp_size * tp_size) + dp_rank * tp_size + tp_rank

The config checks and the planning tools use these without importing torch; gptpar.parallel builds the process
groups from them (and re-exports them).
"""
from __future__ import annotations

from typing import Optional, Tuple


def rank_of(pp_rank: int, dp_rank: int, tp_rank: int, tp_size: int, dp_size: int) -> int:
    """Global rank of a (pipe, data, model) coordinate; model (tensor) parallel is the fastest axis."""
    return (pp_rank * dp_size + dp_rank) * tp_size + tp_rank


def coords_of(rank: int, tp_size: int, pp_size: int, dp_size: int) -> Tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank."""
    if not 0 <= rank < tp_size * pp_size * dp_size:
        raise ValueError(f"rank {rank} outside a world of {tp_size * pp_size * dp_size}")
    tp_rank = rank % tp_size
    dp_rank = (rank // tp_size) % dp_size
    pp_rank = rank // (tp_size * dp_size)
    return pp_rank, dp_rank, tp_rank


def group_ranks(tp_size: int, pp_size: int, dp_size: int) -> dict:
    """Every process group of the grid as lists of global ranks, in a fixed order.

    Keys: 'tp', 'pp', 'dp', one list per group along that axis. (The tied embedding's group, first + last
    stage, is DeepSpeed's PipelineModule's to make.)
    """
    tp = [[rank_of(p, d, t, tp_size, dp_size) for t in range(tp_size)]
          for p in range(pp_size) for d in range(dp_size)]
    dp = [[rank_of(p, d, t, tp_size, dp_size) for d in range(dp_size)]
          for p in range(pp_size) for t in range(tp_size)]
    pp = [[rank_of(p, d, t, tp_size, dp_size) for p in range(pp_size)]
          for d in range(dp_size) for t in range(tp_size)]
    return {"tp": tp, "pp": pp, "dp": dp}


def resolve_sizes(world_size: int, tp: int, pp: int, dp: Optional[int] = None) -> Tuple[int, int, int]:
    """Check tp * pp * dp == world_size (dp inferred when None) and return (tp, pp, dp)."""
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
    if dp is None:
        if world_size % (tp * pp):
            raise ValueError(
                f"world size {world_size} does not divide by tensor_model_parallel_size ({tp}) x "
                f"pipeline_model_parallel_size ({pp}): launch a multiple of {tp * pp} ranks or change tp/pp")
        dp = world_size // (tp * pp)
    if tp * pp * dp != world_size:
        raise ValueError(
            f"world size {world_size} != tp ({tp}) x pp ({pp}) x dp ({dp}) = {tp * pp * dp}: launch "
            f"{tp * pp * dp} ranks or change parallel.data_parallel_size")
    return tp, pp, dp
