"""The manifest every folder gptpar writes carries, and the one verification every reader goes through.

`gptpar_manifest.json` (written last by gptpar.checkpoint.durable, before the folder gets its name) records every
file of the folder: its size, its sha256 (unless checkpoint.checksums is off) and, in a training checkpoint, the
rank that wrote it. Its `kind` says what the folder is: a training `checkpoint`, a `universal` copy, a
`weights-only` checkpoint or a `huggingface` export. The manifest, nothing else, makes a folder complete.

Reading a folder starts with `open_folder`: the manifest read (a missing one refused for a folder gptpar wrote,
`gptpar_marks` telling which, so that deleting the manifest never turns verification off), every listed file there
with its size; a folder gptpar did not write (DeepSpeed's ds_to_universal.py output, a Hugging Face model) is said in
one line to carry no checksums. The manifest is the list: a reader opens only the files it lists (one it needs
that is unlisted is refused, naming it; others beside them are named in one line and never read), and a manifest
of a version this gptpar does not read, or one that lists no files, is refused.

The `Verifier` it returns checks each file against its sha256 *before* any of its bytes reach a parser: the file
is hashed through a read-only memory map, then loaded (a torch file with `torch.load(path, mmap=True)`, a
safetensors file mapped), so its bytes come from disk once (the load reads them from the page cache) and no
anonymous copy of the file is made. Damage anywhere (the pickle, a tensor's bytes, the zip's records) is then one
refusal naming the file, never the unpickler's own crash. The cost per GB is in docs/checkpoints.md.
"""
from __future__ import annotations

import glob
import hashlib
import json
import mmap
import os
import pickle
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from gptpar.checkpoint.exceptions import CheckpointError
from gptpar.checkpoint.layout import CONFIG, MANIFEST, OWNER, STATE_FILE_RE, UNIVERSAL_META
from gptpar.checkpoint.weight_files import file_problem

DIGEST = "sha256"  # of each file's bytes: `sha256sum FILE` prints the same
VERSION = 3  # 2: {"files": {rel: {"size", "sha256", "rank"}}, "iteration", "world_size"}; 3 adds "kind"
READ_VERSIONS = (2, 3)  # the manifest versions this gptpar reads
CHECKPOINT, UNIVERSAL, WEIGHTS_ONLY, HUGGING_FACE = "checkpoint", "universal", "weights-only", "huggingface"
KINDS = (CHECKPOINT, UNIVERSAL, WEIGHTS_ONLY, HUGGING_FACE)
# The key gptpar adds to the files it writes in formats others define (a universal copy's per-parameter files, a
# weights-only checkpoint's model states, a Hugging Face export's config.json): its mark survives a deleted manifest.
MARK = "gptpar_written"


@dataclass(frozen=True)
class Manifest:
    """A folder's manifest: `files` {relative path: {"size"[, DIGEST][, "rank"]}}, `kind`, and the rest of it
    (`iteration`, `world_size`, ...) in `fields`."""

    folder: str
    kind: str
    files: Dict[str, dict]
    fields: dict = field(default_factory=dict)

    @property
    def path(self) -> str:
        return os.path.join(self.folder, MANIFEST)

    @property
    def has_digests(self) -> bool:
        return any(DIGEST in record for record in self.files.values())

    def record(self, path: str) -> Optional[dict]:
        """The record of file `path` (a path to a file inside the folder); None when it is not listed."""
        return self.files.get(os.path.relpath(path, self.folder))


def file_digest(path: str) -> str:
    """The hex DIGEST of a file's bytes, hashed through a read-only memory map: the pages it reads stay in the
    page cache for the load that follows, and no copy of the file is made in the process's own memory."""
    digest = hashlib.new(DIGEST)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                digest.update(mapped)  # hashlib releases the GIL over the whole buffer
    return digest.hexdigest()


def read_manifest(folder: str, fix: str) -> Manifest:
    """The manifest of `folder`; CheckpointError naming it (and `fix`) when it is missing, cut short or garbled."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            raw = json.load(f)
        files = {os.path.normpath(rel): {"size": int(rec)} if isinstance(rec, int) else dict(rec, size=int(rec["size"]))
                 for rel, rec in raw["files"].items()}
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {MANIFEST}: it is incomplete; {fix}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}): "
                              f"the folder is incomplete or damaged; {fix}") from None
    if raw.get("version") not in READ_VERSIONS:
        raise CheckpointError(f"{path} is of manifest version {raw.get('version')!r}; this gptpar reads versions "
                              f"{', '.join(map(str, READ_VERSIONS))}: read the folder with the gptpar that wrote it "
                              f"(or a newer one), or {fix}")
    if not files:
        raise CheckpointError(f"{path} lists no files, so nothing in {folder} can be read as part of it (a folder "
                              f"gptpar writes always lists its files): the manifest was damaged or replaced; {fix}")
    kind = raw.get("kind") or (WEIGHTS_ONLY if raw.get("weights_only") else CHECKPOINT)
    fields = {k: v for k, v in raw.items() if k not in ("files", "kind")}
    return Manifest(os.path.normpath(folder), kind, files, fields)


def gptpar_marks(folder: str) -> Optional[str]:
    """What shows that gptpar wrote `folder` although its manifest is gone (None: nothing does): its per-rank
    state files, a universal copy's metadata or owner file, or gptpar's mark inside a file it wrote in a format
    others define (a universal copy's fp32.pt, a weights-only model-states file, a Hugging Face config.json)."""
    if not os.path.isdir(folder):
        return None
    names = os.listdir(folder)
    own = sorted(n for n in names if STATE_FILE_RE.match(n) or n in (UNIVERSAL_META, OWNER))
    if own:
        return f"it holds gptpar's {own[0]}"
    config = os.path.join(folder, CONFIG)
    try:
        with open(config) as f:
            run = json.load(f)
        if isinstance(run, dict) and (MARK in run or {"model", "parallel"} <= set(run)):
            return f"its {CONFIG} is gptpar's"
    except (OSError, ValueError):
        pass
    candidates = sorted(glob.glob(os.path.join(folder, "zero", "*", "fp32.pt")))[:1] + \
        sorted(glob.glob(os.path.join(folder, "*model_states.pt")))[:1]
    for path in candidates:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - DeepSpeed's pickles, damaged files: not gptpar's mark either way
            continue
        if isinstance(state, dict) and state.get(MARK):
            return f"{os.path.relpath(path, folder)} carries gptpar's mark"
    return None


def listed_file_problems(manifest: Manifest) -> List[str]:
    """One line per file the manifest lists that is missing or has another size, and per torch file that is not a
    whole zip archive (a truncated file): stat calls and each zip's directory only, before anything is loaded."""
    problems = []
    for rel, record in sorted(manifest.files.items()):
        full = os.path.join(manifest.folder, rel)
        problem = file_problem(full) if rel.endswith(".pt") or not os.path.isfile(full) else None
        if problem:
            problems.append(f"{full} {problem}")
        elif os.path.getsize(full) != record["size"]:
            problems.append(f"{full} has {os.path.getsize(full)} bytes, the manifest says {record['size']} "
                            "(truncated or rewritten?)")
    return problems


def unlisted_files(manifest: Manifest) -> List[str]:
    """The files in the manifest's folder (and below) that it does not list, relative to the folder, sorted."""
    found = []
    for root, _, names in os.walk(manifest.folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), manifest.folder)
            if rel != MANIFEST and not rel.startswith(f".{MANIFEST}.tmp-") and rel not in manifest.files:
                found.append(rel)
    return sorted(found)


def unlisted(path: str, manifest: Manifest) -> str:
    """The refusal of a file a reader needs that `manifest` does not list."""
    return (f"{path} is not listed in the manifest {manifest.path} (a file added or renamed after the folder was "
            "written): gptpar reads only the files a manifest lists")


def damaged_message(folder: str, problems: List[str], fix: str) -> str:
    """One line: the folder, what is wrong with each file (the first five), and the fix."""
    problems = list(dict.fromkeys(problems))
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return f"{folder} is damaged: " + "; ".join(problems[:5]) + f"{more}; {fix}"


def mismatch(path: str, got: str, want: str) -> str:
    return (f"{path} does not match its {DIGEST} in the manifest ({got[:12]}..., recorded {want[:12]}...): its bytes "
            "changed after it was written (disk or copy corruption)")


class Verifier:
    """Loads the files of one folder, each checked against its manifest's sha256 before any of its bytes are parsed.

    `checks(path, record)` decides which files this reader verifies (default: every file with a digest): the ranks
    of a resume each verify the files they wrote (`verify_share`), agree, and only then load (`trust_all`). With
    `defer` a mismatch found by `check` is kept in `problems` instead of raised, so that ranks stay in step and agree
    on the outcome (`raise_problems`); a load never parses a file that failed, deferred or not. With a manifest,
    a file it does not list is never read."""

    def __init__(self, folder: str, manifest: Optional[Manifest], fix: str, enabled: bool = True,
                 checks: Optional[Callable[[str, dict], bool]] = None, defer: bool = False):
        self.folder, self.manifest, self.fix = os.path.normpath(folder), manifest, fix
        self.enabled, self.checks, self.defer = enabled and manifest is not None, checks, defer
        self.problems: List[str] = []
        self.verified: Dict[str, bool] = {}  # path -> whether it matched
        self.trusted = False  # every listed file is known to match (`trust_all`)

    def require_listed(self, path: str) -> None:
        """CheckpointError unless the manifest (if there is one) lists `path`: an unlisted file is never read."""
        if self.manifest is not None and self.manifest.record(os.path.normpath(path)) is None:
            raise CheckpointError(f"{unlisted(path, self.manifest)}; {self.fix}")

    def digest_to_check(self, path: str) -> Optional[str]:
        """The digest `path` must have, when this reader checks it (None: it does not)."""
        if not self.enabled or self.trusted:
            return None
        record = self.manifest.record(os.path.normpath(path))
        if record is None or (self.checks is not None and not self.checks(path, record)):
            return None
        if DIGEST not in record:
            return "" if self.manifest.has_digests else None  # one file without: the manifest was edited
        return record[DIGEST]

    def check(self, path: str) -> bool:
        """Hash `path` (whole, once per verifier) against the manifest, if this reader checks it; whether it may
        be read (False only for a mismatch kept with `defer`)."""
        want = self.digest_to_check(path)
        if want is None:
            return True
        if path not in self.verified:
            got = file_digest(path)
            self.verified[path] = got == want
            if got != want:
                self._problem(mismatch(path, got, want) if want else
                              f"{path} has no {DIGEST} in the manifest while the other files have one (the manifest "
                              "was edited)")
        return self.verified[path]

    def verify_share(self) -> None:
        """Hash every listed file this reader checks, before anything is loaded (a resume's ranks each hash the
        files they wrote; the outcome is agreed before any rank parses a byte)."""
        if self.enabled:
            for rel in sorted(self.manifest.files):
                self.check(os.path.join(self.folder, rel))

    def trust_all(self) -> None:
        """Every listed file has been verified (by this reader or, agreed, by the others): loads hash no more."""
        self.trusted = True

    def _checked(self, path: str) -> None:
        """Before `path` is parsed: it is listed and it matched (CheckpointError otherwise, deferred or not)."""
        self.require_listed(path)
        if not self.check(path):
            raise CheckpointError(damaged_message(self.folder, self.problems, self.fix))

    def torch_load(self, path: str, **kwargs):
        """torch.load(path, map_location="cpu", **kwargs) of a file verified first: hashed through a read-only
        map, then loaded memory-mapped (a zip file; its tensors stay file-backed, read from the page cache) or
        from the path (the legacy format). A file that still cannot be read is a CheckpointError naming it (an
        UnpicklingError of weights_only's refusal of an object is left to the caller to word)."""
        kwargs.setdefault("map_location", "cpu")
        self._checked(path)
        if zipfile.is_zipfile(path):
            kwargs["mmap"] = True
        else:
            kwargs.pop("mmap", None)
        try:
            return torch.load(path, **kwargs)
        except pickle.UnpicklingError as e:
            if kwargs.get("weights_only", True):
                raise
            raise self._unreadable(path, e) from None
        except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything (AttributeError, KeyError...)
            raise self._unreadable(path, e) from None

    def _unreadable(self, path: str, error: BaseException) -> CheckpointError:
        first = str(error).splitlines()[0] if str(error) else ""
        problem = file_problem(path) or f"cannot be read ({type(error).__name__}: {first})"
        return CheckpointError(f"{path} {problem}; {self.fix}")

    def read_text(self, path: str) -> str:
        """A text file's contents, verified before they are returned (JSON metadata, config.json)."""
        self._checked(path)
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def load_safetensors(self, path: str):
        """A safetensors file's tensors, verified first, then read through safetensors' own memory map."""
        import safetensors.torch

        self._checked(path)
        try:
            return safetensors.torch.load_file(path)
        except Exception as e:  # noqa: BLE001 - a damaged header raises SafetensorError and others
            raise self._unreadable(path, e) from None

    def _problem(self, line: str) -> None:
        self.problems.append(line)
        if not self.defer:
            self.raise_problems()

    def raise_problems(self, problems: Optional[List[str]] = None) -> None:
        """CheckpointError naming every damaged file (`problems`: every rank's, gathered; default this reader's)."""
        problems = self.problems if problems is None else problems
        if problems:
            raise CheckpointError(damaged_message(self.folder, problems, self.fix))


def open_folder(folder: str, fix: str, log: Callable[[str], None], verify: bool = True, verify_by: str = "",
                checks: Optional[Callable[[str, dict], bool]] = None, defer: bool = False,
                quiet: bool = False) -> Verifier:
    """Start reading `folder`: its manifest read and every listed file there whole (CheckpointError naming each
    problem, then `fix`), or, without a manifest, CheckpointError when gptpar wrote it (`gptpar_marks`) and one line
    that it carries no checksums when it did not. `verify` False (the user asked by name: `verify_by` says how)
    skips the sha256 checks and says so. `quiet`: no lines (a second reader of the same folder)."""
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        manifest = read_manifest(folder, fix)
        problems = listed_file_problems(manifest)
        if problems:
            raise CheckpointError(damaged_message(folder, problems, fix))
        if not quiet and not manifest.has_digests:
            log(f"{folder} records no checksums (saved with checkpoint.checksums=false): its files' sizes are checked, "
                "not their bytes")
        extra = unlisted_files(manifest)
        if not quiet and extra:
            log(f"{folder} holds {len(extra)} file(s) its manifest does not list (gptpar reads only listed files): "
                + ", ".join(extra[:5]) + (f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""))
        elif not quiet and not verify:
            log(f"not verifying the checksums of {folder} ({verify_by or 'asked not to'})")
        return Verifier(folder, manifest, fix, enabled=verify, checks=checks, defer=defer)
    marks = gptpar_marks(folder)
    if marks is not None:
        raise CheckpointError(f"{folder} was written by gptpar ({marks}) but has no {MANIFEST}: it is incomplete (its "
                              f"write was interrupted, or the manifest was deleted), so its files cannot be checked; "
                              f"{fix}")
    if not quiet:
        log(f"{folder} carries no checksums (not written by gptpar): its files are read unverified")
    return Verifier(folder, None, fix, enabled=False)


__all__ = ["DIGEST", "VERSION", "KINDS", "CHECKPOINT", "UNIVERSAL", "WEIGHTS_ONLY", "HUGGING_FACE", "MARK", "Manifest",
           "READ_VERSIONS", "file_digest", "read_manifest", "gptpar_marks", "listed_file_problems", "unlisted_files",
           "unlisted", "damaged_message", "mismatch",
           "Verifier", "open_folder"]
