"""Where a job a test watches is, from its progress."""

from __future__ import annotations

from api_client import KilnJob


def denoising(job: KilnJob, at_least: int = 1) -> bool:
    """The job's progress says it is denoising, at step at_least or later."""
    progress = job.progress()
    return progress is not None and progress.phase == "denoise" and progress.step >= at_least
