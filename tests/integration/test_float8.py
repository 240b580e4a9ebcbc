"""training.precision = fp8: the float8 GEMMs of the tensor-parallel layers through torchao (emulated on CPU).

- the per-GEMM decision (fp8 / padded / kept in bf16) written out here and checked against every shipped config,
  the layers' own decisions, the dry run and the planner;
- gptpar's Column/RowParallelLinear at tp 2 against torchao's own Float8Linear on the gathered weight, forward and
  backward, each recipe, with and without sequence parallelism, plain and padded;
- a padded GEMM equals the unpadded one and does not keep its padded weight copy for backward;
- torchao's import noise is caught and explained; a missing torchao is a config error;
- training (in tests/integration/test_float8_training.py).
"""
import gc
import glob
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gptpar.tensor_parallel import float8 as float8_module
from gptpar.tensor_parallel.float8 import (Float8Gemm, Float8Matmul, describe_float8_gemms, float8_flags,
                                           layer_float8_gemms, plan_float8_gemm)
from gptpar.testing import run_distributed
from gptpar.config import ConfigError, config_from_dict, load_config
from gptpar.testing import ROOT
from gptpar.testing.deadline import stretched

RECIPES = ("tensorwise", "rowwise")


# -- the decision, written out --------------------------------------------------------------------------------------

def _expected_mode(out, inp):
    """torch._scaled_mm wants both weight dimensions divisible by 16; pad while that adds at most 1/8 of the FLOPs."""
    up = lambda n: (n + 15) // 16 * 16  # noqa: E731
    if out % 16 == 0 and inp % 16 == 0:
        return "fp8", (out, inp)
    return ("padded" if up(out) * up(inp) <= 1.125 * out * inp else "bf16"), (up(out), up(inp))


@pytest.mark.parametrize("shape", [(64, 64), (5400, 14400), (14400, 1800), (8700, 11600), (11600, 2900),
                                   (120, 120), (360, 120), (24, 40), (248, 248), (16, 1)])
def test_plan_pads_or_keeps_bf16_by_the_rule(shape):
    gemm = plan_float8_gemm(*shape)
    mode, padded = _expected_mode(*shape)
    assert (gemm.mode, (gemm.padded_out, gemm.padded_in)) == (mode, padded)
    grown = padded[0] * padded[1] / (shape[0] * shape[1]) - 1
    assert gemm.extra_flops == pytest.approx(grown if mode == "padded" else 0.0)


def _shipped_configs():
    return sorted(glob.glob(os.path.join(ROOT, "configs", "*.json")))


@pytest.mark.parametrize("path", _shipped_configs(), ids=os.path.basename)
def test_every_shipped_config_runs_every_gemm_in_fp8(path):
    """At its own tp every shipped config passes the fp8 config checks and runs each of a layer's four GEMMs in
    float8: as they are where both weight-slice dimensions divide by 16, padded where one does not (200b.json at tp
    8 and 104b.json at tp 4: query_key_value and dense), never kept in bf16."""
    cfg = load_config(path, ["training.precision=fp8"])
    p = cfg.parallel
    cfg.check(p.tensor_model_parallel_size * p.pipeline_model_parallel_size * (p.data_parallel_size or 1),
              installed=lambda package: True)
    h, f, tp = cfg.model.hidden_size, cfg.model.ffn_hidden_size, p.tensor_model_parallel_size
    slices = {"query_key_value": (3 * h // tp, h), "dense": (h, h // tp), "dense_h_to_4h": (f // tp, h),
              "dense_4h_to_h": (h, f // tp)}
    gemms = layer_float8_gemms(h, f, tp)
    assert [(g.name, (g.out_features, g.in_features)) for g in gemms] == list(slices.items())
    for g in gemms:
        assert (g.mode, (g.padded_out, g.padded_in)) == _expected_mode(g.out_features, g.in_features), g
        assert g.mode != "bf16", g
    padded = {g.name for g in gemms if g.mode == "padded"}
    name = os.path.basename(path)
    if name in ("200b.json", "104b.json"):  # the slices fp8 must pad: 14400 x 5400 and 1800 x 14400 at tp 8, ...
        assert padded == {"query_key_value", "dense"}
        assert all(g.extra_flops < 0.005 for g in gemms)  # a fraction of a percent
    else:
        assert padded == set()


@pytest.mark.parametrize("name", ["200b.json", "104b.json", "cpu_tp2.json"])
def test_dry_run_and_planner_say_the_same_decision(name):
    from gptpar.estimate.planner import Hardware, plan_topology
    from gptpar.estimate.report import render_dry_run
    from gptpar.estimate.settings import settings_of

    cfg = load_config(os.path.join(ROOT, "configs", name), ["training.precision=fp8"])
    h, f, tp = cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.parallel.tensor_model_parallel_size
    gemms = layer_float8_gemms(h, f, tp)
    report = render_dry_run(cfg, cfg.parallel.data_parallel_size or 1)
    assert describe_float8_gemms(gemms, tp) in report
    assert "float8 casts" in report
    s = settings_of(cfg)
    nodes = max(1, tp * cfg.parallel.pipeline_model_parallel_size * (cfg.parallel.data_parallel_size or 1) // 8)
    candidates = plan_topology(s, nodes, Hardware(gpu_mem_gib=1e6))
    fp8_flags = {c.tp: [flag for flag in c.soft if flag.startswith("fp8")] for c in candidates}
    assert tp in fp8_flags and fp8_flags[tp] == float8_flags(gemms)
    assert all(flags == float8_flags(layer_float8_gemms(h, f, t)) for t, flags in fp8_flags.items())
    # and without fp8 nothing of it is said
    plain = load_config(os.path.join(ROOT, "configs", name))
    assert "float8" not in render_dry_run(plain, plain.parallel.data_parallel_size or 1)


def test_the_layers_decide_as_the_plan():
    """TransformerLayer's four linears decide by the same function as layer_float8_gemms (meta device, tp 1)."""
    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import TransformerLayer

    for h in (64, 120):
        config = GPTConfig(num_layers=1, hidden_size=h, num_attention_heads=4, seq_length=16, vocab_size=128)
        layer = TransformerLayer(config, 0, float8=object(), device="meta")
        built = [getattr(layer, name).float8_gemm for name in float8_module.GEMM_NAMES]
        planned = layer_float8_gemms(h, config.ffn_hidden_size, 1)
        assert [(g.out_features, g.in_features, g.mode) for g in built] == \
            [(g.out_features, g.in_features, g.mode) for g in planned]
        for name in float8_module.GEMM_NAMES:  # a GEMM kept in bf16 gets no float8 function
            linear = getattr(layer, name)
            assert (linear.float8 is None) == (linear.float8_gemm.mode == "bf16")
    assert {g.mode for g in layer_float8_gemms(120, 480, 1)} == {"padded", "bf16"}  # the checkpoint test's model
    plain = TransformerLayer(config, 0, device="meta")
    assert plain.query_key_value.float8_gemm is None and plain.query_key_value.float8 is None


# -- config -----------------------------------------------------------------------------------------------------

def _fp8_config(**training):
    return config_from_dict({"training": dict(precision="fp8", train_iters=1, **training),
                             "data": {"synthetic": True}})


def test_missing_torchao_is_a_config_error_with_the_pip_command():
    with pytest.raises(ConfigError, match=r"training.precision=fp8 needs the torchao package.*"
                                          r"pip install torchao==0\.18\.0"):
        _fp8_config().check(1, installed=lambda package: package != "torchao")
    _fp8_config().check(1)  # planning and dry runs do not need it


def test_pretrain_refuses_before_starting(monkeypatch, capsys):
    from gptpar.training.pretrain import main as pretrain_main
    from gptpar.training import cli

    monkeypatch.setattr(cli, "package_installed", lambda package: package != "torchao")
    assert pretrain_main(["--config", "configs/cpu_tiny.json", "--set", "training.precision=fp8"]) == 2
    assert "config error: training.precision=fp8 needs the torchao package" in capsys.readouterr().err


def test_fp8_options_are_checked():
    from gptpar.config import Accelerator, deepspeed_precision

    assert _fp8_config().training.zero_stage == 1  # promoted, as bf16
    assert _fp8_config().training.zero_stage_note.startswith("training.zero_stage 0 -> 1 (fp8)")
    assert _fp8_config(fp8_recipe="rowwise").training.fp8_recipe == "rowwise"
    with pytest.raises(ConfigError, match="training.fp8_recipe must be one of"):
        _fp8_config(fp8_recipe="blockwise")
    with pytest.raises(ConfigError, match="training.fp8_recipe=rowwise applies to training.precision=fp8 only"):
        config_from_dict({"training": dict(precision="bf16", fp8_recipe="rowwise", train_iters=1),
                          "data": {"synthetic": True}})
    a100 = Accelerator("CUDA (A100, compute capability 8.0)", fp16=True, fp8=False)
    with pytest.raises(ConfigError, match="training.precision fp8 is not supported here: CUDA .A100"):
        _fp8_config().check(1, a100)
    _fp8_config().check(1, Accelerator("CPU", fp16=False))  # emulated
    assert [deepspeed_precision(p) for p in ("fp32", "bf16", "fp16", "fp8")] == ["fp32", "bf16", "fp16", "bf16"]


def test_deepspeed_sees_bf16():
    from gptpar.training.engine import deepspeed_config

    fp8, bf16 = _fp8_config(), config_from_dict({"training": dict(precision="bf16", train_iters=1),
                                                  "data": {"synthetic": True}})
    assert deepspeed_config(fp8, 1) == deepspeed_config(bf16, 1)


def test_memory_estimate_is_bf16s_plus_casts():
    from gptpar.estimate.memory import memory_per_gpu, model_state_bytes
    from gptpar.tensor_parallel.float8 import float8_cast_bytes

    assert model_state_bytes(1000, "fp8") == model_state_bytes(1000, "bf16")
    shape = dict(num_layers=4, hidden_size=14400, num_attention_heads=96, vocab_size=50257, seq_length=2048,
                 micro_batch_size=2, global_batch_size=16, tp_size=8, pp_size=2, dp_size=1)
    bf16, fp8 = memory_per_gpu(precision="bf16", **shape)["max"], memory_per_gpu(precision="fp8", **shape)["max"]
    rowwise = memory_per_gpu(precision="fp8", fp8_recipe="rowwise", **shape)["max"]
    gemms = layer_float8_gemms(14400, 57600, 8)
    casts = float8_cast_bytes(gemms, 2 * 2048, weights_cached=True)
    # tensorwise: plus the weight casts cached per step: 1 byte per padded weight element and a 4-byte scale, 2
    # layers a stage
    cache = 2 * (5408 * 14400 + 14400 * 1808 + 7200 * 14400 + 14400 * 7200 + 4 * 4)
    assert fp8["float8_casts"] == casts + cache and bf16["float8_casts"] == 0
    assert fp8["peak_allocated"] == pytest.approx(bf16["peak_allocated"] + casts + cache)  # reserve: a share of it
    assert rowwise["float8_casts"] == float8_cast_bytes(gemms, 2 * 2048)  # no cache: each GEMM casts its weight
    # 4096 tokens; per GEMM the output gradient cast twice and the input once (1 byte each), the padded bf16
    # gradient of a padded side (2 bytes); uncached also the weight's cast (1 byte) and a padded GEMM's rebuilt bf16
    # weight (2 bytes)
    m = 4096
    weights = {"mlp_in": 7200 * 14400, "qkv": 5408 * 14400, "dense": 14400 * 1808, "mlp_out": 14400 * 7200}
    held = {"mlp_in": 2 * m * 7200 + m * 14400, "qkv": 2 * m * 5408 + m * 14400 + 2 * m * 5408,  # out 5400 -> 5408
            "dense": 2 * m * 14400 + m * 1808 + 2 * m * 1808, "mlp_out": 2 * m * 14400 + m * 7200}  # in 1800 -> 1808
    padded = {"qkv", "dense"}
    assert casts == max(held.values())
    assert float8_cast_bytes(gemms, m) == max(held[k] + weights[k] * (3 if k in padded else 1) for k in held)


# -- one process: padding, the import --------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
def test_padded_gemm_equals_the_unpadded_one(recipe, monkeypatch):
    """Padding adds zeros, which change no scale: the padded GEMM's output and gradients equal the unpadded
    (emulated, which does not check shapes) GEMM's bit for bit; and the padded weight copy is not kept alive
    for backward (it is rebuilt there), while the unpadded path's saved tensors are the parameter's own."""
    mm = Float8Matmul(recipe, emulate=True)
    torch.manual_seed(0)
    weight = torch.randn(40, 24, dtype=torch.bfloat16, requires_grad=True)  # out 40 -> 48, in 24 -> 32
    x = torch.randn(6, 2, 24, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(6, 2, 40, dtype=torch.bfloat16)
    plain, padded = Float8Gemm("t", 40, 24, "fp8", 40, 24), Float8Gemm("t", 40, 24, "padded", 48, 32)
    y0 = mm.linear(x, weight, plain)
    y0.backward(dy)
    grads0 = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None

    copies, pad = [], F.pad

    def recording_pad(t, *args, **kwargs):
        out = pad(t, *args, **kwargs)
        if out.shape == (48, 32):
            copies.append(weakref.ref(out))
        return out

    monkeypatch.setattr(torch.nn.functional, "pad", recording_pad)
    y1 = mm.linear(x, weight, padded)
    gc.collect()
    assert len(copies) == 1 and copies[0]() is None  # freed after forward: not saved for backward
    y1.backward(dy)
    assert y1.shape == y0.shape and torch.equal(y1, y0)
    assert torch.equal(x.grad, grads0[0]) and torch.equal(weight.grad, grads0[1])
    assert not torch.equal(y0, F.linear(x, weight))  # float8 rounding happened


def test_import_is_quiet_and_says_why():
    """A plain `import torchao` here logs a "Failed to load" warning per C++ extension that does not load with
    this torch; building gptpar's Float8Matmul logs none and says how many in its note instead."""
    codes = ("import torchao",
             "from gptpar.tensor_parallel.float8 import Float8Matmul\nprint(Float8Matmul().import_note)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT) for code in codes]  # side by side: each takes seconds to import torch
    (_, plain_err), (ours_out, ours_err) = (p.communicate(timeout=stretched(300)) for p in procs)
    assert procs[1].returncode == 0, ours_err
    failed = plain_err.count("Failed to load")
    assert "Failed to load" not in ours_err and "register_constant" not in ours_err
    note = ours_out.strip().splitlines()[-1]
    assert note == (f"{failed} of torchao's C++ extension files did not load with this torch (unused by float8 "
                    "training)" if failed else "None")


# -- tp 2: gptpar's layers against torchao's Float8Linear on the gathered weight ---------------------------------

def _planted(*shape, generator):
    """Values in (-1, 1) with +-2 wherever (row + column) % 4 == 0 (rows: every leading dim flattened): every row
    and every column of every block of >= 4 rows or columns holds the amax 2. So a tp shard's scales - tensorwise,
    per row or per column (rowwise) - equal the whole tensor's, and sharded float8 GEMMs can be compared with one
    unsharded float8 GEMM to fp32 summation order instead of to float8 rounding."""
    t = torch.rand(*shape, generator=generator) * 2 - 1
    flat = t.view(-1, shape[-1])
    rows, cols = torch.meshgrid(torch.arange(flat.shape[0]), torch.arange(shape[-1]), indexing="ij")
    flat[(rows + cols) % 4 == 0] = 2.0 * torch.sign(flat[(rows + cols) % 4 == 0] + 1e-3)
    return t


def _block(t, rank, world, dim):
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n)


def _reference(weight, bias, x, dy, recipe):
    """torchao's own Float8Linear (convert_to_float8_training of an nn.Linear holding the full weight): output and
    the gradients of x, weight and bias; and F.linear's output, to show float8 rounding is there to be matched."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    lin = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None))
    with torch.no_grad():
        lin[0].weight.copy_(weight)
        if bias is not None:
            lin[0].bias.copy_(bias)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(lin, config=config)
    assert type(lin[0]).__name__ == "Float8Linear"
    x = x.clone().requires_grad_()
    y = lin(x)
    y.backward(dy)
    return {"y": y.detach(), "x": x.grad, "w": lin[0].weight.grad,
            "b": lin[0].bias.grad if bias is not None else None, "linear": F.linear(x, weight, bias).detach()}


def _compare(got, want, linear, what):
    """fp32: equal to summation order; and float8 rounding (against F.linear) far above that, or the comparison
    could not tell float8 from no float8."""
    scale = want.abs().max()
    err = (got - want).abs().max() / scale
    assert err < 2e-6, (what, float(err))
    if linear is not None:
        assert (linear - want).abs().max() / scale > 1e-3, what


CASES = [  # (kind, in, out, sequence_parallel)
    ("column", 64, 96, False), ("column", 64, 96, True), ("row", 96, 64, False), ("row", 96, 64, True),
    ("column", 248, 496, False), ("row", 496, 248, True),  # padded slices: (248, 248) -> (256, 256)
    ("column", 24, 48, False), ("row", 48, 24, False),  # kept in bf16: (24, 24) -> (32, 32) is +78%
]
S, B = 8, 2


def _layers_against_torchao(st):
    from gptpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    g, r, w = st.tp_group, st.tp_rank, st.tp_size
    out = []
    for recipe in RECIPES:
        mm = Float8Matmul(recipe, emulate=True)
        for case, (kind, n_in, n_out, sp) in enumerate(CASES):
            gen = torch.Generator().manual_seed(case)  # the same tensors on both ranks
            weight, x, dy = (_planted(n_out, n_in, generator=gen), _planted(S, B, n_in, generator=gen),
                             _planted(S, B, n_out, generator=gen))
            bias = torch.rand(n_out, generator=gen)
            ref = _reference(weight, bias, x, dy, recipe)
            cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
            layer = cls(n_in, n_out, group=g, sequence_parallel=sp, float8=mm)
            with torch.no_grad():
                layer.weight.copy_(_block(weight, r, w, 0 if kind == "column" else 1))
                layer.bias.copy_(_block(bias, r, w, 0) if kind == "column" else bias)
            mine = x
            if kind == "row":
                mine = _block(x, r, w, -1)  # the row-parallel input: this rank's block of the last dim
            if sp:
                mine = _block(mine, r, w, 0) if kind == "column" else mine  # a sequence block, gathered inside
            mine = mine.clone().requires_grad_()
            y = layer(mine)
            if kind == "column":
                y_ref, dy_mine = _block(ref["y"], r, w, -1), _block(dy, r, w, -1)
            else:
                y_ref, dy_mine = (_block(ref["y"], r, w, 0), _block(dy, r, w, 0)) if sp else (ref["y"], dy)
            y.backward(dy_mine)
            gemm = layer.float8_gemm
            bf16_kept = gemm.mode == "bf16"
            label = (recipe, kind, n_in, n_out, sp, gemm.mode)
            linear = None if bf16_kept else (_block(ref["linear"], r, w, -1) if kind == "column" else
                                             _block(ref["linear"], r, w, 0) if sp else ref["linear"])
            if bf16_kept:  # no float8 at all: F.linear's numbers
                want = _block(ref["linear"], r, w, -1) if kind == "column" else ref["linear"]
                assert torch.allclose(y, want, atol=1e-5), label
            else:
                _compare(y, y_ref, linear, label + ("y",))
                gx = ref["x"]
                gx = _block(gx, r, w, 0) if (sp and kind == "column") else gx
                gx = _block(gx, r, w, -1) if kind == "row" else gx
                _compare(mine.grad, gx, None, label + ("grad x",))
                _compare(layer.weight.grad, _block(ref["w"], r, w, 0 if kind == "column" else 1), None,
                         label + ("grad w",))
                _compare(layer.bias.grad, _block(ref["b"], r, w, 0) if kind == "column" else ref["b"], None,
                         label + ("grad b",))
            out.append(label)
    return out


def _tp2_checks():
    from gptpar.parallel import init_parallel

    st = init_parallel(2, 1, 1)
    return {"layers": _layers_against_torchao(st), "graph_breaks": _graph_breaks(st)}


@pytest.fixture(scope="module")
def tp2():
    """The tp-2 checks below, in one spawn of 2 gloo ranks (rank 0's results)."""
    return run_distributed(_tp2_checks, 2, timeout=400)[0]


def test_parallel_layers_equal_torchaos_float8_linear(tp2):
    """gptpar's fp8 Column/RowParallelLinear at tp 2 (sequence parallel or not; plain, padded, kept in bf16)
    against torchao's Float8Linear holding the gathered weight, forward and backward, for each recipe. The
    tensors hold their amax in every row and column of every shard (`_planted`), so per-shard scales equal the
    unsharded layer's and the comparison is tight (2e-6 of the largest value, fp32 summation order), while float8
    rounding moves the output by > 1e-3 of it (checked): a layer that skipped float8, scaled wrongly or padded
    wrongly fails."""
    labels = tp2["layers"]
    modes = {label[-1] for label in labels}
    assert modes == {"fp8", "padded", "bf16"} and len(labels) == 2 * len(CASES)


# -- on a GPU: torch._scaled_mm, not the emulation --------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with float8 (compute capability 8.9+)")
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_float8_gemms_match_the_emulation(recipe):
    """The real path (torch._scaled_mm) at the 200B tp-8 slices, padded and plain, against torchao's emulation of
    the same casts (exact float8 rounding, fp32 matmuls): equal to accumulation order, while bf16's own GEMM is
    a float8 rounding away; and the unpadded query_key_value slice (5400 x 14400) is refused by _scaled_mm, which
    is why gptpar pads it."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 GEMMs need compute capability 8.9+")
    real, emulated = Float8Matmul(recipe, emulate=False), Float8Matmul(recipe, emulate=True)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def run(mm, gemm, x, weight, dy):
        x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y = mm.linear(x, weight, gemm)
        y.backward(dy)
        return y.detach().float(), x.grad.float(), weight.grad.float()

    rel = lambda a, b: float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())  # noqa: E731
    for out, inp in ((5400, 14400), (14400, 1800), (7200, 14400)):
        gemm = plan_float8_gemm(out, inp)
        assert gemm.mode == ("fp8" if out % 16 == inp % 16 == 0 else "padded")
        x = torch.randn(2048, 2, inp, device="cuda", dtype=torch.bfloat16, generator=gen)
        weight = torch.randn(out, inp, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        dy = torch.randn(2048, 2, out, device="cuda", dtype=torch.bfloat16, generator=gen)
        got, want = run(real, gemm, x, weight, dy), run(emulated, gemm, x, weight, dy)
        for name, a, b in zip(("y", "grad x", "grad w"), got, want):
            assert rel(a, b) < 1e-2, (recipe, out, inp, name, rel(a, b))
        assert rel(F.linear(x, weight).float(), want[0]) > 1e-3, (recipe, out, inp)
        if gemm.mode == "padded":
            unpadded = Float8Gemm("t", out, inp, "fp8", out, inp)
            with pytest.raises(Exception):
                run(real, unpadded, x, weight, dy)
    # a token count that does not divide by 16 (the grad-weight GEMM's inner dimension): torchao pads it
    gemm = plan_float8_gemm(7200, 14400)
    x = torch.randn(7, 3, 14400, device="cuda", dtype=torch.bfloat16, generator=gen)  # 21 tokens
    dy = torch.randn(7, 3, 7200, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(7200, 14400, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    got, want = run(real, gemm, x, weight, dy), run(emulated, gemm, x, weight, dy)
    assert all(rel(a, b) < 1e-2 for a, b in zip(got, want))


def _graph_breaks(st):
    """torch._dynamo.explain of a tp-2 transformer layer with fp8 GEMMs, plain (hidden 64) and padded (hidden 248:
    every slice padded): how many graphs each traces into."""
    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import TransformerLayer

    out = {}
    for h in (64, 248):
        config = GPTConfig(num_layers=1, hidden_size=h, num_attention_heads=4, seq_length=16, vocab_size=128,
                           hidden_dropout=0.0, attention_dropout=0.0)
        layer = TransformerLayer(config, 0, tp_group=st.tp_group, float8=Float8Matmul(emulate=True),
                                 dtype=torch.bfloat16)
        x = torch.randn(16, 2, h, dtype=torch.bfloat16, requires_grad=True)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer)(x)
        out[h] = ({g.mode for g in (layer.query_key_value.float8_gemm, layer.dense_h_to_4h.float8_gemm)},
                  explained.graph_count, [str(r.reason).splitlines()[0] for r in explained.break_reasons])
    return out


def test_a_compiled_layer_traces_fp8_in_one_graph(tp2):
    """Under torch.compile (regional, as training.compile compiles each layer) the float8 GEMMs - padded ones
    included - trace without a graph break: the row-parallel all-reduce gets a copy of the GEMM's output (torchao
    returns a view its backward owns), and the padded path leaves what backward keeps to the compiler."""
    out = tp2["graph_breaks"]
    assert out[64][0] == {"fp8"} and out[248][0] == {"padded"}
    for h, (_, graphs, reasons) in out.items():
        assert (graphs, reasons) == (1, []), h


# -- the weight casts cached per optimizer step ---------------------------------------------------------------------

def _gemm_run(mm, gemm, weight, x, dy, cache=None):
    """Float8Matmul.linear's output and the gradients of x and weight."""
    x.grad = weight.grad = None
    y = mm.linear(x, weight, gemm, cache)
    y.backward(dy)
    return y.detach(), x.grad.clone(), weight.grad.clone()


def _gemm_operands(gemm, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(gemm.out_features, gemm.in_features, dtype=torch.bfloat16, generator=g).requires_grad_()
    x = torch.randn(6, 2, gemm.in_features, dtype=torch.bfloat16, generator=g).requires_grad_()
    return weight, x, torch.randn(6, 2, gemm.out_features, dtype=torch.bfloat16, generator=g)


CACHED_GEMMS = [Float8Gemm("t", 48, 32, "fp8", 48, 32), Float8Gemm("t", 40, 24, "padded", 48, 32)]


@pytest.mark.parametrize("gemm", CACHED_GEMMS, ids=lambda g: g.mode)
def test_a_cached_weight_cast_equals_the_uncached_gemm_and_never_goes_stale(gemm):
    """Eager: with the weight's cast taken from its cache the GEMM's output and both gradients are the uncached
    GEMM's bit for bit (the weight gradient reaches the bf16 parameter, cut back when padded); after an in-place
    update through the parameter (an optimizer's `add_` under no_grad) the forward recasts by itself, and after a
    write it cannot see (`weight.data`) `refresh_float8_weights`' recast does - each time equal to a fresh uncached
    computation. Without the refresh that write leaves the cast as it was: the cache is what the GEMM used."""
    from gptpar.tensor_parallel.float8 import Float8WeightCache

    mm = Float8Matmul("tensorwise", emulate=True)
    assert mm.caches_weights and not Float8Matmul("rowwise", emulate=True).caches_weights
    weight, x, dy = _gemm_operands(gemm)
    cache = Float8WeightCache()
    mm.cast_weight(weight, gemm, cache)
    assert cache.valid and cache.data.dtype == torch.float8_e4m3fn and cache.data.shape == (48, 32)
    want = _gemm_run(mm, gemm, weight, x, dy)
    assert all(torch.equal(a, b) for a, b in zip(_gemm_run(mm, gemm, weight, x, dy, cache), want))
    assert not torch.equal(want[0], F.linear(x, weight))  # float8 rounding happened

    with torch.no_grad():
        weight.add_(0.5 * weight)  # seen by the version counter
    want = _gemm_run(mm, gemm, weight, x, dy)
    assert all(torch.equal(a, b) for a, b in zip(_gemm_run(mm, gemm, weight, x, dy, cache), want))

    old = weight.detach().clone()
    weight.data.copy_(torch.randn_like(weight))  # unseen, as DeepSpeed's flat-buffer writes
    stale = _gemm_run(mm, gemm, weight, x, dy, cache)[0]
    assert torch.equal(stale, mm.linear(x, old, gemm).detach())
    mm.cast_weight(weight, gemm, cache)  # what refresh_float8_weights does per layer
    want = _gemm_run(mm, gemm, weight, x, dy)
    assert all(torch.equal(a, b) for a, b in zip(_gemm_run(mm, gemm, weight, x, dy, cache), want))


class _TwoGemms(nn.Module):
    """A column-parallel linear in plain fp8 (128x128) and a row-parallel one padded (out 120 -> 128)."""

    def __init__(self, float8):
        from gptpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.a = ColumnParallelLinear(128, 128, float8=float8, dtype=torch.bfloat16)
        self.b = RowParallelLinear(128, 120, float8=float8, dtype=torch.bfloat16)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


def test_compiled_cached_casts_equal_the_uncached_graph_with_no_recompile_per_refresh():
    """Compiled in place as training.compile compiles a layer: over three steps (refresh, the step's forward and
    backward; invalidate, the same without cache; a weight update through `.data`, which no forward sees) the
    cached graph's output and gradients equal the uncached graph's bit for bit, and refreshes add no graph: two in
    all (cached and uncached), no graph break."""
    from torch._dynamo.utils import counters

    from gptpar.tensor_parallel.float8 import invalidate_float8_weights, refresh_float8_weights

    torch.manual_seed(0)
    model = _TwoGemms(Float8Matmul("tensorwise", emulate=True))
    assert (model.a.float8_gemm.mode, model.b.float8_gemm.mode) == ("fp8", "padded")
    x = torch.randn(8, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(8, 2, 120, dtype=torch.bfloat16)

    def run():
        x.grad = None
        model.zero_grad(set_to_none=True)
        model(x).backward(dy)
        return [x.grad] + [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    counters.clear()
    model.compile()
    for step in range(3):
        assert refresh_float8_weights(model) == 2
        got = run()
        invalidate_float8_weights(model)
        want = run()
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(0.01 * torch.randn_like(p))
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


def _trained_with_cache():
    """One rank, the trainer's model and DeepSpeed bf16 engine at fp8 (tensorwise): three train steps and an eval
    step, each forward's cached casts checked against a fresh cast of the weight it multiplies."""
    from gptpar.parallel import init_parallel
    from gptpar.tensor_parallel.float8 import Float8WeightCache
    from gptpar.testing.runs import engine_config, engine_for, synthetic_batches

    pstate = init_parallel(1, 1, 1)
    cfg = engine_config("bf16", 1, micro_batches=2)
    cfg.training.precision = "fp8"
    engine = engine_for(cfg, pstate)
    seen = {"cached": 0, "uncached": 0, "stale": 0}
    linear = Float8Matmul.linear

    def checking(self, x, weight, gemm, cache=None):
        if cache is not None and cache.valid:
            fresh = Float8WeightCache()
            self.cast_weight(weight, gemm, fresh)
            seen["cached"] += 1
            seen["stale"] += not (torch.equal(fresh.data.view(torch.uint8), cache.data.view(torch.uint8))
                                  and torch.equal(fresh.scale, cache.scale))
        else:
            seen["uncached"] += 1
        return linear(self, x, weight, gemm, cache)

    Float8Matmul.linear = checking
    try:
        for step in range(3):
            engine.train_step(synthetic_batches(cfg, pstate, consumed=step * cfg.training.global_batch_size))
        engine.eval_step(synthetic_batches(cfg, pstate))
    finally:
        Float8Matmul.linear = linear
    valid = [m.float8_weight_cache.valid for m in engine.ds.module.modules()
             if getattr(m, "float8_weight_cache", None) is not None]
    return seen, valid


def test_train_steps_use_the_cache_and_never_a_stale_cast():
    """Through gptpar's TrainEngine and DeepSpeed's BF16_Optimizer (whose update writes a flat buffer the
    parameters view, unseen by their version counters): every float8 GEMM of every micro-batch used the cache, each
    cached cast equal to a fresh cast of the current weight, and the caches are invalid once the step is over."""
    seen, valid = run_distributed(_trained_with_cache, 1, timeout=300)[0]
    assert seen["cached"] > 0 and seen["uncached"] == 0 and seen["stale"] == 0, seen
    assert valid and not any(valid)
