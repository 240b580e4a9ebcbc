"""Imported last by the rank server of `gptpar.testing.fork_ranks_from_server`: moves every object the server's
imports made into the garbage collector's permanent generation (`gc.freeze`), so that the ranks forked from it never
scan them again (DeepSpeed's BF16_Optimizer calls `gc.collect()` six times on rank 0 while it builds, each over
torch's, DeepSpeed's and torch._dynamo's objects; docs/benchmarks.md, the test suite's own time) and the collector's
writes do not copy their pages."""
import gc

gc.freeze()
