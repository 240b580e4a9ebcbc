"""GPU kinds and what-if assumptions: the facts the time model (gptpar.estimate.planner) is given.

A GPU kind (`--gpu a100-80gb|h100-80gb|h200`) is one file in gptpar/estimate/calibrations/kinds/: peak dense
bf16/fp16 and fp8 TFLOPs, memory, HBM bandwidth, the all-reduce bus bandwidth inside a node, the network per GPU
between nodes (a DGX's one NIC per GPU), and the achieved GEMM rate with its micro-batch curve and shape
penalties; every number says its source beside it. An assumption (`--assume`) is a feature a run may use that
gptpar does not run (yet): a plan for a gptpar config uses none unless asked, and names each one it used.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, List, Tuple

KINDS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibrations", "kinds")
DEFAULT_KIND = "a100-80gb"

# What each --assume means (docs/planning.md, "What-ifs (`--assume`)").
ASSUMPTIONS = {
    "interleaved=V": "interleaved 1F1B pipeline schedule with V virtual stages per GPU (Megatron-LM)",
    "tp-comm-overlap": "tensor-parallel communication overlapped with the GEMMs (Megatron-LM --tp-comm-overlap)",
    "dp-comm-overlap": "gradient reduction overlapped with the last micro batch's backward (--overlap-grad-reduce; "
                       "with distributed-optimizer also the parameter all-gather with the first forward)",
    "distributed-optimizer": "gradients reduce-scattered instead of all-reduced (Megatron-LM's distributed optimizer)",
    "ddp": "plain data parallelism: one gradient all-reduce and no ZeRO-1 parameter all-gather (Megatron-LM's DDP)",
}


def kind_names() -> List[str]:
    """The GPU kinds gptpar ships, by name."""
    return sorted(f[:-len(".json")] for f in os.listdir(KINDS_DIR) if f.endswith(".json"))


def load_kind(name: str) -> dict:
    """A shipped GPU kind's facts (with their sources); ValueError naming the kinds for an unknown one."""
    if name not in kind_names():
        raise ValueError(f"--gpu {name!r}: unknown GPU kind (known: {', '.join(kind_names())})")
    with open(os.path.join(KINDS_DIR, name + ".json")) as f:
        return json.load(f)


@dataclass(frozen=True)
class Assumptions:
    """What-ifs the time model applies (all off: what gptpar runs today)."""

    interleaved: int = 1
    tp_comm_overlap: bool = False
    dp_comm_overlap: bool = False
    distributed_optimizer: bool = False
    ddp: bool = False

    def names(self) -> List[str]:
        """The --assume strings that give these assumptions (empty for gptpar's own behaviour)."""
        out = [f"interleaved={self.interleaved}"] if self.interleaved > 1 else []
        out += [flag for flag, on in (("tp-comm-overlap", self.tp_comm_overlap),
                                      ("dp-comm-overlap", self.dp_comm_overlap),
                                      ("distributed-optimizer", self.distributed_optimizer),
                                      ("ddp", self.ddp)) if on]
        return out


def parse_assumptions(values: Iterable[str]) -> Assumptions:
    """--assume strings -> Assumptions; ValueError naming an unknown one and the known ones."""
    kw: dict = {}
    for raw in values:
        name, eq, value = raw.strip().partition("=")
        if name == "interleaved":
            if not eq or not value.isdigit() or int(value) < 1:
                raise ValueError(f"--assume {raw!r}: interleaved needs a number of virtual stages, e.g. "
                                 "--assume interleaved=2")
            kw["interleaved"] = int(value)
        elif not eq and name in ("tp-comm-overlap", "dp-comm-overlap", "distributed-optimizer", "ddp"):
            kw[name.replace("-", "_")] = True
        else:
            raise ValueError(f"--assume {raw!r}: unknown assumption (known: {', '.join(ASSUMPTIONS)})")
    if kw.get("ddp") and kw.get("distributed_optimizer"):
        raise ValueError("--assume ddp and distributed-optimizer exclude each other: pick one")
    return Assumptions(**kw)


def describe(assume: Assumptions) -> List[Tuple[str, str]]:
    """(flag, meaning) of each assumption in use."""
    key = {f"interleaved={assume.interleaved}": "interleaved=V"}
    return [(n, ASSUMPTIONS[key.get(n, n)].replace("V virtual", f"{assume.interleaved} virtual")) for n in
            assume.names()]


__all__ = ["KINDS_DIR", "DEFAULT_KIND", "ASSUMPTIONS", "Assumptions", "kind_names", "load_kind",
           "parse_assumptions", "describe"]
