"""Streaming, validated reading of jsonl corpora: every error names the file, the line and the fix."""
import json
import os

from gptpar.data.indexed import DataError


def check_input_file(path):
    if not os.path.isfile(path):
        raise DataError(f"{path}: input file not found")


def iter_lines(path, start_line=1):
    """Yield (line_number, raw bytes) without loading the file; blank lines are skipped."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=start_line):
            if raw.strip():
                yield lineno, raw


def iter_chunks(path, max_lines, max_bytes):
    """Group `iter_lines` into lists of at most `max_lines` lines or about `max_bytes` bytes (one worker task).

    The byte bound keeps tasks similar in cost when document lengths vary a lot, so workers stay balanced.
    """
    chunk, n_bytes = [], 0
    for item in iter_lines(path):
        chunk.append(item)
        n_bytes += len(item[1])
        if len(chunk) == max_lines or n_bytes >= max_bytes:
            yield chunk
            chunk, n_bytes = [], 0
    if chunk:
        yield chunk


def parse_record(raw, lineno, path, keys):
    """Decode one jsonl line and return [text for each key]; raise DataError naming what is wrong."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno}: invalid UTF-8 at byte {e.start} of the line; "
                        f"re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                        f"each line must be one JSON object") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
    texts = []
    for key in keys:
        if key not in record:
            raise DataError(f"{path}:{lineno}: missing json key {key!r} (keys present: {sorted(record)}); "
                            f"pick the right ones with --json-keys")
        if not isinstance(record[key], str):
            raise DataError(f"{path}:{lineno}: field {key!r} is {type(record[key]).__name__}, expected a string")
        texts.append(record[key])
    return texts


def iter_texts(path, keys):
    """Yield the text of every key of every record (for tokenizer training); `.txt` files yield their lines."""
    check_input_file(path)
    if not path.endswith((".jsonl", ".json")):
        for lineno, raw in iter_lines(path):
            try:
                yield raw.decode("utf-8").rstrip("\n")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid UTF-8 at byte {e.start}; re-encode as UTF-8") from None
        return
    for lineno, raw in iter_lines(path):
        yield from parse_record(raw, lineno, path, keys)
