"""The rank grid: pure functions against DeepSpeed's topology, and the process groups on 4 gloo ranks."""
import itertools
import subprocess
import sys

import pytest
import torch.distributed as dist

from gptpar.parallel import coords_of, group_ranks, init_parallel, rank_of, resolve_sizes, single_process_state
from gptpar.model.pipeline import deepspeed_topology
from gptpar.testing import run_distributed

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 2, 2), (4, 3, 2), (8, 10, 3)]


@pytest.mark.parametrize("tp,pp,dp", SHAPES)
def test_grid_agrees_with_deepspeed_topology(tp, pp, dp):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    for rank in range(tp * pp * dp):
        p, d, t = coords_of(rank, tp, pp, dp)
        assert rank_of(p, d, t, tp, dp) == rank
        coord = topo.get_coord(rank)
        assert (coord.pipe, coord.data, coord.model) == (p, d, t)
    groups = group_ranks(tp, pp, dp)
    # DeepSpeed's axis lists: ranks that differ only along that axis.
    assert sorted(map(sorted, groups["tp"])) == sorted(map(sorted, topo.get_axis_comm_lists("model"))) or tp == 1
    assert sorted(map(sorted, groups["dp"])) == sorted(map(sorted, topo.get_axis_comm_lists("data"))) or dp == 1
    assert sorted(map(sorted, groups["pp"])) == sorted(map(sorted, topo.get_axis_comm_lists("pipe"))) or pp == 1
    # Every rank is in exactly one group per axis.
    for axis in ("tp", "pp", "dp"):
        members = list(itertools.chain.from_iterable(groups[axis]))
        assert sorted(members) == list(range(tp * pp * dp))


def test_resolve_sizes_errors_name_the_fix():
    assert resolve_sizes(8, 2, 2) == (2, 2, 2)
    with pytest.raises(ValueError, match="does not divide"):
        resolve_sizes(6, 4, 1)
    with pytest.raises(ValueError, match="data_parallel_size"):
        resolve_sizes(8, 2, 2, dp=1)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        resolve_sizes(8, 0, 1)


def test_single_process_state_is_all_ones():
    st = single_process_state()
    assert (st.tp_size, st.pp_size, st.dp_size) == (1, 1, 1) and st.is_first_stage and st.is_last_stage
    with pytest.raises(Exception):
        st.tp_size = 2  # frozen


def test_import_gptpar_does_not_import_deepspeed():
    code = "import sys, gptpar; gptpar.ColumnParallelLinear; assert 'deepspeed' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _groups_on_ranks(tp, pp):
    st = init_parallel(tp=tp, pp=pp)
    me = dist.get_rank()
    assert (st.pp_rank, st.dp_rank, st.tp_rank) == coords_of(me, tp, pp, st.dp_size)
    out = {}
    for axis, group in (("tp", st.tp_group), ("pp", st.pp_group), ("dp", st.dp_group)):
        if group is None:
            continue
        ranks = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, me, group=group)
        out[axis] = ranks
    deepspeed_topology(st)  # raises if DeepSpeed's numbering disagrees
    return st.pp_rank, st.dp_rank, st.tp_rank, out


def test_process_groups_on_four_ranks():
    results = run_distributed(_groups_on_ranks, 4, args=(2, 2), timeout=240)
    expected = group_ranks(2, 2, 1)
    for rank, (pp_rank, dp_rank, tp_rank, groups) in enumerate(results):
        for axis, members in groups.items():
            assert members in expected[axis], (rank, axis, members)
            assert rank in members
