"""The suite's ranks (gptpar.testing.run_distributed) fork from one server process that imported torch, DeepSpeed and
torch._dynamo once, and froze the garbage collector's view of them: a spawned rank would spend seconds importing
torch and DeepSpeed, and every `deepspeed.initialize` imports torch._dynamo (DeepSpeed's Muon optimizer module)
and, in bf16, runs `gc.collect()` six times on rank 0 over all of it. The suite starts ranks well over a hundred
times (the time this saves: docs/benchmarks.md, "The test suite's own time"). Each rank is still a new
process with the test's environment; the modules are the same files either way. Nothing below reads at import an
environment variable a test sets for its ranks (TORCHINDUCTOR_CACHE_DIR is read when a graph compiles)."""
from gptpar.testing import fork_ranks_from_server

fork_ranks_from_server(["torch", "torch.distributed", "deepspeed",
                        "deepspeed.runtime.zero.muon.muon_optimizer",  # imports torch._dynamo
                        "torch._dynamo", "torch._inductor.compile_fx"])  # torch.compile's, for training.compile
