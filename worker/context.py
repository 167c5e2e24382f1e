"""What a render needs from whoever runs it (the RQ worker, `kiln bench`, a test): the job's id
and queue wait, admission, progress reporting and stop requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class JobContext(Protocol):
    job_id: str
    queue_wait_s: float

    def admit(self) -> None:
        """Raise RefusedJob or JobStopped if this job must not run at all."""

    def progress(self, phase: str, step: int, steps: int, preview: str | None = None) -> None: ...

    def stop_requested(self) -> bool: ...


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
