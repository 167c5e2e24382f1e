"""KILN_FAULTS: injected out-of-memory errors by phase and rung, for ladder drills and tests.

Grammar: comma-separated `oom@PHASE:RUNG[*COUNT]`, e.g. `oom@load:full,oom@denoise:full*2`.
RUNG may be `*` for any rung. Each entry fires COUNT times (default 1) over the process's life.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from api_client.schema import RUNGS

FAULT_PHASES = ("load", "text_encode", "denoise", "decode")
_ENTRY = re.compile(r"^oom@(?P<phase>[a-z_]+):(?P<rung>[a-z_*]+)(?:\*(?P<count>\d+))?$")


class InvalidFaults(ValueError):
    pass


@dataclass
class _Fault:
    phase: str
    rung: str
    remaining: int


class FaultPlan:
    def __init__(self, faults: list[_Fault] | None = None) -> None:
        self._faults = faults or []

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        faults: list[_Fault] = []
        for raw in filter(None, (part.strip() for part in spec.split(","))):
            match = _ENTRY.match(raw)
            if match is None:
                raise InvalidFaults(f"KILN_FAULTS entry {raw!r}: expected oom@PHASE:RUNG[*COUNT]")
            phase, rung = match["phase"], match["rung"]
            if phase not in FAULT_PHASES:
                raise InvalidFaults(
                    f"KILN_FAULTS entry {raw!r}: phase must be one of {', '.join(FAULT_PHASES)}"
                )
            if rung != "*" and rung not in RUNGS:
                raise InvalidFaults(
                    f"KILN_FAULTS entry {raw!r}: rung must be * or one of {', '.join(RUNGS)}"
                )
            faults.append(_Fault(phase, rung, int(match["count"] or 1)))
        return cls(faults)

    def check(self, phase: str, rung: str) -> None:
        """Raise torch.OutOfMemoryError if a drill is armed for this phase at this rung."""
        for fault in self._faults:
            if fault.remaining > 0 and fault.phase == phase and fault.rung in (rung, "*"):
                fault.remaining -= 1
                raise torch.OutOfMemoryError(
                    f"KILN_FAULTS drill: injected out of memory in {phase} at rung {rung}"
                )

    def __bool__(self) -> bool:
        return any(f.remaining > 0 for f in self._faults)
