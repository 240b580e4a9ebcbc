"""DeepSpeed's CPU shared-memory all-reduce buffers do not outlive the run that made them.

DeepSpeed creates /dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank} (tens of MB each, in RAM) when
all ranks share a host (its launcher's LOCAL_SIZE equals the world size), and never unlinks it, so every CPU run
would leave one per rank behind (docs/reliability.md). `engine.release_shm_buffer` unlinks this rank's once every
rank has mapped them all.
"""
import os

import pytest

from gptpar.testing import run_distributed
from gptpar.testing.runs import log_lines, run_mains, write_config


def _train_watching_the_buffer(plan):
    """Train; report whether this rank's buffer existed when the engine was built, and whether it still does."""
    from gptpar.training.engine import initialize as engine  # build_engine calls release_shm_buffer from here

    release, seen = engine.release_shm_buffer, {}

    def watched(pstate):
        seen["path"] = engine.shm_buffer_path(pstate.rank)
        seen["before"] = os.path.exists(seen["path"])
        release(pstate)

    engine.release_shm_buffer = watched
    out = run_mains(plan, env={"LOCAL_SIZE": "2"})  # as DeepSpeed's launcher sets it: all ranks on this host
    return out, seen["before"], os.path.exists(seen["path"])


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")
def test_training_leaves_no_shm_buffer(tmp_path):
    cfg = write_config(tmp_path / "c.json", parallel=dict(data_parallel_size=2), training=dict(train_iters=3))
    ranks = run_distributed(_train_watching_the_buffer, 2, ([("run", ["--config", cfg])],), timeout=300)
    printed = "".join(out["run"][1] for out, _, _ in ranks)
    assert all(out["run"][0] == 0 for out, _, _ in ranks) and len(log_lines(printed)) == 3, printed  # trained
    for _, before, after in ranks:
        assert before, "DeepSpeed's shm all-reduce made no buffer: this test would check nothing"
        assert not after
