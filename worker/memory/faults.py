"""KILN_FAULTS: injected failures by phase and rung, for ladder drills and tests, and crash
points, for drills of a job's exactly-once end.

Grammar: comma-separated `KIND@PHASE:RUNG[*COUNT]`, e.g. `oom@load:full,oom@denoise:full*2`.
KIND is `oom` (torch.OutOfMemoryError: the ladder frees memory, retries, descends) or `lost`
(a CUDA "illegal memory access": the device is gone, the worker fails the job and exits).
RUNG may be `*` for any rung. Each entry fires COUNT times (default 1) over the process's life.

`crash@POINT[*COUNT]` ends the worker process at once at POINT (os._exit(CRASH_STATUS): no
clean-up, no finally, no atexit, as a SIGKILL or a power cut would), at the COUNT-th time it is
reached (default the first). POINTS, in a job's order: claim (the job taken off its queue),
start (its start written), load, denoise, decode, save (its images written, its result not),
finish (its end committed in Redis, its record not yet published), webhook (a delivery taken
by a sender, not yet sent). The serving process arms them once (arm_crashes); any code on a
job's path calls crash_point(POINT), which costs a dict lookup when none is armed.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from worker.errors import InvalidFaults
from worker.memory import rungs

FAULT_PHASES = ("load", "text_encode", "denoise", "decode", "upscale")
CRASH_POINTS = ("claim", "start", "load", "denoise", "decode", "save", "finish", "webhook")
CRASH_STATUS = 70  # the exit status of a drilled crash (EX_SOFTWARE)
_ENTRY = re.compile(
    r"^(?P<kind>oom|lost)@(?P<phase>[a-z_]+):(?P<rung>[a-z_*]+)(?:\*(?P<count>\d+))?$"
)
_CRASH = re.compile(r"^crash@(?P<point>[a-z_]+)(?:\*(?P<count>\d+))?$")
# Crash points armed in this process: point -> how many more times it is passed before the crash.
_armed: dict[str, int] = {}


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


def crash_entry(raw: str) -> tuple[str, int]:
    """(point, count) of a `crash@POINT[*COUNT]` entry; InvalidFaults naming what is wrong."""
    match = _CRASH.match(raw)
    if match is None:
        raise InvalidFaults(f"KILN_FAULTS entry {raw!r}: expected crash@POINT[*COUNT]")
    point, count = match["point"], int(match["count"] or 1)
    if point not in CRASH_POINTS:
        raise InvalidFaults(
            f"KILN_FAULTS entry {raw!r}: crash point must be one of {', '.join(CRASH_POINTS)}"
        )
    if count < 1:
        raise InvalidFaults(f"KILN_FAULTS entry {raw!r}: COUNT must be at least 1")
    return point, count


def arm_crashes(spec: str) -> list[str]:
    """Arm this process's crash points from a KILN_FAULTS spec (its other entries are the
    FaultPlan's); the points armed."""
    _armed.clear()
    for raw in filter(None, (part.strip() for part in spec.split(","))):
        if raw.startswith("crash@"):
            point, count = crash_entry(raw)
            _armed[point] = count
    return sorted(_armed)


def crash_point(point: str) -> None:
    """End the process here, at once, when this point is armed and its count is reached."""
    if not _armed:
        return
    left = _armed.get(point)
    if left is None:
        return
    if left > 1:
        _armed[point] = left - 1
        return
    # One line to stderr (a log handler may buffer), then out: nothing else runs.
    sys.stderr.write(f"KILN_FAULTS drill: crash@{point} (pid {os.getpid()})\n")
    sys.stderr.flush()
    os._exit(CRASH_STATUS)
