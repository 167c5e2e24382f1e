"""KilnJob: a handle on one submitted job (status, progress, events, wait, download, eta,
cancel), reading Redis on every call and importing no torch. rq is imported where a call reads
a job through it, so `import api_client` does not load it (tests/test_client_import.py)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api_client import events, keys
from api_client.cancel import CANCELABLE, cancel_queued
from api_client.errors import JobTimeout, KilnError, RenderFailed, UnknownJob
from api_client.eta import job_eta, read_jobs
from api_client.fetch import fetch_image
from api_client.schema import (
    ImageFile,
    JobError,
    JobEvent,
    JobSnapshot,
    Progress,
    RenderRequest,
    RenderResult,
    VideoFile,
)
from api_client.webhooks import job_webhook_target, queue_webhook

if TYPE_CHECKING:
    from redis import Redis
    from rq.job import Job

STOP_TTL_S = 24 * 3600
ENDED_BADLY = ("failed", "stopped", "canceled")
ENDED = ("finished", *ENDED_BADLY, "quarantined")


class KilnJob:
    """A handle on one submitted job; cheap to make, reads Redis on every call."""

    def __init__(
        self,
        job_id: str,
        connection: Redis,
        after: str | None = None,
        *,
        events_retention_s: float = events.EVENTS_RETENTION_S,
    ) -> None:
        self.id = job_id
        self._connection = connection
        # The stream id of the job's queued event, when this handle made it (submit): the job
        # exists, and wait() reads its events from there.
        self._after = after
        # Whether submit() put this job on its queue now (False: the same id was already there,
        # an idempotent resubmit, or a handle made by client.job()).
        self.created = after is not None
        self._retention_s = events_retention_s  # of the queue stream a cancel writes to

    def __repr__(self) -> str:
        return f"KilnJob({self.id!r})"

    def _fetch(self) -> Job:
        from rq.exceptions import NoSuchJobError
        from rq.job import Job
        from rq.serializers import JSONSerializer

        try:
            return Job.fetch(self.id, connection=self._connection, serializer=JSONSerializer)
        except NoSuchJobError:
            # A record a worker could not read was moved aside: say why rather than "no job".
            entry = self._connection.hget(keys.QUARANTINE_KEY, self.id)
            if entry:
                reason = json.loads(entry).get("reason", "unreadable record")
                raise RenderFailed(self.id, f"quarantined: {reason}", "quarantined") from None
            raise UnknownJob(f"no job {self.id!r} in Redis (never submitted, or expired)") from None

    def status(self) -> str:
        """queued, started, finished, failed, stopped or canceled (RQ's names), or quarantined:
        a record a worker could not read, moved aside (result() and wait() say why)."""
        try:
            return _status(self._fetch())
        except RenderFailed as exc:
            if exc.status != "quarantined":
                raise
            return exc.status

    def ended(self) -> bool:
        """Whether the job is over (ENDED: finished, failed, stopped, canceled or quarantined);
        True too for one Redis no longer holds (expired, deleted)."""
        try:
            return self.status() in ENDED
        except UnknownJob:
            return True

    def progress(self) -> Progress | None:
        """Where the running job is, from its newest progress and preview events since it last
        started; None before it starts, or once a shutdown put it back on its queue."""
        progress = events.latest_progress(self._connection, keys.events_key(self.id))
        if progress is None:
            self._fetch()  # UnknownJob for a job that does not exist
        return progress

    def result(self) -> RenderResult | None:
        """The result if the job finished; RenderFailed if it failed, stopped or was canceled."""
        job = self._fetch()
        return self._outcome(job)

    def _outcome(self, job: Job) -> RenderResult | None:
        status = _status(job)
        if status == "finished":
            return RenderResult.model_validate(stored_result(job))
        if status in ENDED_BADLY:
            raw = job.get_meta(refresh=False).get("error")
            error = JobError.model_validate(raw) if raw else None
            message = error.message if error else _last_line(job.latest_result())
            raise RenderFailed(self.id, message or status, status=status)
        return None

    def wait(self, timeout: float = 600.0, poll: float = events.BLOCK_SLICE_S) -> RenderResult:
        """Block until the job ends; return its result or raise RenderFailed / JobTimeout.

        Sleeps in XREAD BLOCK on the job's event stream, so it wakes when the worker writes the
        job's end; it also reads the job's status after every `poll` seconds without an event,
        for jobs that end without one (a record quarantined, a job deleted).
        """
        deadline = time.monotonic() + timeout
        # A handle from submit() knows its job exists and what is in its stream so far.
        after, checked = (self._after, time.monotonic()) if self._after else ("0", float("-inf"))
        while True:
            if time.monotonic() - checked >= poll:
                checked = time.monotonic()
                result = self._outcome(self._fetch())
                if result is not None:
                    return result
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise JobTimeout(f"job {self.id} still {self.status()} after {timeout:.0f} s")
            key = keys.events_key(self.id)
            for event in events.read(self._connection, key, after, min(remaining, poll)):
                after, checked = event.id or after, time.monotonic()  # the job is alive
                if event.kind == "done" and event.result is not None:
                    return event.result  # the end event carries it: no second read
                if event.terminal:
                    checked = float("-inf")  # failed or stopped: the job says why

    def events(self, after: str = "0", timeout: float | None = None) -> Iterator[JobEvent]:
        """The job's events (queued, started, progress, preview, done/failed/stopped) as they come,
        ending after the terminal one or after timeout seconds. Pass the last event's id as
        `after` to resume where an earlier iteration stopped."""
        return events.follow(self._connection, keys.events_key(self.id), after, timeout)

    def download(self, directory: str | Path, timeout: float = 600.0) -> list[Path]:
        """Wait for the result, fetch every image or video (sha256 checked) into directory as
        <job id>-<n>.<ext> (n its index in result.images or result.videos: a job has one kind),
        and return the paths. Works for local and S3 stores, from any host."""
        result = self.wait(timeout=timeout)
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        paths: list[Path] = []
        files: list[ImageFile | VideoFile] = [*result.images, *result.videos]
        for index, file in enumerate(files):
            extension = {"jpeg": "jpg"}.get(file.format, file.format)
            path = target / f"{self.id}-{index}.{extension}"
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(fetch_image(file))
            os.replace(tmp, path)
            paths.append(path)
        return paths

    def snapshot(self, eta: bool = True) -> JobSnapshot:
        """Status, queue position, ETA (eta=False skips its reads), progress, and the result or
        the worker's error, read now; UnknownJob when Redis holds no such job. A quarantined
        job's snapshot says so, with the reason as its error."""
        result: RenderResult | None = None
        error: str | None = None
        try:
            job = self._fetch()
        except RenderFailed as exc:  # quarantined: the reason is its error
            return JobSnapshot(id=self.id, status=exc.status, error=exc.message)
        status = _status(job)
        try:
            result = self._outcome(job)
        except RenderFailed as exc:
            error = exc.message
        running = status == "started"
        return JobSnapshot(
            id=self.id,
            status=status,
            model=result.model if result is not None else keys.model_of(job.origin or ""),
            request=_queued_request(job),
            position=self.position() if status == "queued" else None,
            eta_s=self.eta() if eta and status in ("queued", "started") else None,
            progress=self.progress() if running else None,
            result=result,
            error=error,
        )

    def position(self) -> int | None:
        """How many jobs are ahead of this one in its queue (0: it is next), by RQ's order;
        None when it is not waiting in a queue (started, ended, scheduled)."""
        origin = self._connection.hget(keys.rq_job_key(self.id), "origin")
        if origin is None:
            self._fetch()  # UnknownJob, or why there is none
            return None
        found: Any = self._connection.lpos(keys.rq_queue_key(_text(origin)), self.id)
        return None if found is None else int(found)

    def eta(self) -> float | None:
        """Seconds until the result is expected, counting the jobs ahead of it in its queue and
        each one's measured fit (see api_client.eta); None until the sizes in play have fits."""
        [job] = read_jobs(self._connection, [self.id])
        if job is None:
            self._fetch()  # says why there is no job: quarantined, never submitted, expired
            return None  # submitted under this id a moment ago: no estimate yet
        return job_eta(self._connection, job)

    def cancel(self) -> str:
        """Queued: removed from its queue. Running: stopped at the next denoise step, not retried.

        Returns the status seen when the cancel was made.
        """
        # The stop key first: if a worker takes the job between our read and the cancel below,
        # it still sees the key (before loading, or within its worker's next state beat).
        with self._connection.pipeline(transaction=False) as pipe:
            pipe.set(keys.stop_key(self.id), "1", ex=STOP_TTL_S)
            pipe.hmget(keys.rq_job_key(self.id), ["status", "origin", "worker_name", "data"])
            _, (raw_status, origin, worker, data) = pipe.execute()
        if raw_status is None:
            # No job: status() says why. One submitted under this id since has the stop key.
            return self.status()
        status = _text(raw_status)
        if status in CANCELABLE:
            seen = cancel_queued(self._connection, self.id, _text(origin or b""), self._retention_s)
            if seen in CANCELABLE:  # this call took it off its queue: its end goes to its webhook
                model = keys.model_of(_text(origin or b""))
                stopped = JobEvent(
                    kind="stopped", job_id=self.id, model=model, at=events.now(), error="canceled"
                )
                queue_webhook(self._connection, job_webhook_target(data), stopped)
            status = seen or status
        if status == "started" and worker:
            from redis.exceptions import NoPermissionError
            from rq.command import send_command

            # RQ's stop-job command reaches the worker at once; an ACL without PUBLISH on
            # rq:pubsub:* leaves the stop key, which the worker reads every 10 s.
            with contextlib.suppress(NoPermissionError):
                send_command(self._connection, _text(worker), "stop-job", job_id=self.id)
        return status


def stored_result(job: Job) -> Any:
    """A finished job's return value. kiln workers write it as RQ's own do, to the job's results
    stream (rq:results:<id>, in the one script that writes the job's end), read here through
    Job.return_value; a `result` field in the job hash (an older RQ's writer), which rq's
    restore() reads, is taken first when it is there."""
    stored = job._result  # rq's restore() read the hash's result field into it
    return stored if stored is not None else job.return_value(refresh=True)


def _queued_request(job: Job) -> RenderRequest | None:
    """The request a job was queued with; None when its payload is not one (anyone with write
    access to Redis may have put anything there)."""
    from rq.exceptions import DeserializationError

    try:
        payload = job.kwargs.get("request") if isinstance(job.kwargs, dict) else None
        return RenderRequest.parse(payload) if isinstance(payload, dict) else None
    except (KilnError, ValueError, DeserializationError):
        return None


def _last_line(result: Any) -> str | None:
    text = getattr(result, "exc_string", None)
    if not text:
        return None
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def _status(job: Job) -> str:
    """RQ's status name (queued, started, finished, ...) of a fetched job."""
    status = job.get_status(refresh=False)
    return str(getattr(status, "value", status))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
