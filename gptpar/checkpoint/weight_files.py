"""Weight and checkpoint files that name themselves: a missing, empty, truncated or unreadable file gives one
message naming it, never torch's `PytorchStreamReader failed reading zip archive`, the `OSError: [Errno 22]` of
mapping an empty file, or transformers' `no file named model.safetensors`.

`file_problem(path)` says what is wrong with a file without loading it, so that the preflight and the tools
check every file they will open before anything is built; `load_torch_file` is `torch.load` that turns a
failure into the caller's error class, naming the file. A torch file is a zip archive whose directory sits at
its end, so a truncated one fails to open as a zip; a safetensors file starts with the length of its JSON
header, which must fit inside the file, and its tensors must end where the file ends.
"""
from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from typing import Callable, Iterable, List, Optional

import torch

HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # what transformers loads, in its order
HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # sharded weights


def file_problem(path: str) -> Optional[str]:
    """None when `path` looks whole, else what is wrong with it ("is missing", "is empty (0 bytes)", ...): a
    `.pt` must open as a zip archive, a `.safetensors` must hold its header and tensors, any file must be
    readable."""
    if not os.path.lexists(path):
        return "is missing"
    if not os.path.isfile(path):
        return "is not a regular file"
    try:
        size = os.path.getsize(path)
        if size == 0:
            return "is empty (0 bytes)"
        if path.endswith(".pt"):
            with zipfile.ZipFile(path):
                pass
        elif path.endswith(".safetensors"):
            return _safetensors_problem(path, size)
        else:
            with open(path, "rb") as f:
                f.read(1)
    except zipfile.BadZipFile:
        return "is not a whole torch file (truncated or corrupt: no zip directory at its end)"
    except OSError as e:
        return f"cannot be read ({type(e).__name__}: {e.strerror or e})"
    return None


def _safetensors_problem(path: str, size: int) -> Optional[str]:
    """A safetensors file: 8 bytes of header length, the JSON header, then the tensors' bytes up to the end."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes: not even a safetensors header)"
        length = struct.unpack("<Q", head)[0]
        if 8 + length > size:
            return f"is truncated ({size} bytes, its safetensors header alone needs {8 + length})"
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return "is not a safetensors file (its header is not JSON)"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"
            and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list)]
    if 8 + length + max(ends, default=0) > size:
        return f"is truncated ({size} bytes, its tensors end at byte {8 + length + max(ends)})"
    return None


def file_problems(paths: Iterable[str]) -> List[str]:
    """"PATH what is wrong" for every file of `paths` that is not whole, in order."""
    return [f"{path} {problem}" for path in paths for problem in [file_problem(path)] if problem]


def load_torch_file(path: str, error: Callable[[str], Exception], fix: str = "", **kwargs):
    """torch.load(path, map_location="cpu", **kwargs); a file that cannot be read raises `error` naming it and
    what is wrong (then `fix`). An UnpicklingError (weights_only refusing an object) is the caller's to word."""
    try:
        return torch.load(path, map_location="cpu", **kwargs)
    except pickle.UnpicklingError:
        raise
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        problem = file_problem(path) or f"cannot be read ({type(e).__name__}: {first})"
        raise error(f"{path} {problem}{fix}") from None


def hf_weight_files(directory: str) -> List[str]:
    """The weight files transformers would load from a Hugging Face model directory: the first of
    HF_WEIGHT_FILES present, or every shard a HF_INDEX_FILES index names; [] when there is none (or the index
    is unreadable)."""
    for name in HF_WEIGHT_FILES:
        if os.path.lexists(os.path.join(directory, name)):
            return [os.path.join(directory, name)]
    for name in HF_INDEX_FILES:
        index = os.path.join(directory, name)
        if os.path.lexists(index):
            try:
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return []  # an index that names no shards: no weights transformers can load
            return [os.path.join(directory, shard) for shard in shards]
    return []


__all__ = ["HF_WEIGHT_FILES", "file_problem", "file_problems", "load_torch_file", "hf_weight_files"]
