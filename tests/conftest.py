"""The suite's ranks (gptpar.testing.run_distributed) fork from one server process that imported torch and DeepSpeed
once: a spawned rank spends 3-5 s of a 2-core machine importing them, and the suite starts ranks well over a hundred
times. Each rank is still a new process with the test's environment; the modules are the same files either way."""
from gptpar.testing import fork_ranks_from_server

fork_ranks_from_server(["torch", "torch.distributed", "deepspeed"])
