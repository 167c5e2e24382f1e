"""KILN_FAULTS crash points: drills of a job's exactly-once end, on the ground so that every stage
on a job's path (queue, render, files) can call one.

`crash@POINT[*COUNT]` ends the worker process at once at POINT (os._exit(CRASH_STATUS): no
clean-up, no finally, no atexit, as a SIGKILL or a power cut would), at the COUNT-th time it is
reached (default the first). POINTS, in a job's order: claim (the job taken off its queue),
start (its start written), load, denoise, decode, save (its images written, its result not),
finish (its end committed in Redis, its record not yet published), webhook (a delivery taken
by a sender, not yet sent). The serving process arms them once (arm_crashes); any code on a
job's path calls crash_point(POINT), which costs a dict lookup when none is armed. KILN_FAULTS's
other entries (out of memory, a lost device, by phase and rung) are the ladder's drills
(worker/memory/faults.py).
"""

from __future__ import annotations

import os
import re
import sys

from worker.errors import InvalidFaults

CRASH_POINTS = ("claim", "start", "load", "denoise", "decode", "save", "finish", "webhook")
CRASH_STATUS = 70  # the exit status of a drilled crash (EX_SOFTWARE)
_CRASH = re.compile(r"^crash@(?P<point>[a-z_]+)(?:\*(?P<count>\d+))?$")
# Crash points armed in this process: point -> how many more times it is passed before the crash.
_armed: dict[str, int] = {}


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
    ladder's, worker/memory/faults.py); the points armed."""
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
