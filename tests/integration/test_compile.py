"""training.compile: the transformer layers through torch.compile, regionally (one graph for every layer).

References: the same runs eager (the losses of 6 iterations within 1e-5, fp32, dropout 0: inductor draws its own
random numbers, so dropout is off where the two are compared), and the compiled run itself (an exact resume; full and
selective recompute replaying dropout exactly). Counts, not times: Dynamo's graph and graph-break counters
(`gptpar.model.gpt.compile_stats`) must show one graph for all the layers and no break, with dropout on.

Each compiled case costs tens of seconds of compilation on 2 cores; the module shares an inductor cache folder
between its processes (TORCHINDUCTOR_CACHE_DIR), each spawn runs several trainings that reuse one compiled graph, and
the cases beyond the first two are marked slow.
"""
import math

import pytest
import torch

from gptpar.testing import run_distributed
from gptpar.testing.runs import log_lines, read_jsonl, run_mains, write_config

STEPS = 6


@pytest.fixture(scope="module")
def inductor_env(tmp_path_factory):
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}


# ---------------------------------------------------------------------------------------------------------------
# The model alone: one graph for every layer, no graph break, dropout on, recompute replaying it
# ---------------------------------------------------------------------------------------------------------------

# What a compiled model with a loss adds to the layers' graph(s): the loss's forward and backward kernels
# (gptpar.tensor_parallel.cross_entropy, compiled with the layers by compile_transformer_layers).
LOSS_GRAPHS = 2


def _train_model(mode, layers, dropout, compiled, position="learned"):
    """3 SGD steps of a GPTModel on one repeated batch: the losses and the last step's gradients."""
    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import GPTModel, compile_transformer_layers
    from gptpar.tensor_parallel.random import model_parallel_seed

    config = GPTConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                       hidden_dropout=dropout, attention_dropout=dropout, position_embedding_type=position,
                       embed_layernorm=position == "alibi")
    model = GPTModel(config, rng_tracker=model_parallel_seed(7), activation_checkpointing=mode, seed=3).train()
    if compiled:
        assert compile_transformer_layers(model) == layers
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        loss = model(x[:, :-1], labels=x[:, 1:])
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, [n for n, _ in model.named_parameters()]


def _graphs_with_dropout(modes, position="learned", layers=10):
    """Compiled runs of each mode (dropout 0.1), the compile counters, and an eager model's parameter names."""
    from gptpar.model.gpt import compile_stats

    out = {mode: _train_model(mode, layers, 0.1, compiled=True, position=position) for mode in modes}
    out["stats"] = compile_stats()
    out["eager_names"] = _train_model("none", layers, 0.1, compiled=False, position=position)[2]
    return out


def test_one_graph_for_all_layers_no_breaks_with_dropout(inductor_env):
    """Dropout 0.1 (attention and hidden), 10 layers - more than Dynamo's recompile limit (8), so a graph per layer
    would have fallen back to eager: one graph for the layers (and the loss's two), no graph break; the model trains; full recompute replays every
    mask (the same losses and gradients as without recompute); the parameter names are the eager model's."""
    out = run_distributed(_graphs_with_dropout, 1, (("none", "full"),), env=inductor_env, timeout=600)[0]
    assert out["stats"]["graphs"] == 1 + LOSS_GRAPHS and out["stats"]["graph_breaks"] == 0, out["stats"]
    losses, grads, names = out["none"]
    assert losses[-1] < losses[0]  # it trains (one batch, SGD)
    assert names == out["eager_names"]
    full_losses, full_grads, _ = out["full"]
    assert full_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(full_grads, grads))


@pytest.mark.slow
def test_selective_recompute_alibi_embedding_layernorm_compiled_with_dropout(inductor_env):
    """Selective recompute inside the graph (torch's checkpoint) replays the attention dropout: the same losses and
    gradients as without recompute (within fp32 reordering), with ALiBi and the embedding LayerNorm; one graph per
    mode, no break."""
    out = run_distributed(_graphs_with_dropout, 1, (("none", "selective"), "alibi", 3), env=inductor_env,
                          timeout=900)[0]
    assert out["stats"]["graph_breaks"] == 0 and out["stats"]["graphs"] == 2 + LOSS_GRAPHS, out["stats"]
    (l0, g0, names), (l1, g1, _) = out["none"], out["selective"]
    assert l0[-1] < l0[0] and names == out["eager_names"]
    assert max(abs(a - b) for a, b in zip(l0, l1)) < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(g0, g1)) < 1e-5


def test_counter_dropout_mask():
    """The compiled residual dropout's mask: rate p, scale 1/(1-p), a function of (seed, index) only, and under
    sequence parallelism (offset = block * numel) exactly the whole tensor's mask, block by block."""
    from gptpar.tensor_parallel.random import counter_dropout

    x = torch.ones(256, 4, 1024)
    seed, other = torch.tensor(12345), torch.tensor(54321)
    y = counter_dropout(x, 0.1, seed)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.9) < 6 * (0.09 / x.numel()) ** 0.5  # 6 sigma of a binomial
    assert torch.equal(y[kept], torch.full_like(y[kept], 1 / 0.9))
    assert torch.equal(counter_dropout(x, 0.1, seed), y)  # no generator state
    other_kept = counter_dropout(x, 0.1, other) != 0
    assert abs((kept & other_kept).float().mean().item() - 0.81) < 0.005  # independent of another seed's mask
    blocks = [counter_dropout(b, 0.1, seed, offset=i * b.numel()) for i, b in enumerate(x.chunk(4))]
    assert torch.equal(torch.cat(blocks), y)
    assert counter_dropout(x, 0.0, seed) is x


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_counter_dropout_int32_hash_is_the_int64_hash(device):
    """The int32 hash (indices below 2^31) keeps exactly the elements the int64 formula keeps - eager and compiled
    (inductor: C++ on a CPU, Triton on a GPU), for several seeds and offsets up to the int32 limit - so the fast
    form changes no mask."""
    from gptpar.tensor_parallel.random import _counter_hash_int64, counter_dropout

    x = torch.ones(64, 3, 40, device=device)
    compiled = torch.compile(counter_dropout)
    for seed in (0, 1, 12345, 2 ** 31 - 1):
        seed = torch.tensor(seed, device=device)
        for offset in (0, 7 * x.numel(), 2 ** 31 - x.numel()):
            reference = (_counter_hash_int64(x.shape, seed, offset, x.device) >> 8) >= round(0.1 * (1 << 24))
            assert torch.equal(counter_dropout(x, 0.1, seed, offset) != 0, reference), (int(seed), offset)
            assert torch.equal(compiled(x, 0.1, seed, offset) != 0, reference), (int(seed), offset)
    big = 2 ** 31 - x.numel() // 2  # straddles 2^31: the int64 path, the same formula
    seed = torch.tensor(99, device=device)
    reference = (_counter_hash_int64(x.shape, seed, big, x.device) >> 8) >= round(0.1 * (1 << 24))
    assert torch.equal(counter_dropout(x, 0.1, seed, big) != 0, reference)


def _streams_at_tp2():
    """What the compiled layer draws from: the seeds (default stream) and the tracker's stream, on each tp rank."""
    import torch.distributed as dist

    from gptpar.parallel import init_parallel
    from gptpar.tensor_parallel.random import dropout_seeds, model_parallel_seed

    st = init_parallel(tp=2)
    tracker = model_parallel_seed(7, tp_rank=st.tp_rank)
    seeds = dropout_seeds(torch.device("cpu"))
    with tracker.fork():
        private = torch.rand(16)
    out = []
    for t in (seeds, private):
        parts = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(parts, t, group=st.tp_group)
        out.append(parts)
    return out


def test_compiled_dropout_streams_agree_and_differ_per_tp_rank():
    """The residual dropouts' seeds are the same on both tp ranks (replicated activations get the same mask); the
    attention dropout's stream (the tracker's, entered around the graph) differs per rank."""
    (seeds, private), _ = run_distributed(_streams_at_tp2, 2, timeout=120)
    assert torch.equal(seeds[0], seeds[1]) and not torch.equal(private[0], private[1])


def _tp2_dropout_graph():
    import torch.distributed as dist

    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import GPTModel, compile_stats, compile_transformer_layers
    from gptpar.parallel import init_parallel
    from gptpar.tensor_parallel.random import model_parallel_seed

    st = init_parallel(tp=2)
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                       hidden_dropout=0.1, attention_dropout=0.1)
    model = GPTModel(config, tp_group=st.tp_group, rng_tracker=model_parallel_seed(7, tp_rank=st.tp_rank)).train()
    compile_transformer_layers(model)
    outputs = []
    model.layers[-1].register_forward_hook(lambda module, inputs, output: outputs.append(output.detach()))
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(x[:, :-1], labels=x[:, 1:]).backward()
    parts = [torch.empty_like(outputs[-1]) for _ in range(2)]
    dist.all_gather(parts, outputs[-1], group=st.tp_group)
    return torch.equal(parts[0], parts[1]), compile_stats()


@pytest.mark.slow
def test_compiled_tp2_dropout_keeps_the_replicated_stream_identical(inductor_env):
    """tp 2 without sequence parallelism, dropout 0.1, compiled: the residual stream (replicated over tp) is still
    bitwise the same on both ranks after the dropouts, in one graph without a break."""
    # rank 1's vocabulary slice is all padding (64 ids padded to 256): its loss keeps the loop, no loss kernels
    for (same, stats), loss_graphs in zip(run_distributed(_tp2_dropout_graph, 2, env=inductor_env, timeout=900),
                                          (LOSS_GRAPHS, 0)):
        assert same and stats["graphs"] == 1 + loss_graphs and stats["graph_breaks"] == 0, stats


# ---------------------------------------------------------------------------------------------------------------
# The trainer: compiled against eager, checkpoints across compile on/off, the compile time out of the log line
# ---------------------------------------------------------------------------------------------------------------

def _trainer_plan(d, name, **sections):
    """Runs of one topology: eager and compiled (6 iterations each); compiled to 3 then resumed eager, eager to 3
    then resumed compiled, compiled to 3 then resumed compiled. Dropout 0."""
    runs = []

    def config(tag, compile_, **extra):
        training = dict(sections.get("training", {}), compile=compile_)
        return write_config(d / f"{name}_{tag}.json", **{**sections, "training": training,
                                                         "logging": dict(metrics_file=str(d / f"{name}_{tag}.jsonl"))},
                            **extra)

    runs.append((f"{name}_eager", ["--config", config("eager", False)]))
    runs.append((f"{name}_compiled", ["--config", config("compiled", True)]))
    for tag, first, second in (("on_off", True, False), ("off_on", False, True), ("on_on", True, True)):
        ck = dict(save=str(d / f"{name}_{tag}_ck"), load=str(d / f"{name}_{tag}_ck"))
        runs.append((f"{name}_{tag}_a", ["--config", config(f"{tag}_a", first, checkpoint=ck),
                                         "--set", "training.exit_interval=3"]))
        runs.append((f"{name}_{tag}_b", ["--config", config(f"{tag}_b", second, checkpoint=ck)]))
    return runs


def _losses(d, run):
    return [r["lm_loss"] for r in read_jsonl(d / f"{run}.jsonl") if not r.get("eval")]


def _check_trainer(d, out, name, log_rank):
    for rank_out in out:
        for run, (rc, text) in rank_out.items():
            assert rc == 0, f"{run}: {text[-3000:]}"
    eager, compiled = _losses(d, f"{name}_eager"), _losses(d, f"{name}_compiled")
    assert len(eager) == len(compiled) == STEPS
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= 1e-5 * abs(a), (eager, compiled)
    # Checkpoints carry the same parameter names either way: each resumed run continues its reference.
    for tag, reference in (("on_off", eager), ("off_on", compiled), ("on_on", compiled)):
        first, second = _losses(d, f"{name}_{tag}_a"), _losses(d, f"{name}_{tag}_b")
        assert len(first) == 3 and len(second) == 3
        for a, b in zip(first + second, reference):
            assert abs(a - b) <= 1e-5 * abs(a), (tag, first + second, reference)
    assert _losses(d, f"{name}_on_on_a") + _losses(d, f"{name}_on_on_b") == compiled  # exact resume, compiled
    # The compile time: printed once, by the log rank, in the first compiled run of the process; iteration 1's
    # elapsed time leaves it out (a step of this model takes milliseconds, the compilation seconds).
    text = out[log_rank][f"{name}_compiled"][1]
    said = [line for line in text.splitlines() if line.startswith("training.compile: ")]
    assert len(said) == 1 and "0 graph break(s)" in said[0], said
    compile_s = float(said[0].split(" compiled in ")[1].split(" s ")[0])
    first = read_jsonl(d / f"{name}_compiled.jsonl")[0]
    assert first["elapsed_s"] < compile_s / 2, (compile_s, first["elapsed_s"])
    assert "transformer layers=torch.compile" in out[0][f"{name}_compiled"][1]  # rank 0's start-up lines
    assert "transformer layers=eager" in out[0][f"{name}_eager"][1]
    assert len(log_lines(text)) == STEPS


def test_trainer_compiled_tp2_sequence_parallel_selective_alibi(tmp_path, inductor_env):
    """(tp, pp, dp) = (2, 1, 1) with sequence parallelism (the collectives traced into the graph), selective
    recompute, ALiBi and the embedding LayerNorm, fp32: compiled equals eager; checkpoints cross compile on/off."""
    sections = dict(model=dict(position_embedding_type="alibi", embed_layernorm=True),
                    parallel=dict(tensor_model_parallel_size=2, data_parallel_size=1, sequence_parallel=True),
                    training=dict(activation_checkpointing="selective", train_iters=STEPS))
    out = run_distributed(run_mains, 2, (_trainer_plan(tmp_path, "tp2", **sections), inductor_env), timeout=900)
    _check_trainer(tmp_path, out, "tp2", log_rank=0)


@pytest.mark.slow
@pytest.mark.parametrize("name,world,sections,log_rank", [
    ("plain", 1, dict(parallel=dict(data_parallel_size=None)), 0),  # (1, 1, 1), dp left unset
    ("pp2_full", 2, dict(parallel=dict(pipeline_model_parallel_size=2, data_parallel_size=1),
                         training=dict(activation_checkpointing="full")), 1),
    ("dp2_full", 2, dict(training=dict(activation_checkpointing="full")), 0),
])
def test_trainer_compiled_more_topologies(tmp_path, inductor_env, name, world, sections, log_rank):
    """(1, 1, 1) without recompute; (1, 2, 1) through DeepSpeed's pipeline engine with full recompute; (1, 1, 2) with
    full recompute (ZeRO-1): compiled equals eager, checkpoints cross compile on/off."""
    out = run_distributed(run_mains, world, (_trainer_plan(tmp_path, name, **sections), inductor_env), timeout=1200)
    _check_trainer(tmp_path, out, name, log_rank=log_rank)


def _bf16_dropout_run(d, env):
    from gptpar.model.gpt import compile_stats

    cfg = write_config(d / "bf16.json", model=dict(hidden_dropout=0.1, attention_dropout=0.1),
                       parallel=dict(tensor_model_parallel_size=2, data_parallel_size=1),
                       training=dict(compile=True, precision="bf16", train_iters=8),
                       logging=dict(metrics_file=str(d / "bf16.jsonl")))
    return run_mains([("bf16", ["--config", cfg])], env)["bf16"], compile_stats()


@pytest.mark.slow
def test_trainer_compiled_bf16_tp2_with_dropout_trains_without_breaks(tmp_path, inductor_env):
    """bf16 (BF16_Optimizer), tp 2 without sequence parallelism (counter-based dropout on the replicated residual
    stream), dropout 0.1: 8 finite losses, one graph, no break, on both ranks."""
    for (rc, text), stats in run_distributed(_bf16_dropout_run, 2, (tmp_path, inductor_env), timeout=900):
        assert rc == 0, text[-3000:]
        assert stats["graph_breaks"] == 0 and stats["graphs"] == 1 + LOSS_GRAPHS, stats
    losses = [r["lm_loss"] for r in read_jsonl(tmp_path / "bf16.jsonl")]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
