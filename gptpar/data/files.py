"""What every data module shares: the error type and the names of a dataset's files (MMIDIDX `.bin` / `.idx`).

Its own module so that indexed.py (which writes the token statistics while building) and token_stats.py (which
reads the files) both import it without importing each other.
"""


class DataError(ValueError):
    """A data file or record is unusable; the message names the file and says how to fix it."""


def data_file_path(prefix):
    return prefix + ".bin"


def index_file_path(prefix):
    return prefix + ".idx"


__all__ = ["DataError", "data_file_path", "index_file_path"]
