"""Name the rank a hung or failed job waited for, from the files its ranks wrote (gptpar.training.diagnostics):

    python tools/diagnose_hang.py CHECKPOINT_SAVE/diagnostics

Each rank that could wrote `rank_R.json` when a collective timed out or lost its peer (or on SIGUSR2): its recent
collectives, each with its process group and its sequence number in that group. The collective a rank waits in is
its last one that did not return. A suspect is a rank of that group that never entered it (its own file shows an
earlier sequence number in the group) or a rank that wrote nothing (stopped, hung in compute, or gone). One line
per suspect, starting `suspect: rank R`, with its host, (pp, dp, tp) coordinates and last collective; the line
names no other rank. Then one line on what the others wait in. Only the newest run's files are read (each file
carries its run's id). Exit 0; 2 when the folder holds no rank's file, or one that is not a rank's diagnostics
(cut short, not JSON, or without the fields the report reads): one line naming the file and what is wrong.
"""
import argparse
import json
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

from gptpar.topology import coords_of

RANK_FILE = re.compile(r"^rank_(\d+)\.json$")
NCCL_DUMP = re.compile(r"^nccl_trace_rank_(\d+)$")


class DiagnosticsFileError(ValueError):
    """A rank_R.json that is not a rank's diagnostics; the message names the file."""


# What the report reads of a rank's file (gptpar.training.diagnostics.Diagnostics.record) and of each collective in it
# (gptpar.training.collectives), with the JSON types each must have.
RECORD_FIELDS = {"world_size": int, "sizes": dict, "time": (int, float), "collectives": (list, type(None))}
COLLECTIVE_FIELDS = {"op": str, "group": str, "group_ranks": list, "group_seq": int, "caller": str, "state": str}


def read_record(path: str) -> dict:
    """One rank's file, checked for what the report reads; DiagnosticsFileError otherwise."""
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError:
        raise DiagnosticsFileError(f"{path} is not a diagnostics file: not text (a binary file?)") from None
    except json.JSONDecodeError as e:
        raise DiagnosticsFileError(f"{path} is not a whole diagnostics file: not valid JSON ({e}; cut short?)") \
            from None
    except OSError as e:
        raise DiagnosticsFileError(f"{path} cannot be read ({e.strerror or e})") from None
    if not isinstance(record, dict):
        raise DiagnosticsFileError(f"{path} is not a diagnostics file: a JSON {type(record).__name__}, not an "
                                   "object")
    problems = _wrong_fields(record, RECORD_FIELDS, "")
    sizes = record.get("sizes")
    if isinstance(sizes, dict):
        problems += _wrong_fields(sizes, {"pp": int, "dp": int, "tp": int}, "sizes.")
    for i, entry in enumerate(record.get("collectives") or [] if not problems else []):
        problems += ([f"collectives[{i}] is not an object"] if not isinstance(entry, dict)
                     else _wrong_fields(entry, COLLECTIVE_FIELDS, f"collectives[{i}]."))
    if problems:
        raise DiagnosticsFileError(f"{path} is not a diagnostics file gptpar wrote: {'; '.join(problems[:3])}"
                                   + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))
    return record


def _wrong_fields(obj: dict, types: dict, prefix: str) -> List[str]:
    problems = []
    for key, kind in types.items():
        if key not in obj:
            problems.append(f"no {prefix}{key}")
        elif not isinstance(obj[key], kind) or isinstance(obj[key], bool):
            problems.append(f"{prefix}{key} is {obj[key]!r}")
    return problems


def read_records(directory: str) -> Tuple[Dict[int, dict], List[int]]:
    """({rank: its record}, ranks with only NCCL's own dump) of a diagnostics folder; DiagnosticsFileError names a
    rank's file that is not its diagnostics."""
    records, nccl = {}, []
    for name in sorted(os.listdir(directory)):
        m = RANK_FILE.match(name)
        if m:
            records[int(m.group(1))] = read_record(os.path.join(directory, name))
        elif NCCL_DUMP.match(name):
            nccl.append(int(NCCL_DUMP.match(name).group(1)))
    runs = {}
    for rank, record in records.items():  # files of an earlier run (an earlier failure, a restart) are left out
        runs.setdefault(record.get("run_id"), {})[rank] = record
    newest = max(runs.values(), key=lambda run: max(r["time"] for r in run.values())) if runs else {}
    return newest, [r for r in nccl if r not in newest]


def waiting_in(record: dict) -> Optional[dict]:
    """The collective this rank waits in: its last one that did not return (entered, or failed)."""
    for entry in reversed(record.get("collectives") or []):
        if entry["state"] != "returned":
            return entry
    return None


def reached(record: dict, group: str) -> int:
    """The highest sequence number this rank entered in `group` (0: none in its ring)."""
    return max((e["group_seq"] for e in record.get("collectives") or [] if e["group"] == group), default=0)


def last_collective(record: Optional[dict]) -> str:
    if not record or not record.get("collectives"):
        return "its last collective unknown (it wrote nothing)"
    e = record["collectives"][-1]
    return f"its last collective {describe(e)}, {e['state']}"


def describe(entry: dict) -> str:
    return (f"{entry['op']} #{entry['group_seq']} of the group of ranks {entry['group_ranks']} "
            f"(called at {entry['caller']})")


def where(rank: int, sample: dict) -> str:
    sizes, hosts = sample["sizes"], sample.get("hosts") or []
    pp, dp, tp = coords_of(rank, sizes["tp"], sizes["pp"], sizes["dp"])
    host = hosts[rank] if rank < len(hosts) else "host unknown"
    return f"{host}, pp {pp}/dp {dp}/tp {tp}"


def diagnose(records: Dict[int, dict], nccl_only: List[int]) -> List[str]:
    """The report's lines (see the module docstring)."""
    sample = next(iter(records.values()))
    world = sample["world_size"]
    waits = {rank: waiting_in(r) for rank, r in records.items()}
    waited = [w for w in waits.values() if w is not None]
    lines, suspects = [], {}
    for rank in range(world):
        if rank not in records and rank not in nccl_only:
            suspects[rank] = "wrote nothing (stopped, hung outside a collective, or gone before it could)"
    for w in {(w["group"], w["group_seq"]): w for w in waited}.values():
        for rank in w["group_ranks"]:
            if rank in records and rank not in suspects and reached(records[rank], w["group"]) < w["group_seq"]:
                suspects[rank] = f"never entered the collective the others wait in ({describe(w)})"
    for rank, why in sorted(suspects.items()):
        lines.append(f"suspect: rank {rank} ({where(rank, sample)}): {why}; {last_collective(records.get(rank))}")
    if waited:
        common = max({(w["group"], w["group_seq"]) for w in waited},
                     key=lambda key: sum((w["group"], w["group_seq"]) == key for w in waited))
        w = next(w for w in waited if (w["group"], w["group_seq"]) == common)
        count = sum((x["group"], x["group_seq"]) == common for x in waited)
        lines.append(f"{count} of {world} ranks' files show them waiting in {describe(w)}")
    if not suspects:
        lines.append("no suspect: every rank wrote its file and entered the collective the others wait in")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="the diagnostics folder (<checkpoint.save>/diagnostics or "
                                          "logging.diagnostics_dir)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        print(f"diagnose_hang.py: error: {args.directory} is not a folder: pass <checkpoint.save>/diagnostics or "
              "logging.diagnostics_dir", file=sys.stderr)
        return 2
    try:
        records, nccl_only = read_records(args.directory)
    except DiagnosticsFileError as e:
        print(f"diagnose_hang.py: error: {e}; the report reads every rank_R.json in the folder: move this one "
              "aside to read the others", file=sys.stderr)
        return 2
    if not records:
        print(f"diagnose_hang.py: error: {args.directory} holds no rank_R.json: no rank wrote diagnostics there "
              "(send SIGUSR2 to the ranks of a hung job to have them written)", file=sys.stderr)
        return 2
    print("\n".join(diagnose(records, nccl_only)))
    return 0
