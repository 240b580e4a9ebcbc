"""The smallest and largest token id of an MMIDIDX dataset and a checksum of its `.bin`, cached beside it.

    {prefix}.stats.json   {"version", "idx_sha1", "bin_size", "bin_mtime_ns", "bin_sha1", "num_tokens",
                           "min_id", "max_id"}

One pass over the `.bin` (bounded chunks, memory-mapped) gives the ids and the checksum; later starts read
the cache while the `.bin`'s size and modification time are unchanged. When they changed, the pass runs
again, and a `.bin` whose checksum differs from the one first recorded for the same `.idx` is refused: a
`.bin` of another dataset (same size by chance, or copied over) would otherwise train silently on tokens
the index does not describe. `IndexedDatasetBuilder` writes the cache while preprocessing, so even the
first run on a swapped `.bin` is caught.
"""
import hashlib
import json
import os

import numpy as np

from gptpar.data.files import DataError, data_file_path, file_sha1, index_file_path

STATS_VERSION = 1


def stats_path(prefix):
    return prefix + ".stats.json"


def _bin_identity(prefix):
    st = os.stat(data_file_path(prefix))
    return {"bin_size": st.st_size, "bin_mtime_ns": st.st_mtime_ns}


def scan(ds, chunk_tokens=1 << 24):
    """{num_tokens, min_id, max_id, bin_sha1} of an IndexedDataset, in one pass over its .bin."""
    h = hashlib.sha1()
    lo, hi = None, None
    n = ds.num_tokens
    tokens = np.frombuffer(ds._bin, dtype=ds.dtype, count=n) if n else np.zeros(0, dtype=ds.dtype)
    for start in range(0, n, chunk_tokens):
        chunk = tokens[start: start + chunk_tokens]
        h.update(chunk)  # the memory-mapped view itself, no copy
        c_lo, c_hi = int(chunk.min()), int(chunk.max())
        lo = c_lo if lo is None else min(lo, c_lo)
        hi = c_hi if hi is None else max(hi, c_hi)
    return {"num_tokens": n, "min_id": lo, "max_id": hi, "bin_sha1": h.hexdigest()}


def write_stats(prefix, stats, idx_sha1=None):
    """Cache `stats` (scan's keys) for the current .idx/.bin of `prefix` (`idx_sha1`: the .idx's checksum when the
    caller already has it); quietly skipped on a read-only folder."""
    record = dict(version=STATS_VERSION, idx_sha1=idx_sha1 or file_sha1(index_file_path(prefix)),
                  **_bin_identity(prefix), **stats)
    tmp = f"{stats_path(prefix)}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, stats_path(prefix))
    except OSError:
        return False
    return True


def read_stats(prefix):
    try:
        with open(stats_path(prefix)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("version") == STATS_VERSION else None


def token_stats(ds, log=print):
    """scan(ds), from the cache when the .bin is unchanged; raises DataError for a .bin that is not the one
    first recorded with this .idx."""
    prefix = ds.prefix
    cached = read_stats(prefix)
    idx_sha1 = file_sha1(index_file_path(prefix))
    if cached is not None and cached.get("idx_sha1") == idx_sha1 and \
            all(cached.get(k) == v for k, v in _bin_identity(prefix).items()):
        return cached
    log(f"scanning {data_file_path(prefix)} for its token ids ({ds.num_tokens:,} tokens; cached in "
        f"{stats_path(prefix)})")
    stats = scan(ds)
    if cached is not None and cached.get("idx_sha1") == idx_sha1 and cached.get("bin_sha1") != stats["bin_sha1"]:
        raise DataError(f"{data_file_path(prefix)} is not the .bin that was first used with {index_file_path(prefix)} "
                        f"(checksum {stats['bin_sha1'][:12]}, recorded {str(cached.get('bin_sha1'))[:12]} in "
                        f"{stats_path(prefix)}): a .bin of another dataset? Copy the matching .bin and .idx together "
                        f"(or re-create both); if this .bin is right, delete {stats_path(prefix)}")
    write_stats(prefix, stats, idx_sha1)
    return stats


__all__ = ["token_stats", "scan", "write_stats", "read_stats", "stats_path"]
