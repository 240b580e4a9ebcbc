"""The log's model-wide numbers, each parameter counted once (a tp replica on one tp rank, the tied embedding on
one stage, the dp partitions summed): `params norm` (the metrics file's full-precision value) equals the norm of
a plain PyTorch model trained with the same seed and batches, and `num zeros` the zeros of the same run's
gradients gathered by DeepSpeed, at (tp, pp, dp) = (2,1,1) without ZeRO, (1,2,1), (1,1,2) and (2,2,1) with
ZeRO-1; under bf16 the norm is the fp32 master weights'. Also Megatron's memory report (printed once by each
rank of the first dp replica, the peak never below the resident), and the norms, the memory and the timers in
TensorBoard, read back with EventAccumulator.

The model has gradients that are exactly zero for a structural reason, so that a count that missed them or
counted a replica twice shows: the padded vocabulary rows of the tied embedding (kept out of the softmax) and
the rows of the position table past seq_length (max_position_embeddings is twice it). The position table is a
tp replica and the embedding a pp one.
"""
import copy
import json
import re

import pytest
import torch

from gptpar.model.config import GPTConfig
from gptpar.model.gpt import GPTModel
from gptpar.testing import run_distributed
from gptpar.training.engine import optimizer_param_groups
from gptpar.testing.runs import TINY, log_lines, read_jsonl, read_tensorboard, run_mains, synthetic_sample

LAYERS, HIDDEN, HEADS, SEQ, MAX_POS, VOCAB, PADDED_VOCAB = 2, 32, 4, 16, 32, 200, 256
GBS, ITERS, LR, WD, BETA2, CLIP, SEED = 8, 3, 1e-3, 0.01, 0.95, 1.0, 1234
MODEL = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
             max_position_embeddings=MAX_POS, vocab_size=VOCAB, make_vocab_size_divisible_by=128)
STRUCTURAL_ZEROS = (PADDED_VOCAB - VOCAB) * HIDDEN + (MAX_POS - SEQ) * HIDDEN


def serial_run():
    """(params norm after each step, zeros of each step's clipped gradients) of the tp = pp = dp = 1 model under
    torch's AdamW, on the trainer's synthetic global batches (sample i = randint seeded by (seed, i))."""
    model = GPTModel(GPTConfig(**MODEL), seed=SEED)
    opt = torch.optim.AdamW(optimizer_param_groups(model, WD), lr=LR, betas=(0.9, BETA2), eps=1e-8)
    norms, zeros = [], []
    for it in range(ITERS):
        text = torch.stack([synthetic_sample(SEED, it * GBS + i, VOCAB, SEQ) for i in range(GBS)])
        loss = model(text[:, :-1], labels=text[:, 1:])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        zeros.append(sum(int((p.grad == 0).sum()) for p in model.parameters()))  # parameters(): tied weight once
        opt.step()
        norms.append(float(torch.sqrt(sum(p.detach().double().pow(2).sum() for p in model.parameters()))))
    return norms, zeros


def write_run(d, name, tp, pp, zero_stage, **logging):
    """The tiny run at (tp, pp) with parallel.data_parallel_size left unset (its default: the world decides),
    a constant LR and both counts on."""
    cfg = copy.deepcopy(TINY)
    cfg["model"] = dict(MODEL)
    cfg["parallel"] = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    cfg["training"].update(global_batch_size=GBS, train_iters=ITERS, lr=LR, lr_decay_style="constant",
                           lr_warmup_iters=0, weight_decay=WD, adam_beta2=BETA2, clip_grad=CLIP, zero_stage=zero_stage)
    cfg["logging"] = dict(log_interval=1, log_num_zeros=True, log_params_norm=True,
                          metrics_file=str(d / f"{name}.jsonl"), **logging)
    with open(d / f"{name}.json", "w") as f:
        json.dump(cfg, f)
    return name, ["--config", str(d / f"{name}.json")]


def run_mains_gathering_zeros(runs):
    """On one harness rank: gptpar.training.pretrain.main for each (name, argv), as gptpar.testing.runs.run_mains, and before every
    optimizer step each parameter's zeros counted on its full gradient, gathered over dp by DeepSpeed
    (`safe_get_full_grad`: the parameter's own gradient, or its fragments of the ZeRO / BF16 buffers all-reduced
    over dp). {name: (exit code, output, [per step: [(pp, dp, tp rank, tp-split, tied copy, zeros)]])}."""
    from deepspeed.utils import safe_get_full_grad

    import gptpar.training.engine as engine_package

    build_engine, steps = engine_package.build_engine, []

    def build_and_watch(*args, **kwargs):
        engine = build_engine(*args, **kwargs)
        wrapper, step = engine.ds.optimizer, engine.ds.optimizer.step

        def count_then_step(*a, **kw):
            st = engine.pstate
            steps.append([(st.pp_rank, st.dp_rank, st.tp_rank, bool(getattr(p, "tensor_model_parallel", False)),
                           bool(getattr(p, "ds_pipe_replicated", False)), int((safe_get_full_grad(p) == 0).sum()))
                          for p in engine.ds.module.parameters()])
            return step(*a, **kw)

        wrapper.step = count_then_step
        return engine

    engine_package.build_engine = build_and_watch
    out = {}
    for name, argv in runs:
        steps.clear()
        (rc, output), = run_mains([(name, argv)]).values()
        out[name] = (rc, output, list(steps))
    return out


def gathered_zeros(per_rank, name):
    """Zeros per step over the gathered gradients, each parameter once: on dp rank 0 (every dp rank gathered the
    same), a tp-split one on every tp rank, a tp replica on tp rank 0, the tied embedding on its first stage;
    replicas are checked to agree zero for zero."""
    totals = []
    for step in range(ITERS):
        rows = [row for rank in per_rank for row in rank[name][2][step]]
        replicas = {}  # pp stage: {(dp, tp): zeros of the stage's unsplit parameters in order}
        for pp_rank, dp_rank, tp_rank, split, _, zeros in rows:
            if not split:
                replicas.setdefault(pp_rank, {}).setdefault((dp_rank, tp_rank), []).append(zeros)
        assert all(len({tuple(v) for v in stage.values()}) == 1 for stage in replicas.values())
        totals.append(sum(zeros for _, dp_rank, tp_rank, split, tied, zeros in rows
                          if dp_rank == 0 and not tied and (split or tp_rank == 0)))
    return totals


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("norms")
    # ZeRO-0 (the optimizer steps on the parameters) and ZeRO-1 (on flat fp32 partitions over dp)
    two = [write_run(d, "tp2", 2, 1, 0, tensorboard_dir=str(d / "tb_tp2"), timers=True),
           write_run(d, "pp2_zero1", 1, 2, 1, tensorboard_dir=str(d / "tb_pp2"), tensorboard_tags="gptpar"),
           write_run(d, "dp2_zero1", 1, 1, 1)]
    four = [write_run(d, "tp2pp2_zero1", 2, 2, 1)]
    out = {2: run_distributed(run_mains_gathering_zeros, 2, (two,), timeout=400),
           4: run_distributed(run_mains_gathering_zeros, 4, (four,), timeout=400)}
    return d, out, serial_run()


RUNS = [("tp2", 2), ("pp2_zero1", 2), ("dp2_zero1", 2), ("tp2pp2_zero1", 4)]


@pytest.mark.parametrize("name,world", RUNS)
def test_params_norm_equals_the_serial_models_and_num_zeros_the_gathered_count(runs, name, world):
    """params norm to 1e-6 of the serial model's; num zeros equal to the count on the gathered gradients, and
    within the key bias's size of the serial count (the key bias' gradient is zero in exact arithmetic, so a few
    of its entries round to exactly 0 or not depending on the summation order: the serial count is not exact)."""
    d, out, (norms, serial_zeros) = runs
    assert all(rank[name][0] == 0 for rank in out[world]), [rank[name][1][-2000:] for rank in out[world]]
    records = [r for r in read_jsonl(d / f"{name}.jsonl") if "lm_loss" in r and not r.get("eval")]
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert [r["params_norm"] for r in records] == pytest.approx(norms, rel=1e-6, abs=0)
    gathered = gathered_zeros(out[world], name)
    assert [r["num_zeros"] for r in records] == gathered
    for count, serial in zip(gathered, serial_zeros):
        assert STRUCTURAL_ZEROS <= count <= STRUCTURAL_ZEROS + LAYERS * HIDDEN  # padded vocab rows, unused positions
        assert abs(count - serial) <= LAYERS * HIDDEN
    printed = [line for rank in out[world] for line in log_lines(rank[name][1])]
    assert len(printed) == ITERS  # one log rank
    for line, r in zip(printed, records):
        assert f" num zeros: {r['num_zeros']:.1f} | params norm: {r['params_norm']:.3f} |" in line


def bf16_norms():
    """On a harness rank (dp 2, bf16: BF16_Optimizer's fp32 master weights partitioned over dp), after 3 steps:
    (params norm, the norm of the fp32 master weights DeepSpeed gathers, the norm of the bf16 weights)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from gptpar.parallel import init_parallel
    from gptpar.training.assembly import build_gpt
    from gptpar.training.engine import build_engine

    st = init_parallel(tp=1, pp=1, dp=2)
    model = build_gpt(GPTConfig(**MODEL), st, seed=SEED, dtype=torch.bfloat16)
    config = {"train_batch_size": GBS, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GBS // 4,
              "gradient_clipping": CLIP, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "fp32"}, "steps_per_print": 10 ** 9}
    engine = build_engine(model, st, config, lr=1e-2)
    for it in range(3):
        text = torch.stack([synthetic_sample(SEED, it * GBS + i, VOCAB, SEQ) for i in range(GBS)])
        mine = text[st.dp_rank * GBS // 2:(st.dp_rank + 1) * GBS // 2]
        engine.train_step([{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in mine.split(2)])

    def norm(tensors):
        return float(torch.sqrt(sum(t.double().pow(2).sum() for t in tensors)))

    params = list(engine.parameters())
    return (engine.params_norm(), norm(safe_get_full_fp32_param(p) for p in params),
            norm(p.detach() for p in params))


def test_params_norm_is_the_fp32_master_weights_norm_under_bf16():
    """Megatron-LM reads `main_param`: under BF16_Optimizer the norm is the fp32 master weights' (here partitioned
    over dp 2 and summed), not their bf16 rounding's, which differs measurably after a few steps."""
    for mine, master, bf16 in run_distributed(bf16_norms, 2, timeout=300):
        assert mine == pytest.approx(master, rel=1e-6)
        assert abs(mine - bf16) > 10 * abs(mine - master)


MEMORY_LINE = re.compile(r"^\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| resident: ([0-9.e+]+) "
                         r"\| max resident: ([0-9.e+]+)$", re.M)


@pytest.mark.parametrize("name,world", RUNS)
def test_memory_report_once_per_rank_of_the_first_replica(runs, name, world):
    """Megatron's report_memory line on CPU: /proc/self/status's VmRSS and VmHWM in MB, once, after the first
    log line, by every rank of the first dp replica (all ranks but dp2's rank 1 here), the peak never below the
    resident."""
    _, out, _ = runs
    for rank, rank_out in enumerate(out[world]):
        reports = MEMORY_LINE.findall(rank_out[name][1])
        if name.startswith("dp2") and rank == 1:
            assert reports == []
            continue
        assert len(reports) == 1, rank_out[name][1][-2000:]
        r, iteration, resident, peak = reports[0]
        assert (int(r), int(iteration)) == (rank, 1)
        assert float(peak) >= float(resident) > 0


def test_tensorboard_holds_norms_memory_and_timers(runs):
    """Megatron-DeepSpeed's tags for params norm and num zeros (each also vs samples / tokens) equal to the metrics
    file's values, Megatron-LM's `mem-*-bytes` (here the CPU's resident and peak, the largest over the ranks: at
    least what rank 0 reported), and Megatron's timer tags `<timer>-time` in seconds per iteration, equal to the
    metrics file's ms / 1000."""
    d, out, (norms, _) = runs
    scalars = read_tensorboard(d / "tb_tp2")
    metrics = read_jsonl(d / "tp2.jsonl")
    records = [r for r in metrics if "lm_loss" in r]
    steps, samples = list(range(1, ITERS + 1)), [GBS * it for it in range(1, ITERS + 1)]
    for tag, key in (("params-norm/params-norm", "params_norm"), ("num-zeros/num-zeros", "num_zeros")):
        assert [step for step, _ in scalars[tag]] == steps
        assert [v for _, v in scalars[tag]] == pytest.approx([r[key] for r in records], rel=1e-6)  # fp32 there
        assert [step for step, _ in scalars[f"{tag} vs samples"]] == samples
        assert f"{tag} vs tokens" in scalars
    resident, peak = scalars["mem-resident-bytes"], scalars["mem-max-resident-bytes"]
    assert [step for step, _ in resident] == [step for step, _ in peak] == steps
    assert all(p >= r > 0 for (_, r), (_, p) in zip(resident, peak))
    (_, _, reported_resident, reported_peak), = MEMORY_LINE.findall(out[2][0]["tp2"][1])
    assert peak[0][1] >= (float(reported_peak) - 0.05) * 2 ** 20  # the largest over the ranks (the line rounds to 0.1 MB)
    # the metrics file's memory fields: the same peaks, so far in the run at every record (never falling); on CPU
    # nothing is reserved
    fields = [r["max_allocated_bytes"] for r in records]
    assert fields == pytest.approx([p for _, p in peak], rel=1e-6) and fields == sorted(fields)
    assert all(r["max_reserved_bytes"] is None for r in records)
    timers = [r for r in metrics if r.get("timers")]
    assert len(timers) == ITERS
    for name, tag in (("batch", "batch-generator-time"), ("forward", "forward-compute-time"),
                      ("backward", "backward-compute-time"), ("micro-step", "micro-step-time"),
                      ("optimizer", "optimizer-time"), ("other", "other-time")):
        assert [v for _, v in scalars[tag]] == pytest.approx([t["ms_per_iteration"][name] / 1e3 for t in timers],
                                                              rel=1e-6)
    # gptpar's tag style: train/params_norm, train/num_zeros, memory/<label>_bytes
    gptpar_style = read_tensorboard(d / "tb_pp2")
    assert {"train/params_norm", "train/num_zeros", "memory/resident_bytes", "memory/max_resident_bytes"} <= set(
        gptpar_style)
    assert [v for _, v in gptpar_style["train/params_norm"]] == pytest.approx(norms, rel=1e-6)
