"""A running job's events (started, progress, preview, then done/failed/stopped), written to its
Redis streams in batches: progress is coalesced and flushed at most every PROGRESS_INTERVAL_S,
and the end is written in the pipeline the worker already runs after each job. Every write to a
model's queue stream trims it to this worker's KILN_EVENTS_RETENTION_S (set_retention)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from api_client import events, keys
from api_client.schema import JobEvent, PreviewRef, RenderResult

log = logging.getLogger(__name__)
PROGRESS_INTERVAL_S = 1.0  # a progress bar moves once a second, whatever the step rate (the budget)


class EventJournal:
    """One job's events: buffered, then written in one pipeline per flush."""

    def __init__(
        self,
        conn: Redis,
        job_id: str,
        model: str | None,
        webhook: str | None = None,
        interval_s: float = PROGRESS_INTERVAL_S,
        retention_s: float = events.EVENTS_RETENTION_S,
    ) -> None:
        self.conn = conn
        self.job_id = job_id
        self.model = model
        self.webhook = webhook
        self.interval_s = interval_s
        self.retention_s = retention_s  # of the model's queue stream
        self.result: RenderResult | None = None
        # "started" waits for the first flush like progress does: a short job writes it with
        # its end, in the round trip the worker makes anyway, and its client wakes once.
        self._pending: list[JobEvent] = [self._event("started")]
        self._progress: JobEvent | None = None
        self._flushed_at = time.monotonic()

    def _event(self, kind: Any, **fields: Any) -> JobEvent:
        return JobEvent(kind=kind, job_id=self.job_id, model=self.model, at=events.now(), **fields)

    def progress(self, phase: str, step: int, steps: int) -> None:
        self._progress = self._event("progress", phase=phase, step=step, steps=steps)
        if time.monotonic() - self._flushed_at >= self.interval_s:
            self.flush()

    def preview(self, ref: PreviewRef) -> None:
        self._pending.append(self._event("preview", preview=ref))
        if time.monotonic() - self._flushed_at >= self.interval_s:
            self.flush()

    def _drain(self) -> list[JobEvent]:
        batch = [*self._pending, *([self._progress] if self._progress else [])]
        self._pending, self._progress = [], None
        return batch

    def flush(self) -> None:
        """Write what is buffered in one round trip; a Redis error loses events, not the job."""
        batch = self._drain()
        self._flushed_at = time.monotonic()
        if not batch:
            return
        try:
            with self.conn.pipeline(transaction=False) as pipe:
                # The stream gets its TTL with the job's end (finish()): none while it runs.
                events.add_events(pipe, batch, expire=False, retention_s=self.retention_s)
                pipe.execute()
        except RedisError as exc:
            log.warning("job %s: %d events not written: %s", self.job_id, len(batch), exc)

    def finish(self, pipe: Any, kind: str, error: str | None = None) -> JobEvent:
        """Queue what is buffered and the end event on the caller's pipeline; the end event.
        Progress not yet written is dropped when the job is done (its end says more), and kept
        when it failed or stopped (where it got to)."""
        if kind == "done":
            self._progress = None
        end = self._event(
            kind,
            result=self.result if kind == "done" else None,
            error=error if kind != "done" else None,
            detail="re-queued after a worker shutdown" if kind == "queued" else None,
        )
        # The stream keeps the lifetime its submit gave it (worker/queue/execution.py start).
        events.add_events(pipe, [*self._drain(), end], expire=False, retention_s=self.retention_s)
        return end


_journals: dict[str, EventJournal] = {}
_lock = threading.Lock()
# Settings.events_retention_s of this worker process, set once at its start (set_retention).
_retention_s: float = events.EVENTS_RETENTION_S


def set_retention(seconds: float) -> None:
    """How long the queue streams this process writes to keep their events (trimmed by age)."""
    global _retention_s
    _retention_s = seconds


def add_ended(pipe: Any, ended: list[JobEvent]) -> None:
    """Queue the events of jobs that end outside a journal (abandoned, quarantined) on the
    caller's pipeline, with their streams' TTL, the queue streams trimmed as a journal trims."""
    events.add_events(pipe, ended, retention_s=_retention_s)


def open_journal(conn: Redis, job_id: str, origin: str | None, request: Any) -> EventJournal:
    """The journal of a job that starts running in this process."""
    model = keys.model_of(origin) if origin else None
    webhook = request.get("webhook") if isinstance(request, dict) else None
    target = webhook if isinstance(webhook, str) else None
    journal = EventJournal(conn, job_id, model, target, retention_s=_retention_s)
    with _lock:
        _journals[job_id] = journal
    return journal


# RQ's status after a job -> the event that ends it here (queued: put back by a shutdown).
_END_KIND = {"finished": "done", "failed": "failed", "stopped": "stopped", "queued": "queued"}


def close_journal(
    conn: Redis, pipe: Any, job_id: str, origin: str | None, status: str, error: str | None
) -> tuple[JobEvent, str | None] | None:
    """Queue the job's last events on pipe; the end event and the webhook target it goes to.

    A job refused before it ran has no journal yet: it gets one here, so it still ends with a
    failed event. A status with no end (a job still started) queues nothing.
    """
    with _lock:
        journal = _journals.pop(job_id, None)
    kind = _END_KIND.get(status)
    if kind is None:
        return None
    if journal is None:
        journal = open_journal(conn, job_id, origin, None)
        with _lock:
            _journals.pop(job_id, None)
    end = journal.finish(pipe, kind, error)
    return end, journal.webhook if kind != "queued" else None
