"""Replica checks: a replicated parameter perturbed on one rank (from outside the package, gptpar/testing/faults.py)
is named with its ranks and the save is refused, `latest` staying on the last checkpoint saved while replicas agreed;
the digest and the wording against a plain recomputation."""
import os

import pytest
import torch

from gptpar.checkpoint.layout import read_latest
from gptpar.training.replicas import digests, first_divergence
from gptpar.testing.runs import finish_ranks, launch_ranks, write_config

from gptpar.testing import FAULTS  # pretrain_gpt.py with a fault injected


def test_digest_sees_one_changed_element_and_is_the_xor_of_the_bits():
    a = torch.randn(5, 7)
    b = a.clone()
    b[3, 2] = torch.nextafter(b[3, 2], torch.tensor(1e9))  # one ulp
    bits = a.double().view(torch.int64).flatten()
    xor = 0
    for v in bits.tolist():
        xor ^= v
    assert digests([a]).tolist() == [xor]
    assert digests([a])[0] != digests([b])[0]


def test_first_divergence_names_the_parameter_and_who_agrees():
    table = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 4]])
    message = first_divergence("data-parallel", [0, 2, 4], ["a", "b", "c"], table)
    assert message == ("parameter b differs across its data-parallel replicas (ranks 0, 2, 4: ranks 0, 2 agree; "
                       "rank 4 alone), and 1 more parameter(s) after it")
    assert first_divergence("data-parallel", [0, 1], ["a"], torch.tensor([[5], [5]])) is None


@pytest.mark.parametrize("case", [pytest.param("tp2_layernorm", marks=pytest.mark.slow), "pp2_tied_embedding"])
def test_a_perturbed_replica_is_named_and_its_save_refused(tmp_path, case):
    """Save every 2 iterations; before iteration 4's save rank 1 adds 1 to one element of a replicated parameter
    (a LayerNorm weight every tp rank holds; the tied embedding's copy on the last stage)."""
    parallel, name, kind = {
        "tp2_layernorm": (dict(tensor_model_parallel_size=2, data_parallel_size=1), "layernorm.weight",
                          "tensor-parallel replicas"),
        "pp2_tied_embedding": (dict(pipeline_model_parallel_size=2, data_parallel_size=1), "word_embeddings",
                               "tied (first and last pipeline stage) replicas")}[case]
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", parallel=parallel, training=dict(train_iters=6),
                       checkpoint=dict(save=ck, save_interval=2))
    codes, outs = finish_ranks(launch_ranks(2, ["--config", cfg], script=FAULTS, GPTPAR_TEST_PERTURB=f"4:1:{name}"),
                               timeout=240)
    assert codes == [1, 1], outs
    for out in outs:
        line = next(line for line in out.splitlines() if line.startswith("pretrain_gpt.py: replica check: "))
        assert f"differs across its {kind} (ranks 0, 1: rank 0 alone; rank 1 alone)" in line, line
        assert name in line.split(" differs")[0] and "not saving iteration 4" in line, line
        assert f"`latest` in {ck} stays at iter_0000002" in line and "Traceback" not in out, out
    assert read_latest(ck) == "iter_0000002" and not os.path.exists(os.path.join(ck, "iter_0000004"))
