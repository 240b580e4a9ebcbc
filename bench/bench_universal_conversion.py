"""How long the universal conversion at a resume takes on 1, 2 and 4 ranks: a checkpoint saved at (tp, pp, dp) =
(1, 2, 1) converted by one process (gptpar.checkpoint.resume.write_universal_copy, what a 1-rank resume runs) and
over 2 and 4 ranks (gptpar.training.preflight.convert_over_ranks, what a resume of several ranks runs), each copy
checked byte for byte against the 1-rank one through its manifest (every file's sha256). Besides the wall time, each
rank's CPU seconds (time.process_time) in its conversion: on a machine with fewer free cores than ranks the wall
time cannot fall, and the busiest rank's CPU time shows how the work was divided:

    python bench/bench_universal_conversion.py                    # 8 layers x 512, 2 rounds
    python bench/bench_universal_conversion.py --layers 2 --hidden 64 --rounds 1

The checkpoint is written first by a 2-rank run of one iteration (fp32, synthetic data) into a temporary folder;
the rounds alternate the rank counts (1, 2, 4, 1, 2, 4, ...). A conversion's time is the slowest rank's, from a
barrier before it to its return (its share, its source files' sha256, the metadata and the manifest); the ranks'
process start and their first import of the model code are not in it. Prints one line per conversion and a summary per rank count.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def convert(ckpt: str, out: str) -> tuple:
    """On each harness rank: the conversion of `ckpt` into `out` over every rank; (its seconds, this process's CPU
    seconds in it, every thread's)."""
    import torch
    import torch.distributed as dist
    from types import SimpleNamespace

    from gptpar.checkpoint.layout import LoadTarget
    from gptpar.checkpoint.manifest import open_folder
    from gptpar.checkpoint.resume import UniversalCopy, carried_counters, read_rank_state, write_universal_copy
    from gptpar.training.preflight import convert_over_ranks

    import gptpar.model.gpt  # noqa: F401 - a run has imported its model code before its preflight converts

    rank, world = dist.get_rank(), dist.get_world_size()
    copy = None
    if rank == 0:  # the copy a resume plans: its counters carried
        counters = carried_counters(read_rank_state(ckpt, 0, open_folder(ckpt, "", print, quiet=True)))
        copy = UniversalCopy(LoadTarget(os.path.dirname(ckpt), os.path.basename(ckpt)), out, counters, "bench")
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    if world == 1:
        write_universal_copy(copy, lambda *a: None)
    else:
        convert_over_ranks(copy, SimpleNamespace(rank=rank, world_size=world, device=torch.device("cpu")),
                           lambda *a: None)
    return time.perf_counter() - start, time.process_time() - cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from gptpar.checkpoint.layout import MANIFEST
    from gptpar.testing import run_distributed
    from gptpar.testing.runs import run_mains, write_config

    work = tempfile.mkdtemp(prefix="bench_universal_")
    try:
        ck = os.path.join(work, "ck")
        config = write_config(os.path.join(work, "c.json"),
                              model=dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                                         seq_length=64, vocab_size=8192),
                              parallel=dict(pipeline_model_parallel_size=2, data_parallel_size=1),
                              training=dict(train_iters=1, lr_warmup_iters=0, eval_interval=None,
                                            micro_batch_size=1, global_batch_size=2),
                              checkpoint=dict(save=ck, save_interval=1))
        (rc, out), = run_distributed(run_mains, 2, ([("save", ["--config", config])],), timeout=1800)[0].values()
        if rc != 0:
            print(out[-3000:])
            return 1
        ckpt = os.path.join(ck, "iter_0000001")
        size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
        print(f"checkpoint {args.layers} layers x {args.hidden} at (tp, pp, dp) = (1, 2, 1): {size / 2 ** 20:.0f} MiB")
        seconds, cpus, reference = {n: [] for n in args.ranks}, {n: [] for n in args.ranks}, None
        for round_ in range(args.rounds):
            for n in args.ranks:
                out_dir = os.path.join(work, f"u{n}_{round_}")
                times = run_distributed(convert, n, (ckpt, out_dir), timeout=1800)
                took, cpu = max(t for t, _ in times), [c for _, c in times]
                with open(os.path.join(out_dir, MANIFEST)) as f:
                    files = json.load(f)["files"]
                reference = reference or files
                same = files == reference
                seconds[n].append(took)
                cpus[n].append(max(cpu))
                print(f"round {round_ + 1}, {n} rank(s): {took:.2f} s, CPU s per rank "
                      f"{' / '.join(f'{c:.2f}' for c in cpu)}, the same files as the first 1-rank copy: {same}")
                shutil.rmtree(out_dir)
                if not same:
                    return 1
        for n in args.ranks:
            s = seconds[n]
            print(f"{n} rank(s): median {statistics.median(s):.2f} s (min {min(s):.2f}, max {max(s):.2f}; "
                  f"{len(s)} conversions); the busiest rank's CPU: median {statistics.median(cpus[n]):.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
