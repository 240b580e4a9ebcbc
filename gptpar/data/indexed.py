"""Megatron's MMIDIDX indexed dataset: a flat `.bin` of token ids plus an `.idx` describing it.

Byte layout of `{prefix}.idx` (little-endian; identical to Megatron-LM / Megatron-DeepSpeed, so files are
interchangeable both ways):

    b"MMIDIDX\\x00\\x00"      9-byte magic
    <Q  version             always 1
    <B  dtype code          1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    <Q  n_sequences
    <Q  n_doc_idx           = n_documents + 1
    int32[n_sequences]      sizes: tokens per sequence
    int64[n_sequences]      pointers: byte offset of each sequence in `.bin`
    int64[n_doc_idx]        doc_idx: first sequence of each document, then n_sequences

`{prefix}.bin` is the sequences' token ids back to back in that dtype. gptpar writes one sequence per
document (Megatron's default without --split-sentences), so "document" and "sequence" coincide in the GPT
dataset; the reader still accepts several sequences per document.

Both files are memory-mapped: opening a 100 GB dataset costs nothing, and `get` returns views, not copies.
"""
import array
import hashlib
import os
import struct

import numpy as np

from gptpar.data.files import DataError, data_file_path, index_file_path  # noqa: F401 (re-exported)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
# magic + version + dtype code + two counts
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8


def best_dtype(vocab_size):
    """Megatron's rule: uint16 when every id fits (vocab < 65500), else int32."""
    return np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)


def _strip_suffix(prefix):
    """Accept `x.bin` / `x.idx` where a prefix was meant, a common slip."""
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


def _mmap(path):
    # np.memmap refuses empty files; an empty .bin is legal (zero tokens).
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


def read_index(path):
    """Parse and validate an `.idx` file; returns (dtype, sizes, pointers, doc_idx) as read-only views."""
    if not os.path.exists(path):
        raise DataError(f"{path}: index file not found (preprocess the corpus with tools/preprocess_data.py; "
                        f"pass the prefix without .bin/.idx)")
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.read(HEADER_SIZE)
    if header[: len(MAGIC)] != MAGIC:
        raise DataError(f"{path}: wrong magic {header[:len(MAGIC)]!r}, expected {MAGIC!r}: not an MMIDIDX index "
                        f"(Megatron's older 'lazy'/'cached' formats are not supported; re-run preprocess_data.py)")
    if len(header) < HEADER_SIZE:
        raise DataError(f"{path}: truncated index header ({file_size} bytes, need {HEADER_SIZE})")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[len(MAGIC):])
    if version != VERSION:
        raise DataError(f"{path}: index version {version}, only version {VERSION} is supported")
    if code not in DTYPES:
        raise DataError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
    expected = HEADER_SIZE + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if file_size != expected:
        raise DataError(f"{path}: index is {file_size} bytes but its header ({n_seq} sequences, {n_doc} doc_idx "
                        f"entries) implies {expected}: the file is truncated or corrupt, re-create it")
    buf = _mmap(path)
    sizes = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=HEADER_SIZE)
    pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=HEADER_SIZE + 4 * n_seq)
    doc_idx = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=HEADER_SIZE + 12 * n_seq)
    dtype = DTYPES[code]
    # Vectorised consistency checks: pointers are the exclusive cumsum of sizes in bytes; doc_idx runs 0..n_seq.
    if n_seq and (pointers[0] != 0 or np.any(np.diff(pointers) != sizes[:-1].astype(np.int64) * dtype.itemsize)
                  or np.any(sizes < 0)):
        raise DataError(f"{path}: pointers do not match sizes for dtype {dtype.name}: corrupt index")
    if n_doc == 0 or doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0):
        raise DataError(f"{path}: doc_idx must rise from 0 to {n_seq}: corrupt index")
    return dtype, sizes, pointers, doc_idx


class IndexedDataset:
    """Read-only, memory-mapped view of `{prefix}.bin/.idx`.

    `len(ds)` is the number of sequences; `ds.get(i, offset, length)` returns a view of sequence i's tokens.
    """

    def __init__(self, prefix):
        prefix = _strip_suffix(prefix)
        self.prefix = prefix
        self.dtype, self.sizes, self.pointers, self.doc_idx = read_index(index_file_path(prefix))
        bin_path = data_file_path(prefix)
        if not os.path.exists(bin_path):
            raise DataError(f"{bin_path}: data file not found next to its index (copy both .bin and .idx)")
        n_tokens = int(self.sizes.sum(dtype=np.int64))
        expected, actual = n_tokens * self.dtype.itemsize, os.path.getsize(bin_path)
        if actual != expected:
            raise DataError(f"{bin_path}: {actual} bytes but the index describes {n_tokens} tokens of "
                            f"{self.dtype.name} = {expected} bytes; " + _size_hint(actual, expected, n_tokens))
        self.num_tokens = n_tokens
        self._bin = _mmap(bin_path)

    def __len__(self):
        return len(self.sizes)

    # Pickle by prefix (e.g. into spawned DataLoader workers): pickling the memmaps would copy the whole .bin.
    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])

    @property
    def num_documents(self):
        return len(self.doc_idx) - 1

    def get(self, i, offset=0, length=None):
        """Tokens [offset, offset + length) of sequence i, as a read-only view into the memory map."""
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: slice [{offset}, {offset + length}) outside sequence {i} of {size}")
        start = int(self.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start) if length else \
            np.zeros(0, dtype=self.dtype)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.get(j) for j in range(*i.indices(len(self)))]
        return self.get(int(i))

    def __iter__(self):
        return (self.get(i) for i in range(len(self)))

    def check_token_ids(self, vocab_size, chunk_tokens=1 << 26):
        """Raise DataError if any token id lies outside [0, vocab_size); scans the .bin in bounded chunks."""
        tokens = np.frombuffer(self._bin, dtype=self.dtype, count=self.num_tokens) if self.num_tokens else []
        for start in range(0, self.num_tokens, chunk_tokens):
            chunk = tokens[start: start + chunk_tokens]
            lo, hi = chunk.min(), chunk.max()
            if lo < 0 or hi >= vocab_size:
                bad = start + int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
                seq = int(np.searchsorted(self.pointers, bad * self.dtype.itemsize, side="right") - 1)
                raise DataError(f"{self.prefix}.bin: token id {int(tokens[bad])} in sequence {seq} is outside the "
                                f"vocabulary [0, {vocab_size}): the data was tokenized with another tokenizer")


def _size_hint(actual, expected, n_tokens):
    if n_tokens and actual % n_tokens == 0 and actual // n_tokens in {d.itemsize for d in DTYPES.values()}:
        return (f"dtype mismatch: the .bin holds {actual // n_tokens} bytes per token; "
                f"re-create .bin and .idx together")
    if actual < expected:
        return "the .bin is truncated (interrupted copy or write?); re-create or re-copy it"
    return "the .bin has trailing data: .bin and .idx come from different runs; re-create them together"


def write_index(path, dtype, sizes, doc_idx):
    """Write an `.idx` for sequences of `sizes` tokens of `dtype` stored back to back; pointers are derived."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<QBQQ", VERSION, DTYPE_CODES[dtype], len(sizes), len(doc_idx)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_idx.tobytes())


class IndexedDatasetBuilder:
    """Streams documents to `{prefix}.bin/.idx`, written under temporary names and renamed by `finalize`.

    An interrupted or failed build (exception inside `with`) leaves no file that looks complete.
    """

    def __init__(self, prefix, dtype, vocab_size=None):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise DataError(f"dtype {self.dtype} is not an MMIDIDX dtype")
        self.vocab_size = vocab_size
        self._tmp = f".tmp-{os.getpid()}"
        self._bin = open(data_file_path(prefix) + self._tmp, "wb")
        # Compact arrays, not lists: 4 + 8 bytes per document even for a billion documents.
        self._sizes = array.array("i")
        self._doc_idx = array.array("q", [0])
        # What gptpar.data.token_stats caches beside the files, gathered while writing (no second pass).
        self._sha1, self._min_id, self._max_id = hashlib.sha1(), None, None

    def _track(self, data, lo, hi):
        """Fold written bytes and their smallest/largest id (None for no tokens) into the stats."""
        self._sha1.update(data)
        if lo is not None:
            self._min_id = lo if self._min_id is None else min(self._min_id, lo)
            self._max_id = hi if self._max_id is None else max(self._max_id, hi)

    def add_document(self, ids):
        """Append one document (one sequence) of token ids."""
        arr = np.asarray(ids)
        lo = hi = None
        if arr.size:  # one min and one max per document serve the checks and the stats
            lo, hi = arr.min(), arr.max()
            if lo < 0 or (self.vocab_size is not None and hi >= self.vocab_size):
                raise DataError(f"{self.prefix}: token id {int(hi)} outside [0, {self.vocab_size}) "
                                f"in document {len(self._doc_idx) - 1}")
            if self.dtype.kind in "iu" and hi > np.iinfo(self.dtype).max:
                raise DataError(f"{self.prefix}: token id {int(hi)} does not fit {self.dtype.name}")
            lo, hi = int(lo), int(hi)
        data = arr.astype(self.dtype, copy=False).tobytes()
        self._bin.write(data)
        self._track(data, lo, hi)
        self._sizes.append(arr.size)
        self._doc_idx.append(len(self._sizes))

    def add_index(self, other):
        """Append every document of an IndexedDataset (used to merge datasets); copies the .bin in blocks."""
        if other.dtype != self.dtype:
            raise DataError(f"{other.prefix}: dtype {other.dtype.name} differs from {self.dtype.name}: cannot merge "
                            f"datasets tokenized with different dtypes (vocabularies); re-preprocess one of them")
        with open(data_file_path(other.prefix), "rb") as src:
            while block := src.read(1 << 24):  # a multiple of every dtype's size: whole tokens per block
                self._bin.write(block)
                tokens = np.frombuffer(block, dtype=self.dtype)
                self._track(block, int(tokens.min()), int(tokens.max()))
        base = len(self._sizes)
        self._sizes.frombytes(np.ascontiguousarray(other.sizes, dtype=np.int32).tobytes())
        self._doc_idx.frombytes((other.doc_idx[1:] + base).astype(np.int64).tobytes())

    def finalize(self):
        """Write the index and move both files to their final names; returns the number of documents."""
        self._bin.close()
        idx_tmp = index_file_path(self.prefix) + self._tmp
        write_index(idx_tmp, self.dtype, self._sizes, self._doc_idx)
        # Remove a stale index first so a crash between the renames never pairs an old .idx with a new .bin.
        if os.path.exists(index_file_path(self.prefix)):
            os.remove(index_file_path(self.prefix))
        os.replace(data_file_path(self.prefix) + self._tmp, data_file_path(self.prefix))
        os.replace(idx_tmp, index_file_path(self.prefix))
        from gptpar.data.token_stats import write_stats

        write_stats(self.prefix, {"num_tokens": int(sum(self._sizes)), "min_id": self._min_id,
                                  "max_id": self._max_id, "bin_sha1": self._sha1.hexdigest()})
        return len(self._doc_idx) - 1

    def abort(self):
        self._bin.close()
        for path in (data_file_path(self.prefix) + self._tmp, index_file_path(self.prefix) + self._tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return False


def merge_datasets(prefixes, output_prefix):
    """Concatenate several MMIDIDX datasets (opened and validated first) into `output_prefix`."""
    datasets = [IndexedDataset(p) for p in prefixes]
    if not datasets:
        raise DataError("no input datasets to merge")
    with IndexedDatasetBuilder(output_prefix, datasets[0].dtype) as builder:
        for ds in datasets:
            builder.add_index(ds)
        return builder.finalize()
