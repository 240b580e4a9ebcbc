"""jsonl -> tokens -> MMIDIDX, streaming and multi-process (the engine behind tools/preprocess_data.py).

Memory stays bounded whatever the corpus size: lines are read lazily in chunks, at most
`workers * IN_FLIGHT_PER_WORKER` chunks are being tokenised at once, and results are written in input order
as they come back, so the output does not depend on the number of workers.
"""
import collections
import multiprocessing
import os
import time

import numpy as np

from gptpar.data.indexed import DataError, IndexedDatasetBuilder, best_dtype
from gptpar.data.jsonl import check_input_file, iter_chunks, iter_lines, parse_record
from gptpar.data.tokenizer import load_tokenizer

# One worker task: up to 256 lines or ~256 KB, small enough to balance workers, big enough to amortise IPC.
CHUNK_LINES = 256
CHUNK_BYTES = 1 << 18
IN_FLIGHT_PER_WORKER = 4

# Each worker process loads the tokenizer once (in `_init_worker`) rather than once per chunk.
_worker = {}


def _init_worker(tokenizer_path, keys, append_eod, input_path):
    _worker.update(tokenizer=load_tokenizer(tokenizer_path), keys=keys, append_eod=append_eod, path=input_path)


def encode_chunk(chunk):
    """[(lineno, raw line)] -> (list over records of [int32 ids per key], bytes read), or ("error", message)."""
    tok, keys, path = _worker["tokenizer"], _worker["keys"], _worker["path"]
    docs, n_bytes = [], 0
    for lineno, raw in chunk:
        n_bytes += len(raw)
        try:
            texts = parse_record(raw, lineno, path, keys)
        except DataError as e:
            return "error", str(e)
        per_key = []
        for text in texts:
            ids = tok.encode(text)
            # An empty text stays empty (and is skipped) even with --append-eod: a lone EOD is not a document.
            if ids and _worker["append_eod"]:
                ids.append(tok.eod)
            per_key.append(np.asarray(ids, dtype=np.int32))
        docs.append(per_key)
    return docs, n_bytes


def _ordered_bounded_map(pool, fn, items, max_in_flight):
    """Like pool.imap (ordered) but never reads more than `max_in_flight` items ahead of the consumer.

    pool.imap's feeder thread drains the whole input iterator at once, which would read the corpus into RAM.
    """
    pending = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def output_prefix_for(output_prefix, key):
    """Megatron's naming: one dataset per json key, `{prefix}_{key}_document`."""
    return f"{output_prefix}_{key}_document"


def preprocess(input_path, keys, tokenizer_path, output_prefix, workers=1, append_eod=False,
               log_interval=1000, progress=True):
    """Tokenise a jsonl corpus into `{output_prefix}_{key}_document.bin/.idx`; returns a summary dict."""
    # Cheap checks first, so a typo fails in a second rather than after hours of tokenisation.
    check_input_file(input_path)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(out_dir):
        raise DataError(f"{output_prefix}: output directory {out_dir} does not exist; create it first")
    if workers < 1:
        raise DataError(f"--workers must be >= 1, got {workers}")
    tokenizer = load_tokenizer(tokenizer_path)
    first = next(iter_lines(input_path), None)
    if first is None:
        raise DataError(f"{input_path}: no records (the file is empty)")
    parse_record(first[1], first[0], input_path, keys)

    init_args = (tokenizer_path, list(keys), append_eod, input_path)
    chunks = iter_chunks(input_path, CHUNK_LINES, CHUNK_BYTES)
    pool = None
    if workers == 1:
        _init_worker(*init_args)
        results = map(encode_chunk, chunks)
    else:
        # spawn: workers start clean (no inherited threads or locks from the parent).
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init_args)
        results = _ordered_bounded_map(pool, encode_chunk, chunks, workers * IN_FLIGHT_PER_WORKER)

    dtype = best_dtype(tokenizer.vocab_size)
    n_docs, tokens, empty = 0, dict.fromkeys(keys, 0), dict.fromkeys(keys, 0)
    start = time.perf_counter()
    builders = [IndexedDatasetBuilder(output_prefix_for(output_prefix, k), dtype, tokenizer.vocab_size)
                for k in keys]
    bar = _progress_bar(os.path.getsize(input_path), progress)
    try:
        next_log = log_interval
        for result in results:
            if result[0] == "error":
                raise DataError(result[1])
            docs, n_bytes = result
            for per_key in docs:
                for key, builder, ids in zip(keys, builders, per_key):
                    if ids.size == 0:
                        empty[key] += 1
                        continue
                    builder.add_document(ids)
                    tokens[key] += ids.size
            n_docs += len(docs)
            if bar is not None:
                bar.update(n_bytes)
                if n_docs >= next_log:
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"{n_docs / elapsed:,.0f} docs/s, {sum(tokens.values()) / elapsed:,.0f} tok/s")
                    next_log = n_docs + log_interval
        for builder in builders:
            builder.finalize()
    except BaseException:
        for builder in builders:
            builder.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    elapsed = time.perf_counter() - start
    return {"docs": n_docs, "tokens": tokens, "empty_skipped": empty, "seconds": elapsed,
            "tokens_per_second": sum(tokens.values()) / max(elapsed, 1e-9),
            "outputs": [output_prefix_for(output_prefix, k) for k in keys], "dtype": dtype.name}


def _progress_bar(total_bytes, enabled):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", smoothing=0.1)
