"""What every data module shares: the error type, the names of a dataset's files (MMIDIDX `.bin` / `.idx`) and
their checksum.

Its own module so that indexed.py (which writes the token statistics while building) and token_stats.py (which
reads the files) both import it without importing each other.
"""

import hashlib


class DataError(ValueError):
    """A data file or record is unusable; the message names the file and says how to fix it."""


def data_file_path(prefix):
    return prefix + ".bin"


def index_file_path(prefix):
    return prefix + ".idx"


def file_sha1(path) -> str:
    """SHA-1 of a file's bytes, read in 16 MiB blocks (the caches beside a dataset key on it)."""
    h = hashlib.sha1()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


__all__ = ["DataError", "data_file_path", "index_file_path", "file_sha1"]
