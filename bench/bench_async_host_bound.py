"""The host memory an asynchronous save holds, unbounded and through checkpoint.async_host_buffer_mb's bounded pool:

    python bench/bench_async_host_bound.py          # seconds, on one CPU core

One async save (gptpar's CheckpointWriter, no processes, no DeepSpeed) of 8 fp32 tensors of 16 MiB (128 MiB), twice
per bound (none, 64, 32 and 16 MiB). Per save: the process's peak resident-memory growth (/proc/self/statm, sampled
every 2 ms), when the snapshot was whole (the optimizer step after a save waits for that), when the file was
written, and the most bytes the bounded pool held.
"""
import os
import tempfile
import threading
import time

import torch

from gptpar.checkpoint.writer import CheckpointWriter

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 2 ** 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def one_save(limit, folder):
    state = {f"t{i}": torch.full((4 * MIB,), float(i)) for i in range(8)}
    base, peak, stop = rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss() - base)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    writer = CheckpointWriter(async_save=True, checksums=False, host_limit=limit, log=lambda *a: None)
    start = time.perf_counter()
    writer.save(state, os.path.join(folder, "state.pt"))
    writer.start(lambda records, error: error, name="bench")
    writer.wait_for_snapshot()
    whole = time.perf_counter() - start
    assert writer.wait() is None
    written = time.perf_counter() - start
    stop.set()
    sampler.join()
    return peak[0] / MIB, whole, written, writer.snapshot_peak_bytes / MIB


def main():
    folder = tempfile.mkdtemp()
    print("| bound | peak RSS growth | snapshot whole after | written after | pool peak |")
    print("|---|---|---|---|---|")
    for limit in (None, 64 * MIB, 32 * MIB, 16 * MIB):
        for _ in range(2):
            growth, whole, written, pool = one_save(limit, folder)
            bound = "none" if limit is None else f"{limit // MIB} MiB"
            print(f"| {bound} | {growth:.1f} MiB | {whole:.2f} s | {written:.2f} s | {pool:.1f} MiB |")


if __name__ == "__main__":
    main()
