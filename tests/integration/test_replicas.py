"""Replica checks: a replicated parameter perturbed on one rank (from outside the package, gptpar/testing/faults.py)
is named with its ranks and the save is refused, `latest` staying on the last checkpoint saved while replicas agreed;
the digest and the wording against a plain recomputation; two elements changed by the same bit pattern (which an XOR
of the bits misses) are seen, in fp32 and bf16."""
import os

import pytest
import torch

from gptpar.checkpoint.layout import read_latest
from gptpar.training import replicas
from gptpar.training.replicas import digests, first_divergence
from gptpar.testing.runs import finish_ranks, launch_ranks, write_config

from gptpar.testing import FAULTS  # pretrain_gpt.py with a fault injected


M64 = (1 << 64) - 1


def _finalise(z):
    """splitmix64's finaliser on a Python int (logical shifts, products modulo 2^64)."""
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _reference_digest(t):
    """The digest recomputed element by element in Python integers: per lane, the sum modulo 2^64 of
    finalise(bits_i XOR finalise(i * golden + seed)), bits_i the element's bits sign-extended to 64."""
    width = 8 * t.element_size()
    ints = t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()]).tolist()
    lanes = []
    for seed in replicas.LANE_SEEDS:
        total = 0
        for i, v in enumerate(ints):
            assert -(1 << (width - 1)) <= v < 1 << (width - 1)
            key = _finalise((i * 0x9E3779B97F4A7C15 + seed) & M64)
            total = (total + _finalise((v & M64) ^ key)) & M64
        lanes.append(total - (1 << 64) if total >> 63 else total)
    return lanes


def _same_bits_in_two(t, pattern=1):
    """`t` with the same bit pattern flipped in two elements (the low mantissa bits, as real drift)."""
    out = t.clone()
    out.view(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])[[3, 11]] ^= pattern
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_digest_matches_its_formula_and_sees_one_changed_element(dtype, monkeypatch):
    monkeypatch.setattr(replicas, "CHUNK_ELEMENTS", 8)  # several chunks: the index runs on across them
    a = torch.randn(5, 7).to(dtype)
    assert digests([a]).tolist() == [_reference_digest(a)]
    b = a.clone()
    b[3, 2] = torch.nextafter(b[3, 2], torch.tensor(1e9, dtype=dtype))  # one ulp
    assert (digests([a])[0] != digests([b])[0]).all()  # both lanes see it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_elements_changed_by_the_same_bits_are_caught_naming_the_parameter(dtype):
    params = {"layers.0.input_layernorm.weight": torch.randn(16).to(dtype),
              "layers.0.mlp.dense_4h_to_h.weight": torch.randn(4, 16).to(dtype)}
    drifted = dict(params, **{"layers.0.mlp.dense_4h_to_h.weight":
                              _same_bits_in_two(params["layers.0.mlp.dense_4h_to_h.weight"])})
    xor = [torch.hash_tensor(drifted[n]) == torch.hash_tensor(params[n]) for n in params]
    assert all(xor)  # the XOR of the bits (the digest before) cannot tell them apart
    table = torch.stack([digests(list(params.values())), digests(list(drifted.values()))])
    message = first_divergence("data-parallel", [0, 1], list(params), table)
    assert message == ("parameter layers.0.mlp.dense_4h_to_h.weight differs across its data-parallel replicas "
                       "(ranks 0, 1: rank 0 alone; rank 1 alone)")


def test_first_divergence_names_the_parameter_and_who_agrees():
    table = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 4]])
    message = first_divergence("data-parallel", [0, 2, 4], ["a", "b", "c"], table)
    assert message == ("parameter b differs across its data-parallel replicas (ranks 0, 2, 4: ranks 0, 2 agree; "
                       "rank 4 alone), and 1 more parameter(s) after it")
    assert first_divergence("data-parallel", [0, 1], ["a"], torch.tensor([[5], [5]])) is None


@pytest.mark.parametrize("case", [pytest.param("tp2_layernorm", marks=pytest.mark.slow), "pp2_tied_embedding",
                                  "dp2_two_elements_same_bits"])
def test_a_perturbed_replica_is_named_and_its_save_refused(tmp_path, case):
    """Save every 2 iterations; before iteration 4's save rank 1 changes a replicated parameter: adds 1 to one
    element of a LayerNorm weight every tp rank holds, or of the tied embedding's copy on the last stage; or, at
    dp 2, flips the lowest bit of two elements of a weight (the same bit pattern twice)."""
    parallel, name, kind = {
        "tp2_layernorm": (dict(tensor_model_parallel_size=2, data_parallel_size=1), "layernorm.weight",
                          "tensor-parallel replicas"),
        "pp2_tied_embedding": (dict(pipeline_model_parallel_size=2, data_parallel_size=1), "word_embeddings",
                               "tied (first and last pipeline stage) replicas"),
        "dp2_two_elements_same_bits": (dict(data_parallel_size=2), "dense_4h_to_h.weight:bit",
                                       "data-parallel replicas")}[case]
    ck = str(tmp_path / "ck")
    cfg = write_config(tmp_path / "c.json", parallel=parallel, training=dict(train_iters=6),
                       checkpoint=dict(save=ck, save_interval=2))
    codes, outs = finish_ranks(launch_ranks(2, ["--config", cfg], script=FAULTS, GPTPAR_TEST_PERTURB=f"4:1:{name}"),
                               timeout=240)
    name = name.split(":")[0]
    assert codes == [1, 1], outs
    for out in outs:
        line = next(line for line in out.splitlines() if line.startswith("pretrain_gpt.py: replica check: "))
        assert f"differs across its {kind} (ranks 0, 1: rank 0 alone; rank 1 alone)" in line, line
        assert name in line.split(" differs")[0] and "not saving iteration 4" in line, line
        assert f"`latest` in {ck} stays at iter_0000002" in line and "Traceback" not in out, out
    assert read_latest(ck) == "iter_0000002" and not os.path.exists(os.path.join(ck, "iter_0000004"))
