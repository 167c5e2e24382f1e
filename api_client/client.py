"""KilnClient: validate a request against published manifests, enqueue it, follow it to the end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis import Redis
from rq import Queue, Retry
from rq.exceptions import DuplicateJobError, InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from api_client import events, keys
from api_client.connection import connect
from api_client.errors import JobTimeout, Problem, RenderFailed, RequestRejected, UnknownJob
from api_client.eta import job_eta, live_workers
from api_client.fetch import fetch_image
from api_client.manifest import Manifest, check_servable, load_manifest_dir, resolve_request
from api_client.schema import (
    RENDER_FUNC,
    ImageFile,
    JobError,
    JobEvent,
    Progress,
    RenderRequest,
    RenderResult,
    TimingFit,
    WorkerState,
)

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
JOB_TIMEOUT_S = 600
RESULT_TTL_S = 7 * 24 * 3600
STOP_TTL_S = 24 * 3600
# A job whose worker died (SIGKILL, lost machine) is re-queued this many times, then failed.
# Workers never retry a job that failed by itself: a render that failed would fail again.
ABANDONED_RETRIES = 3
MANIFESTS_TTL_S = 5.0
MAX_JOB_ID_CHARS = 200  # a job id names a directory and is echoed in errors and records
JOB_ID = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_JOB_ID_CHARS}}}")


@dataclass(frozen=True)
class ModelInfo:
    manifest: Manifest
    fits: dict[tuple[int, int], TimingFit] = field(default_factory=dict)
    workers: list[str] = field(default_factory=list)
    resident_on: list[str] = field(default_factory=list)

    @property
    def default_eta_s(self) -> float | None:
        fit = self.fits.get(self.manifest.default_size)
        return None if fit is None else fit.eta(self.manifest.steps.default)


class KilnJob:
    """A handle on one submitted job; cheap to make, reads Redis on every call."""

    def __init__(self, job_id: str, connection: Redis) -> None:
        self.id = job_id
        self._connection = connection

    def __repr__(self) -> str:
        return f"KilnJob({self.id!r})"

    def _fetch(self) -> Job:
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
        """queued, started, finished, failed, stopped or canceled (RQ's names)."""
        status = self._fetch().get_status(refresh=False)
        return str(status.value if isinstance(status, JobStatus) else status)

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
        status = job.get_status(refresh=False)
        if status == JobStatus.FINISHED:
            return RenderResult.model_validate(job.return_value(refresh=True))
        if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
            raw = job.get_meta(refresh=False).get("error")
            error = JobError.model_validate(raw) if raw else None
            message = error.message if error else _last_line(job.latest_result())
            raise RenderFailed(self.id, message or str(status.value), status=str(status.value))
        return None

    def wait(self, timeout: float = 600.0, poll: float = events.BLOCK_SLICE_S) -> RenderResult:
        """Block until the job ends; return its result or raise RenderFailed / JobTimeout.

        Sleeps in XREAD BLOCK on the job's event stream, so it wakes when the worker writes the
        job's end; it also reads the job's status at least every `poll` seconds, for jobs that
        end without an event (a job failed by RQ after its worker died).
        """
        deadline = time.monotonic() + timeout
        after, checked = "0", float("-inf")
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
                after = event.id or after
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
        """Wait for the result, fetch every image (sha256 checked) into directory as
        <job id>-<n>.<ext>, and return the paths. Works for local and S3 stores, from any host."""
        result = self.wait(timeout=timeout)
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        paths: list[Path] = []
        for index, image in enumerate(result.images):
            extension = {"jpeg": "jpg"}.get(image.format, image.format)
            path = target / f"{self.id}-{index}.{extension}"
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(fetch_image(image))
            os.replace(tmp, path)
            paths.append(path)
        return paths

    def eta(self) -> float | None:
        """Seconds until the result is expected, counting the jobs ahead of it in its queue and
        each one's measured fit (see api_client.eta); None until the sizes in play have fits."""
        return job_eta(self._connection, self._fetch())

    def cancel(self) -> str:
        """Queued: removed from its queue. Running: stopped at the next denoise step, not retried.

        Returns the status seen when the cancel was made.
        """
        # The stop key first: if a worker takes the job between our read and the cancel below,
        # it still sees the key (before loading, or at the next step).
        self._connection.set(keys.stop_key(self.id), "1", ex=STOP_TTL_S)
        job = self._fetch()
        status = job.get_status(refresh=False)
        if status in (JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED):
            with contextlib.suppress(InvalidJobOperation):  # cancelled twice: already done
                job.cancel()
            model = job.origin.removeprefix(keys.QUEUE_PREFIX) if job.origin else None
            stopped = JobEvent(
                kind="stopped", job_id=self.id, model=model, at=events.now(), error="canceled"
            )
            events.publish(self._connection, [stopped])
        return str(status.value)


def _last_line(result: Any) -> str | None:
    text = getattr(result, "exc_string", None)
    if not text:
        return None
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


class KilnClient:
    """Submit image jobs to kiln workers through Redis."""

    def __init__(
        self,
        url: str = DEFAULT_REDIS_URL,
        *,
        connection: Redis | None = None,
        manifests_dir: str | Path | None = None,
    ) -> None:
        self.connection = connection if connection is not None else connect(url)
        self.manifests_dir = Path(manifests_dir) if manifests_dir is not None else Path("manifests")
        self._published: tuple[float, dict[str, Manifest]] | None = None

    @classmethod
    def from_env(cls) -> KilnClient:
        """KILN_REDIS_URL and KILN_MANIFESTS, the only two settings a client needs."""
        return cls(
            os.environ.get("KILN_REDIS_URL", DEFAULT_REDIS_URL),
            manifests_dir=os.environ.get("KILN_MANIFESTS", "manifests"),
        )

    def manifests(self) -> dict[str, Manifest]:
        """Manifests workers published to Redis (read again after MANIFESTS_TTL_S: they change
        when a worker starts, not between two submits); the local directory when none are."""
        if self._published is not None and time.monotonic() - self._published[0] < MANIFESTS_TTL_S:
            return self._published[1]
        published = self.connection.hgetall(keys.MANIFESTS_KEY)
        if published:
            parsed = {
                _text(model_id): Manifest.model_validate_json(raw)
                for model_id, raw in published.items()
            }
            self._published = (time.monotonic(), parsed)
            return parsed
        manifests, _failures = load_manifest_dir(self.manifests_dir)
        return manifests

    def validate(self, request: RenderRequest | dict[str, Any]) -> RenderRequest:
        """The request with defaults filled in, or RequestRejected naming every broken rule."""
        parsed = RenderRequest.parse(request)
        manifest = check_servable(parsed, self.manifests())
        resolved = resolve_request(parsed, manifest)
        if resolved.webhook is not None and resolved.webhook not in self.webhook_targets():
            known = ", ".join(sorted(self.webhook_targets())) or "none published"
            rule = f"unknown webhook target; workers are configured with: {known}"
            raise RequestRejected([Problem("webhook", resolved.webhook, rule)], model=parsed.model)
        return resolved

    def webhook_targets(self) -> set[str]:
        """Names of the webhook targets workers published (their URLs and secrets stay there)."""
        return {_text(name) for name in self.connection.smembers(keys.WEBHOOK_TARGETS_KEY)}

    def fetch(self, image: ImageFile) -> bytes:
        """One image's bytes from the local dir or S3, from any host; its sha256 is checked."""
        return fetch_image(image)

    def queue_events(
        self, model: str, after: str = "$", timeout: float | None = None
    ) -> Iterator[JobEvent]:
        """Every job event of one model's queue, from one place: after="$" for new ones only,
        "0" for all that the capped stream still holds, or an event id to resume."""
        return events.follow(
            self.connection, keys.queue_events_key(model), after, timeout, until_terminal=False
        )

    def submit(
        self,
        request: RenderRequest | dict[str, Any],
        *,
        job_id: str | None = None,
        at_front: bool = False,
        timeout_s: int = JOB_TIMEOUT_S,
    ) -> KilnJob:
        """Validate, then enqueue on the model's queue. The same job_id twice renders once;
        a job_id that already names a different request is refused (RequestRejected)."""
        parsed = RenderRequest.parse(request)
        resolved = self.validate(parsed)
        if job_id is not None and not JOB_ID.fullmatch(job_id):
            rule = f"must be 1-{MAX_JOB_ID_CHARS} letters, digits, _ or -"
            raise RequestRejected([Problem("job_id", job_id, rule)], model=resolved.model)
        if job_id is not None:
            resolved = self._same_request(job_id, parsed, resolved)
        queue = Queue(
            keys.queue_name(resolved.model), connection=self.connection, serializer=JSONSerializer
        )
        given, job_id = job_id is not None, job_id or uuid.uuid4().hex
        # Already submitted: idempotent, hand back the same job.
        try:
            queue.enqueue_call(
                RENDER_FUNC,
                kwargs={"request": resolved.model_dump(mode="json")},
                job_id=job_id,
                unique=True,
                at_front=at_front,
                retry=Retry(max=ABANDONED_RETRIES),
                timeout=timeout_s,
                result_ttl=RESULT_TTL_S,
                failure_ttl=RESULT_TTL_S,
                description=f"{resolved.model}: {resolved.prompt[:60]}",
            )
        except DuplicateJobError:
            # Enqueued by someone else between the check above and the enqueue: check again.
            if given:
                self._same_request(job_id, parsed, resolved)
            return KilnJob(job_id, self.connection)
        queued = JobEvent(kind="queued", job_id=job_id, model=resolved.model, at=events.now())
        events.publish(self.connection, [queued])
        return KilnJob(job_id, self.connection)

    def _same_request(
        self, job_id: str, parsed: RenderRequest, resolved: RenderRequest
    ) -> RenderRequest:
        """The request to enqueue under job_id, or RequestRejected when the id already names a
        different one in Redis. A request that leaves the seed to chance takes the queued job's
        seed, so resubmitting it is the same job, not a conflict."""
        try:
            existing = Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
            queued = existing.kwargs.get("request") if isinstance(existing.kwargs, dict) else None
        except NoSuchJobError:
            return resolved
        if not isinstance(queued, dict):
            queued = {}
        if parsed.seed is None and isinstance(queued.get("seed"), int):
            resolved = resolved.model_copy(update={"seed": queued["seed"]})
        if resolved.model_dump(mode="json") != queued:
            raise RequestRejected(
                [
                    Problem(
                        "job_id",
                        job_id,
                        "already names a different request; submit this one under a new job id",
                    )
                ],
                model=resolved.model,
            )
        return resolved

    def job(self, job_id: str) -> KilnJob:
        return KilnJob(job_id, self.connection)

    def models(self) -> list[ModelInfo]:
        """Published manifests with measured timing fits and the workers serving each model."""
        manifests = self.manifests()
        fits: dict[str, dict[tuple[int, int], TimingFit]] = {}
        for raw_key, raw in self.connection.hgetall(keys.FITS_KEY).items():
            model_id, _, size = _text(raw_key).rpartition(":")
            width, _, height = size.partition("x")
            fits.setdefault(model_id, {})[(int(width), int(height))] = (
                TimingFit.model_validate_json(raw)
            )
        serving: dict[str, list[str]] = {}
        resident: dict[str, list[str]] = {}
        for state in self.workers():
            for model_id in state.models:
                serving.setdefault(model_id, []).append(state.name)
            for model_id in state.resident:
                resident.setdefault(model_id, []).append(state.name)
        return [
            ModelInfo(m, fits.get(m.id, {}), serving.get(m.id, []), resident.get(m.id, []))
            for m in sorted(manifests.values(), key=lambda m: m.id)
        ]

    def workers(self) -> list[WorkerState]:
        """Live workers' published state (those whose heartbeat key has not expired)."""
        return live_workers(self.connection)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
