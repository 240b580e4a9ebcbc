"""GPT pre-training samples from MMIDIDX files (Megatron semantics), with split, epochs, shuffling and blending.

The documents of a split are concatenated, epoch after epoch, into one token stream; each epoch visits the
documents in its own random order. Sample j is the `seq_length + 1` tokens starting at stream position
`j * seq_length`, so consecutive samples share one token (the last target of one is the first input of the
next) and samples cross document boundaries. Samples are then shuffled *within* the group of samples that
start in the same epoch.

Everything is derived from (files, split, seq_length, seed) through counter-based generators keyed by
(seed, epoch): sample i does not depend on how many samples were asked for, so a run resumes by indexing
from its consumed-samples count, and a longer run starts with exactly the samples of a shorter one.
The three index arrays (document order, sample starts, shuffle) are built with vectorised numpy, cached as
.npy next to the data (or in cache_dir) and memory-mapped when reused.
"""
import hashlib
import json
import os
import re
import sys
import time

import numpy as np

from gptpar.data.blending import BlendedDataset, build_blending_indices, normalize_weights
from gptpar.data.files import file_sha1
from gptpar.data.indexed import DataError, IndexedDataset, index_file_path

INDEX_VERSION = 1  # bump when the index construction changes, to invalidate old caches
SPLIT_NAMES = ("train", "valid", "test")


def log(msg):
    print(f"[gptpar.data] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- parsing

def parse_data_path(data_path):
    """'A', ['A', 'B'], ['0.3', 'A', '0.7', 'B'] or '0.3 A 0.7 B' -> (prefixes, weights or None).

    The one data-path grammar: the config check (gptpar.config) and the datasets both call it."""
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise DataError("data_path is empty")

    def is_number(s):
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(items) >= 2 and is_number(items[0]):
        if len(items) % 2 or not all(is_number(w) for w in items[0::2]):
            raise DataError(f"weighted data_path must alternate weight and prefix ('0.3 A 0.7 B'), got {items}")
        weights = [float(w) for w in items[0::2]]
        normalize_weights(weights)  # the blend's own rule (positive, finite), checked here for the config check
        return items[1::2], weights
    numbers = [i for i, item in enumerate(items) if is_number(item)]
    if numbers:  # a number among prefixes is a weight whose neighbours went wrong, not a dataset name
        bad = [items[i] for i in range(0, len(items), 2) if not is_number(items[i])] if len(items) % 2 == 0 \
            and all(i % 2 == 0 for i in numbers) else []
        what = (f"{', '.join(map(repr, bad))} stand(s) where a weight belongs but is not a number" if bad else
                f"item(s) {', '.join(repr(items[i]) for i in numbers)} look like weights but do not alternate "
                "with prefixes")
        raise DataError(f"data_path {items}: {what}; a weighted blend alternates number and prefix "
                        "('0.3 A 0.7 B'), an unweighted one lists prefixes only")
    return items, None


_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_SPLIT_PATHS_GROUP = re.compile(r"\s*([^\s:]+)\s*:\s+(.*)", re.S)


def parse_valid_data_path(valid_data_path):
    """data.valid_data_path -> {set name or None: [(prefix, weight or None, (start, end)), ...]}.

    Three forms, each set's datasets read from document fraction `start` to `end` of every prefix:
      - a prefix or a blend in data_path's grammar: one unnamed set, all documents, {None: [...]};
      - a dict {name: prefix or blend}: named sets, all documents of each;
      - Megatron-DeepSpeed's weighted split paths, a list of (or one) "NAME: W1 S1:E1 PREFIX1, W2 S2:E2 PREFIX2"
        (its --valid-weighted-split-paths): named sets, each a blend of document ranges.
    """
    if isinstance(valid_data_path, dict):
        if not valid_data_path:
            raise DataError("valid_data_path is an empty dict: name at least one set, e.g. {\"en\": \"data/en\"}")
        return {_set_name(name): _whole(path, f"set {name!r}") for name, path in valid_data_path.items()}
    groups = [valid_data_path] if isinstance(valid_data_path, str) else list(valid_data_path)
    is_group = [isinstance(g, str) and _SPLIT_PATHS_GROUP.fullmatch(g) is not None for g in groups]
    if not any(is_group):
        return {None: _whole(valid_data_path, "")}
    if not all(is_group):
        raise DataError(f"valid_data_path {groups}: mixes weighted split paths (\"NAME: WEIGHT START:END PREFIX, "
                        "...\") with other items; write every set in that form, or use a dict {name: prefix}")
    sets = {}
    for group in groups:
        name, body = _SPLIT_PATHS_GROUP.fullmatch(group).groups()
        name = _set_name(name)
        if name in sets:
            raise DataError(f"valid_data_path names the set {name!r} twice: give each set its own name")
        sets[name] = [_split_path_entry(name, entry) for entry in body.split(",")]
        normalize_weights([w for _, w, _ in sets[name]])
    return sets


def _set_name(name):
    if not isinstance(name, str) or not _SET_NAME.fullmatch(name):
        raise DataError(f"validation set name {name!r} must be letters, digits, '_', '.' or '-' (it names "
                        "TensorBoard tags and metrics records)")
    return name


def _whole(path, where):
    try:
        prefixes, weights = parse_data_path(path)
    except DataError as e:
        raise DataError(f"{where + ': ' if where else ''}{e}") from None
    return [(p, w, (0.0, 1.0)) for p, w in zip(prefixes, weights or [None] * len(prefixes))]


def _split_path_entry(name, entry):
    """'WEIGHT START:END PREFIX' -> (prefix, weight, (start, end))."""
    fields = entry.split()
    problem = None
    if len(fields) != 3 or fields[1].count(":") != 1:
        problem = "must be WEIGHT START:END PREFIX"
    else:
        try:
            weight, (start, end) = float(fields[0]), map(float, fields[1].split(":"))
        except ValueError:
            problem = "WEIGHT, START and END must be numbers"
        else:
            if not 0.0 <= start < end <= 1.0:
                problem = "needs 0 <= START < END <= 1 (fractions of the prefix's documents)"
    if problem:
        raise DataError(f"valid_data_path set {name!r}: {entry.strip()!r} {problem}, e.g. \"1.0 0.95:1 "
                        "data/en_text_document\"")
    return fields[2], weight, (start, end)


def parse_split(split):
    """'949,50,1' (or '949/50/1', or fewer fields) -> three fractions summing to 1."""
    try:
        parts = [float(s) for s in str(split).replace("/", ",").split(",") if s.strip()]
    except ValueError:
        raise DataError(f"split {split!r} must be up to three comma-separated numbers, e.g. '949,50,1'") from None
    if not 1 <= len(parts) <= 3 or any(not (0 <= p < float("inf")) for p in parts) or sum(parts) <= 0:
        raise DataError(f"split {split!r} must be up to three non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def split_ranges(split, num_documents):
    """Document ranges [(start, stop)] x 3, rounded as Megatron's get_train_valid_test_split_."""
    fractions = parse_split(split)
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * num_documents)))
    diff = bounds[-1] - num_documents  # rounding drift is taken off every boundary after the first
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


# ---------------------------------------------------------------------------------- index construction

def _rng(seed, epoch, stream):
    # Counter-based seeding: epoch e's permutation is the same whatever the number of epochs built.
    return np.random.Generator(np.random.PCG64([seed, epoch, stream]))


def num_epoch_groups(tokens_per_epoch, seq_length, num_samples):
    """Smallest G such that the samples starting in epochs 0..G-1, ceil(G*T/s), are >= num_samples."""
    return max(1, (max(num_samples, 1) - 1) * seq_length // tokens_per_epoch + 1)


_BLOCK = 1 << 20  # documents per step of the sample index: bounds its temporaries whatever the corpus size


def _index_dtype(largest):
    """int32 where every value fits (as Megatron's index): halves the arrays and their cache."""
    return np.int32 if largest < np.iinfo(np.int32).max else np.int64


def build_doc_order(documents, num_epochs, seed):
    """Document ids in stream order: each epoch a fresh permutation of `documents`. (num_epochs * D,)

    Each epoch is shuffled in place in its slice of the result: Generator.shuffle makes the swaps that
    Generator.permutation makes, so the order is documents[permutation(D)] with no index array beside it."""
    documents = np.asarray(documents)
    n = len(documents)
    out = np.empty(num_epochs * n, dtype=_index_dtype(int(documents.max()) if n else 0))
    documents = documents.astype(out.dtype, copy=False)
    for e in range(num_epochs):
        part = out[e * n:(e + 1) * n]
        part[:] = documents
        _rng(seed, e, 0).shuffle(part)
    return out


def build_sample_idx(sizes, doc_order, docs_per_epoch, tokens_per_epoch, seq_length, num_samples):
    """Where each sample starts: (position in doc order, token offset in that document), each (num_samples,).

    sizes: tokens of every document id; doc_order: whole epochs of docs_per_epoch documents and tokens_per_epoch
    tokens each. Sample j starts at stream token j * seq_length, in the first document ending after it. Built per
    block of documents (how many samples start inside each, then np.repeat): linear in documents + samples, with
    no search and no array as long as the document order beside the results.
    """
    num_epochs = len(doc_order) // docs_per_epoch
    if num_samples and num_samples * seq_length >= num_epochs * tokens_per_epoch:
        raise DataError("internal: the document order is too short for the requested samples")
    doc_pos = np.empty(num_samples, dtype=np.int32 if len(doc_order) < np.iinfo(np.int32).max else np.int64)
    offset = np.empty(num_samples, dtype=_index_dtype(int(np.max(sizes, initial=0)) - 1))
    sizes = np.asarray(sizes)
    for epoch in range(num_epochs):
        base = epoch * tokens_per_epoch                              # stream position of the epoch's first token
        first = -(-base // seq_length)                               # the first sample starting in it
        stop = min(num_samples, -(-(base + tokens_per_epoch) // seq_length))
        done, carry = first, base
        for k0 in range(0, docs_per_epoch, _BLOCK):
            if done >= stop:
                break
            k1 = min(k0 + _BLOCK, docs_per_epoch)
            block = np.arange(epoch * docs_per_epoch + k0, epoch * docs_per_epoch + k1, dtype=np.int64)
            block_sizes = np.take(sizes, doc_order[block[0]:block[-1] + 1])  # take: twice indexing's speed
            ends = np.cumsum(block_sizes, dtype=np.int64)
            ends += carry                                            # stream end of each document
            carry = int(ends[-1])
            # Samples starting before each document's end, and so how many start inside each (none in an empty one).
            below = ends + (seq_length - 1)
            below //= seq_length
            np.clip(below, first, stop, out=below)
            counts = np.diff(below, prepend=done)
            n = int(below[-1]) - done
            doc_pos[done:done + n] = np.repeat(block, counts)
            ends -= block_sizes                                      # now where each document starts
            starts = np.arange(done * seq_length, (done + n) * seq_length, seq_length, dtype=np.int64)
            starts -= np.repeat(ends, counts)
            offset[done:done + n] = starts
            done += n
    if doc_pos.dtype == np.int64 and (num_samples == 0 or doc_pos[-1] < np.iinfo(np.int32).max):
        doc_pos = doc_pos.astype(np.int32)  # the positions only grow: the last is the largest
    return doc_pos, offset


def build_shuffle_idx(num_samples_per_group, seed):
    """A permutation of all samples that only mixes samples of the same epoch group. (sum,)

    Each group's range is shuffled in place: the same swaps as first + Generator.permutation(n)."""
    total = int(sum(num_samples_per_group))
    out = np.arange(total, dtype=_index_dtype(total - 1))
    first = 0
    for e, n in enumerate(num_samples_per_group):
        _rng(seed, e, 1).shuffle(out[first:first + n])
        first += n
    return out


def build_indices(sizes, documents, seq_length, seed, num_samples):
    """(doc_order, doc_pos, offset, shuffle) for a split's documents; pure numpy, no I/O."""
    tokens_per_epoch = int(np.asarray(sizes)[documents].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise DataError("the split's documents hold no tokens")
    groups = num_epoch_groups(tokens_per_epoch, seq_length, num_samples)
    total = -(-groups * tokens_per_epoch // seq_length)    # ceil(G*T/s) samples start in epochs 0..G-1
    last_token = (total - 1) * seq_length + seq_length      # stream position of the last token needed
    num_epochs = last_token // tokens_per_epoch + 1
    doc_order = build_doc_order(documents, num_epochs, seed)
    doc_pos, offset = build_sample_idx(sizes, doc_order, len(documents), tokens_per_epoch, seq_length, total)
    # Samples starting in epoch e: j in [ceil(e*T/s), ceil((e+1)*T/s)).
    group_starts = -(-np.arange(groups + 1, dtype=np.int64) * tokens_per_epoch // seq_length)
    shuffle = build_shuffle_idx(np.diff(group_starts).tolist(), seed)
    return doc_order, doc_pos, offset, shuffle


# ------------------------------------------------------------------------------------------- datasets

class GPTDataset:
    """Samples of `seq_length + 1` token ids from one MMIDIDX dataset's document range.

    `ds[i] == {"text": int64 array (seq_length + 1,)}`; inputs are text[:-1], labels text[1:].
    """

    def __init__(self, indexed, documents, seq_length, seed, num_samples, name="train", cache_dir=None):
        if seq_length < 1:
            raise DataError(f"seq_length must be >= 1, got {seq_length}")
        self.indexed, self.seq_length, self.name = indexed, seq_length, name
        documents = np.asarray(documents, dtype=np.int64)
        if len(documents) == 0 or int(np.asarray(indexed.sizes)[documents].sum()) == 0:
            raise DataError(f"{indexed.prefix}: the {name} split has no tokens ({len(documents)} documents); "
                            f"change the split or the data")
        arrays = self._load_or_build(documents, seed, num_samples, cache_dir)
        self.doc_order, self.doc_pos, self.offset, self.shuffle = arrays

    def _load_or_build(self, documents, seed, num_samples, cache_dir):
        # The .idx digest (not its name or mtime) keys the cache: re-preprocessing under the same name rebuilds.
        key = dict(version=INDEX_VERSION, idx=file_sha1(index_file_path(self.indexed.prefix)),
                   docs=hashlib.sha1(documents.tobytes()).hexdigest(), seq_length=self.seq_length, seed=seed,
                   groups=num_epoch_groups(max(int(self.indexed.sizes[documents].sum()), 1), self.seq_length,
                                           num_samples))
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        directory = cache_dir or os.path.dirname(os.path.abspath(self.indexed.prefix))
        base = os.path.join(directory, f"{os.path.basename(self.indexed.prefix)}_{self.name}_{digest}")
        paths = [f"{base}_{part}.npy" for part in ("doc_order", "doc_pos", "offset", "shuffle")]
        if all(os.path.exists(p) for p in paths):
            return [np.load(p, mmap_mode="r") for p in paths]
        log(f"building {self.name} sample index for {self.indexed.prefix}: {len(documents):,} documents, "
            f"seq_length {self.seq_length}, {num_samples:,} samples, seed {seed}")
        start = time.perf_counter()
        arrays = build_indices(self.indexed.sizes, documents, self.seq_length, seed, num_samples)
        epochs = len(arrays[0]) // len(documents)
        log(f"  built {len(arrays[3]):,} samples over {epochs} epoch(s) in {time.perf_counter() - start:.2f} s")
        try:
            os.makedirs(directory, exist_ok=True)
            for path, array in zip(paths, arrays):
                tmp = f"{path}.tmp-{os.getpid()}.npy"  # atomic: concurrent ranks never read half a file
                np.save(tmp, array)
                os.replace(tmp, path)
            log(f"  cached in {base}_*.npy")
        except OSError as e:
            log(f"  could not cache the index in {directory} ({e}); pass cache_dir to a writable directory")
        return arrays

    def __len__(self):
        return len(self.shuffle)

    def __getitem__(self, i):
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        j = int(self.shuffle[i])
        pos, offset = int(self.doc_pos[j]), int(self.offset[j])
        pieces, needed = [], self.seq_length + 1
        while needed > 0:
            doc = int(self.doc_order[pos])
            take = min(needed, int(self.indexed.sizes[doc]) - offset)
            pieces.append(self.indexed.get(doc, offset, take))
            needed -= take
            pos, offset = pos + 1, 0
        return {"text": np.concatenate(pieces).astype(np.int64)}


def _cache_blend(prefixes, weights, name, num_samples, cache_dir):
    """Blending indices, cached like the GPT indices (the greedy loop is the slow part for huge runs)."""
    key = json.dumps(dict(prefixes=[os.path.abspath(p) for p in prefixes], weights=list(map(float, weights)),
                          n=num_samples), sort_keys=True)
    directory = cache_dir or os.path.dirname(os.path.abspath(prefixes[0]))
    path = os.path.join(directory, f"blend_{name}_{hashlib.sha1(key.encode()).hexdigest()[:16]}.npy")
    if os.path.exists(path):
        both = np.load(path, mmap_mode="r")
        return both[0], both[1]
    start = time.perf_counter()
    dataset_index, sample_index = build_blending_indices(weights, num_samples)
    log(f"built {name} blending index of {num_samples:,} samples over {len(prefixes)} datasets "
        f"in {time.perf_counter() - start:.2f} s")
    try:
        tmp = f"{path}.tmp-{os.getpid()}.npy"
        _save_rows(tmp, dataset_index, sample_index)
        os.replace(tmp, path)
    except OSError as e:
        log(f"  could not cache the blending index in {directory} ({e})")
    return dataset_index, sample_index


def _save_rows(path, *rows, dtype=np.int64, chunk=1 << 22):
    """np.save(path, np.stack(rows).astype(dtype)), byte for byte, without the stacked copy: each row is converted
    and written a chunk at a time."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": (len(rows), len(rows[0]))}
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        for row in rows:
            for start in range(0, len(row), chunk):
                np.ascontiguousarray(row[start:start + chunk], dtype=dtype).tofile(f)


def build_train_valid_test_datasets(data_path, split, seq_length, seed, num_samples, cache_dir=None,
                                    vocab_size=None):
    """(train, valid, test) GPT datasets; None for a split with no documents or no samples requested.

    data_path: a prefix, a list of prefixes, or Megatron's weighted form ['0.3', 'A', '0.7', 'B'] /
    '0.3 A 0.7 B'. Each prefix is split by document with `split` (e.g. '949,50,1'), then the splits are
    blended with the weights (unweighted lists are weighted by their tokens in the split, i.e. concatenation).
    num_samples: (train, valid, test) sample counts; a dataset may hold more (whole epochs), never fewer.
    vocab_size: if given, every token id is checked to be < vocab_size (one pass over the data).
    """
    prefixes, weights = parse_data_path(data_path)
    if len(num_samples) != 3:
        raise DataError(f"num_samples must be (train, valid, test), got {num_samples}")
    indexed = [IndexedDataset(p) for p in prefixes]
    if vocab_size is not None:
        for ds in indexed:
            ds.check_token_ids(vocab_size)
    ranges = [split_ranges(split, ds.num_documents) for ds in indexed]
    results = []
    for s, name in enumerate(SPLIT_NAMES):
        n = int(num_samples[s])
        parts = [(ds, np.arange(*r[s])) for ds, r in zip(indexed, ranges)]
        if n > 0 and all(len(docs) == 0 for _, docs in parts):
            where = f"{len(indexed[0].sizes)} documents" if len(indexed) == 1 else "the datasets"
            if name == "train":
                raise DataError(f"{prefixes[0]}: split {split!r} leaves the train split no documents ({where}); "
                                f"check the data and the split")
            log(f"warning: split {split!r} leaves the {name} split no documents; {name} dataset is None")
        if n <= 0 or all(len(docs) == 0 for _, docs in parts):
            results.append(None)
            continue
        if len(indexed) == 1:
            ds, docs = parts[0]
            results.append(GPTDataset(ds, _sequences(ds, docs), seq_length, seed, n, name, cache_dir))
            continue
        for (ds, docs) in parts:
            if len(docs) == 0:
                raise DataError(f"{ds.prefix}: the {name} split {split!r} leaves it no documents; with several "
                                f"datasets every one needs documents in every used split")
        results.append(_blend(parts, weights, name, n, seq_length, seed, cache_dir))
    return tuple(results)


def _blend(parts, weights, name, num_samples, seq_length, seed, cache_dir):
    """A BlendedDataset of (IndexedDataset, documents) parts; weights None = by their tokens (concatenation)."""
    w = weights if weights is not None else [int(ds.sizes[_sequences(ds, d)].sum()) for ds, d in parts]
    dataset_index, sample_index = _cache_blend([ds.prefix for ds, _ in parts], w, name, num_samples, cache_dir)
    counts = [int(np.count_nonzero(dataset_index == d)) for d in range(len(parts))]  # no int64 copy, as bincount
    members = [GPTDataset(ds, _sequences(ds, docs), seq_length, seed, max(int(c), 1), name, cache_dir)
               for (ds, docs), c in zip(parts, counts)]
    return BlendedDataset(members, w, num_samples, dataset_index, sample_index)


def build_valid_datasets(valid_data_path, seq_length, seed, num_samples, cache_dir=None):
    """{set name or None: dataset of num_samples} for data.valid_data_path (see parse_valid_data_path): each
    prefix's document range [round(start * D), round(end * D)), blended by the weights as data_path is."""
    out = {}
    for set_name, entries in parse_valid_data_path(valid_data_path).items():
        name = "valid" if set_name is None else f"valid-{set_name}"  # distinct index caches per set
        parts = []
        for prefix, _, (start, end) in entries:
            ds = IndexedDataset(prefix)
            docs = np.arange(int(round(start * ds.num_documents)), int(round(end * ds.num_documents)))
            if len(docs) == 0:
                raise DataError(f"{prefix}: validation set {set_name or name!r} reads documents {start}:{end} of "
                                f"{ds.num_documents}, which is none; widen the range")
            parts.append((ds, docs))
        weights = None if entries[0][1] is None else [w for _, w, _ in entries]
        if len(parts) == 1:
            ds, docs = parts[0]
            out[set_name] = GPTDataset(ds, _sequences(ds, docs), seq_length, seed, num_samples, name, cache_dir)
        else:
            out[set_name] = _blend(parts, weights, name, num_samples, seq_length, seed, cache_dir)
    return out


def _sequences(ds, documents):
    """Sequence ids of a document range (identical for gptpar's one-sequence-per-document files)."""
    if len(documents) == 0:
        return documents
    return np.arange(ds.doc_idx[documents[0]], ds.doc_idx[documents[-1] + 1])
