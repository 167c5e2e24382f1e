"""KILN_FAULTS: injected failures by phase and rung, for ladder drills and tests.

Grammar: comma-separated `KIND@PHASE:RUNG[*COUNT]`, e.g. `oom@load:full,oom@denoise:full*2`.
KIND is `oom` (torch.OutOfMemoryError: the ladder frees memory, retries, descends) or `lost`
(a CUDA "illegal memory access": the device is gone, the worker fails the job and exits).
RUNG may be `*` for any rung. Each entry fires COUNT times (default 1) over the process's life.
`crash@POINT[*COUNT]` entries are crash points (worker/crashes.py): checked here, armed there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from worker.crashes import crash_entry
from worker.errors import InvalidFaults
from worker.memory import rungs

FAULT_PHASES = ("load", "text_encode", "denoise", "decode", "upscale")
_ENTRY = re.compile(
    r"^(?P<kind>oom|lost)@(?P<phase>[a-z_]+):(?P<rung>[a-z_*]+)(?:\*(?P<count>\d+))?$"
)


@dataclass
class _Fault:
    kind: str
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
            if raw.startswith("crash@"):
                crash_entry(raw)  # checked here, armed by the serving process (arm_crashes)
                continue
            match = _ENTRY.match(raw)
            if match is None:
                raise InvalidFaults(
                    f"KILN_FAULTS entry {raw!r}: expected oom|lost@PHASE:RUNG[*COUNT]"
                    " or crash@POINT[*COUNT]"
                )
            phase, rung = match["phase"], match["rung"]
            if phase not in FAULT_PHASES:
                raise InvalidFaults(
                    f"KILN_FAULTS entry {raw!r}: phase must be one of {', '.join(FAULT_PHASES)}"
                )
            if rung != "*" and rung not in rungs.names():
                raise InvalidFaults(
                    f"KILN_FAULTS entry {raw!r}: rung must be * or one of"
                    f" {', '.join(rungs.names())}"
                )
            faults.append(_Fault(match["kind"], phase, rung, int(match["count"] or 1)))
        return cls(faults)

    def check(self, phase: str, rung: str) -> None:
        """Raise the drilled failure if one is armed for this phase at this rung."""
        for fault in self._faults:
            if fault.remaining > 0 and fault.phase == phase and fault.rung in (rung, "*"):
                fault.remaining -= 1
                if fault.kind == "lost":
                    raise RuntimeError(
                        "CUDA error: an illegal memory access was encountered"
                        f" (KILN_FAULTS drill: device lost in {phase} at rung {rung})"
                    )
                import torch  # here, so `kiln worker` reaches Redis before torch is imported

                raise torch.OutOfMemoryError(
                    f"KILN_FAULTS drill: injected out of memory in {phase} at rung {rung}"
                )

    def __bool__(self) -> bool:
        return any(f.remaining > 0 for f in self._faults)
