"""What a render needs from whoever runs it (the RQ worker, `kiln bench`, a test): the job's id
and queue wait, admission, progress reporting, stop requests, and who publishes its record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from worker.render.timings import TimingRecord


class JobContext(Protocol):
    job_id: str
    queue_wait_s: float

    def admit(self) -> None:
        """Raise RefusedJob or JobStopped if this job must not run at all."""

    def progress(self, phase: str, step: int, steps: int, preview: str | None = None) -> None: ...

    def stop_requested(self) -> bool:
        """True when a cancel asks the job to stop; raises when the job must end otherwise
        (ShutdownStop, LeaseLost)."""

    def confirm(self) -> None:
        """Before the job's files are written: raise LeaseLost if this run no longer holds it."""

    def hold_done_record(self, record: TimingRecord) -> bool:
        """True when the runner publishes a done job's record itself, once the job's end is
        committed where every worker sees it (the queue: no crash can leave two records)."""


@dataclass
class LocalContext:
    """A context with no queue behind it: always admitted, no progress reporting, never stopped."""

    job_id: str
    queue_wait_s: float = 0.0

    def admit(self) -> None:
        return None

    def progress(self, phase: str, step: int, steps: int, preview: str | None = None) -> None:
        return None

    def stop_requested(self) -> bool:
        return False

    def confirm(self) -> None:
        return None

    def hold_done_record(self, record: TimingRecord) -> bool:
        return False
