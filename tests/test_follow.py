"""`kiln submit --wait` (worker/cli/plain.py follow_job) follows the job's event stream as the
worker writes it: progress from the events, the result from the done event, a failure's message from
the job's record; it never polls job.progress()."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from redis import Redis

from api_client import KilnJob, RenderFailed
from api_client.errors import JobTimeout
from api_client.events import BLOCK_SLICE_S
from tests.fixtures.gate import hold_here
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import enqueue_raw
from worker.cli.plain import follow_job

REQUEST = {"model": "tiny-sd15", "prompt": "a heron", "steps": 8, "seed": 2}


def _no_polling(monkeypatch: Any) -> list[str]:
    """progress() refused; every status read (result()) counted."""
    reads: list[str] = []
    real = KilnJob.result

    def counted(self: KilnJob) -> Any:
        reads.append(self.id)
        return real(self)

    def refused(self: KilnJob) -> None:
        raise AssertionError("--wait polled job.progress()")

    monkeypatch.setattr(KilnJob, "progress", refused)
    monkeypatch.setattr(KilnJob, "result", counted)
    return reads


def test_wait_shows_progress_from_the_events_and_returns_the_done_events_result(
    redis_conn: Redis, settings: Any, monkeypatch: Any
) -> None:
    reads = _no_polling(monkeypatch)
    job = client_for(redis_conn, settings).submit(REQUEST)
    shown: list[tuple[str, int, int | None]] = []
    outcome: dict[str, Any] = {}

    def follow() -> None:
        started = time.monotonic()
        try:
            outcome["result"] = follow_job(job, 60, lambda *update: shown.append(update))
        except BaseException as exc:
            outcome["error"] = exc
        outcome["took"] = time.monotonic() - started

    follower = threading.Thread(target=follow)
    follower.start()
    # The job waits at denoise steps 2 and 5 until the follower has shown each.
    hold_here(monkeypatch, lambda step: ("denoise", step, 8) in shown, at=(2, 5))
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    follower.join(timeout=30)
    assert not follower.is_alive() and "error" not in outcome, outcome
    assert outcome["result"] == job.wait(timeout=1)
    denoise = [step for phase, step, steps in shown if phase == "denoise" and steps == 8]
    # Steps as the stream has them, in order (PNDM's warm-up makes its last step 9 of 8).
    assert len(set(denoise)) >= 2 and denoise == sorted(denoise), shown
    # The result came with the done event: the status was read only after block slices that
    # passed without an event (while the worker loaded), never on a poll between events.
    assert len(reads) <= outcome["took"] / BLOCK_SLICE_S + 1, (reads, outcome["took"])


def test_wait_raises_the_workers_message_for_a_failed_job(
    redis_conn: Redis, settings: Any, monkeypatch: Any
) -> None:
    _no_polling(monkeypatch)
    job_id = enqueue_raw(redis_conn, "tiny-sd15", {"request": {**REQUEST, "steps": 999}})
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    started = time.monotonic()
    with pytest.raises(RenderFailed, match=r"steps") as failed:
        follow_job(KilnJob(job_id, redis_conn), 30, lambda *update: None)
    assert failed.value.status == "failed"
    assert time.monotonic() - started < 5  # the failed event ends the wait, not a poll


def test_wait_gives_up_after_its_timeout_naming_the_status(
    redis_conn: Redis, settings: Any
) -> None:
    job = client_for(redis_conn, settings).submit(REQUEST)  # no worker takes it
    started = time.monotonic()
    with pytest.raises(JobTimeout, match=rf"job {job.id} still queued after 1 s"):
        follow_job(job, 1.0, lambda *update: None)
    assert 1.0 <= time.monotonic() - started < 4
