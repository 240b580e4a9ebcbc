"""An independent implementation of the MMIDIDX (.bin/.idx) format, written from the format's description and not
from gptpar.data.indexed: the reference the data tests compare gptpar's reader and writer with."""
import struct

import numpy as np

REF_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
              8: np.uint16}


def ref_read(prefix):
    """-> (numpy dtype, list of sequences, doc_idx) using only struct and np.frombuffer."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack("<Q", idx[9:17])
    assert version == 1
    dtype = np.dtype(REF_DTYPES[idx[17]])
    n_seq, n_doc = struct.unpack("<QQ", idx[18:34])
    sizes = np.frombuffer(idx, np.int32, n_seq, 34)
    pointers = np.frombuffer(idx, np.int64, n_seq, 34 + 4 * n_seq)
    doc_idx = np.frombuffer(idx, np.int64, n_doc, 34 + 12 * n_seq)
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    seqs = [np.frombuffer(data, dtype, int(n), int(p)) for n, p in zip(sizes, pointers)]
    return dtype, seqs, doc_idx.tolist()


def ref_write(prefix, seqs, dtype, doc_idx=None):
    dtype = np.dtype(dtype)
    code = {np.dtype(v): k for k, v in REF_DTYPES.items()}[dtype]
    doc_idx = list(range(len(seqs) + 1)) if doc_idx is None else doc_idx
    sizes = [len(s) for s in seqs]
    pointers, pos = [], 0
    for n in sizes:
        pointers.append(pos)
        pos += n * dtype.itemsize
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx)))
        f.write(np.asarray(sizes, np.int32).tobytes() + np.asarray(pointers, np.int64).tobytes())
        f.write(np.asarray(doc_idx, np.int64).tobytes())
