"""KilnClient: validate a request against published manifests and enqueue it; the models and
workers that serve them. Following one job is api_client.job.KilnJob.

redis and rq load on first use, not at `import api_client`: a backend pays for them in the
processes that talk to Redis only (redis-py imports redis.asyncio with itself)."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api_client import events, inputs, keys
from api_client.connection import connect
from api_client.enqueue import ENQUEUE, QUEUED_TTL_S, RESULT_TTL_S, enqueue_new
from api_client.errors import Problem, RequestRejected
from api_client.eta import fit_key, live_workers, read_fits, taken_first
from api_client.fetch import fetch_image
from api_client.job import KilnJob
from api_client.manifest import Manifest, load_manifest_dir, manifest_dirs
from api_client.resolve import check_servable, check_upscaler, resolve_request
from api_client.schema import (
    RENDER_FUNC,
    ImageFile,
    JobEvent,
    RenderRequest,
    TimingFit,
    VideoFile,
    WorkerState,
    request_payload,
)

if TYPE_CHECKING:
    from redis import Redis

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
JOB_TIMEOUT_S = 600
# A job whose worker died (SIGKILL, lost machine) is re-queued this many times, then failed.
# Workers never retry a job that failed by itself: a render that failed would fail again.
ABANDONED_RETRIES = 3
MANIFESTS_TTL_S = 5.0
RECENT_SCAN = 500  # newest entries of each queue's event stream read by recent_jobs
MAX_JOB_ID_CHARS = 200  # a job id names a directory and is echoed in errors and records
JOB_ID = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_JOB_ID_CHARS}}}")


@dataclass(frozen=True)
class ModelInfo:
    manifest: Manifest
    fits: dict[tuple[int, int], TimingFit] = field(default_factory=dict)
    workers: list[str] = field(default_factory=list)
    resident_on: list[str] = field(default_factory=list)

    queued: dict[str, int] = field(default_factory=dict)  # lane -> jobs waiting in it
    # Serving workers that take no jobs now, and why (no served model's need fits their memory).
    blocked: dict[str, str] = field(default_factory=dict)

    @property
    def default_eta_s(self) -> float | None:
        """Seconds one default job renders in, by the measured fit."""
        if not self.manifest.resolutions:  # an upscaler: each job is its image's size
            return None
        fit = self.fits.get(self.manifest.default_size)
        return None if fit is None else fit.eta(self.manifest.steps.default)

    def eta_now_s(self, lane: str = "interactive") -> float | None:
        """Seconds until a default job submitted now to lane is done: the jobs ahead of it by
        the lane rule (eta.taken_first), each counted as a default job and shared among the
        workers serving the model, then its own render."""
        own = self.default_eta_s
        if own is None:
            return None
        mine = self.queued.get(lane, 0)
        other = sum(n for name, n in self.queued.items() if name != lane)
        ahead = mine + taken_first(lane, mine, other)
        return ahead * own / max(len(self.workers), 1) + own


class KilnClient:
    """Submit image and video jobs to kiln workers through Redis."""

    def __init__(
        self,
        url: str = DEFAULT_REDIS_URL,
        *,
        connection: Redis | None = None,
        manifests_dir: str | Path | Iterable[Path] | None = None,
        events_retention_s: float = events.EVENTS_RETENTION_S,
        input_max_mb: float = inputs.DEFAULT_MAX_MB,
        input_ttl_s: int = inputs.DEFAULT_TTL_S,
    ) -> None:
        """events_retention_s: how long the model queues' event streams keep an event (the
        workers' KILN_EVENTS_RETENTION_S; each writer trims them to its own), at least a minute.
        input_max_mb and input_ttl_s: upload()'s cap and lifetime (the workers'
        KILN_INPUT_MAX_MB and KILN_INPUT_TTL_S)."""
        if not events_retention_s >= 60:
            raise ValueError(f"events_retention_s must be at least 60 s, got {events_retention_s}")
        self.connection = connection if connection is not None else connect(url)
        self.manifests_dir = manifest_dirs(manifests_dir)  # the shipped ones, then these
        self.events_retention_s = events_retention_s
        self.input_max_mb, self.input_ttl_s = input_max_mb, input_ttl_s
        self._published: tuple[float, dict[str, Manifest]] | None = None
        self._local: dict[str, Manifest] | None = None
        self._enqueue = self.connection.register_script(ENQUEUE)

    @classmethod
    def from_env(cls) -> KilnClient:
        """KILN_REDIS_URL, KILN_MANIFESTS and KILN_EVENTS_RETENTION_S: all a client reads."""
        retention = os.environ.get("KILN_EVENTS_RETENTION_S") or str(events.EVENTS_RETENTION_S)
        try:
            seconds = float(retention)
        except ValueError:
            raise ValueError(
                f"KILN_EVENTS_RETENTION_S must be a number of seconds, got {retention!r}"
            ) from None
        return cls(
            os.environ.get("KILN_REDIS_URL", DEFAULT_REDIS_URL),
            manifests_dir=os.environ.get("KILN_MANIFESTS"),
            events_retention_s=seconds,
        )

    def manifests(self) -> dict[str, Manifest]:
        """Every model a request may name: the manifests workers published to Redis (read again
        after MANIFESTS_TTL_S: they change when a worker starts, not between two submits) over
        the shipped and KILN_MANIFESTS ones (read once). A model with a manifest but no worker
        is still a model: its jobs wait for a worker (`kiln models` says it is not served)."""
        if self._published is not None and time.monotonic() - self._published[0] < MANIFESTS_TTL_S:
            return self._published[1]
        if self._local is None:
            self._local, _failures = load_manifest_dir(self.manifests_dir)
        published = self.connection.hgetall(keys.MANIFESTS_KEY)
        parsed = {
            _text(model_id): Manifest.model_validate_json(raw)
            for model_id, raw in published.items()
        }
        merged = {**self._local, **parsed}
        self._published = (time.monotonic(), merged)
        return merged

    def validate(self, request: RenderRequest | dict[str, Any]) -> RenderRequest:
        """The request with defaults filled in, or RequestRejected naming every broken rule."""
        parsed = RenderRequest.parse(request)
        manifests = self.manifests()
        manifest = check_servable(parsed, manifests)
        resolved = resolve_request(self._sized_by_image(parsed), manifest)
        check_upscaler(resolved, manifests)
        problems = self._input_problems(resolved)
        if problems:
            raise RequestRejected(problems, model=resolved.model)
        if resolved.webhook is not None and resolved.webhook not in self.webhook_targets():
            known = ", ".join(sorted(self.webhook_targets())) or "none published"
            rule = f"unknown webhook target; workers are configured with: {known}"
            raise RequestRejected([Problem("webhook", resolved.webhook, rule)], model=parsed.model)
        return resolved

    def upload(self, data: bytes | str | Path) -> str:
        """Keep an input image (bytes or a local file) in Redis under its sha256, for
        KILN_INPUT_TTL_S; its `kiln-input:<sha256>` uri goes in a request's image or mask."""
        return inputs.upload(
            self.connection, data, max_mb=self.input_max_mb, ttl_s=self.input_ttl_s
        )

    def _sized_by_image(self, request: RenderRequest) -> RenderRequest:
        """A request with an input image and no size renders at the image's size."""
        if request.image is None or request.width is not None or request.height is not None:
            return request
        try:
            found = self._input_size(request.image, "image")
        except inputs.InputRefused:
            return request  # named by _input_problems, with the rest
        if found is None:
            return request
        return request.model_copy(update={"width": found.width, "height": found.height})

    def _input_problems(self, request: RenderRequest) -> list[Problem]:
        """The image, mask, control and reference images read where the client can (uploads,
        data: URLs): an image, not too big, the job's size (kiln never resizes an input), the
        mask the image's size; a reference any size (its IP-Adapter's encoder resizes it)."""
        problems: list[Problem] = []
        sizes: dict[str, inputs.InputImage] = {}
        stores: list[str] | None = None
        given = [("image", request.image), ("mask", request.mask)]
        given += [(f"controls.{i}.image", c.image) for i, c in enumerate(request.controls or [])]
        if request.reference is not None:  # any size: its image encoder resizes it
            given.append(("reference.image", request.reference.image))
        for name, value in given:
            if value is None:
                continue
            if value.startswith(("s3://", "file://")):
                stores = self.stores() if stores is None else stores
                problem = inputs.check_store_uri(value, name, stores)
                if problem is not None:
                    problems.append(problem)
                    continue
            problem = inputs.check_image(
                value, name, conn=self.connection, max_mb=self.input_max_mb
            )
            if problem is not None:
                problems.append(problem)
                continue
            found = self._input_size(value, name)
            if found is not None:
                sizes[name] = found
        for name, found in sizes.items():
            if name in ("mask", "reference.image"):
                continue
            if (found.width, found.height) != (request.width, request.height):
                size = f"{request.width}x{request.height}"
                rule = f"must be the job's size, {size} (kiln never resizes an input)"
                problems.append(Problem(name, f"{found.width}x{found.height}", rule))
        image = sizes.get("image")
        if image is not None and "mask" in sizes:
            mismatch = inputs.check_mask(image, sizes["mask"])
            if mismatch is not None:
                problems.append(mismatch)
        return problems

    def _input_size(self, value: str, field: str) -> inputs.InputImage | None:
        """What the client can know of an input's image: an upload's or inline one's bytes
        checked, a job output's size as its result recorded it; None for a store uri."""
        ref = inputs.parse_ref(value, field)
        if ref.kind == "output":
            image = inputs.output_image(self.connection, ref, field)
            return inputs.InputImage(image.sha256, image.format, image.width, image.height, 0)
        data = inputs.input_bytes(self.connection, value, field)
        return (
            None if data is None else inputs.inspect_image(data, field, max_bytes=self._max_bytes)
        )

    @property
    def _max_bytes(self) -> int:
        return int(self.input_max_mb * inputs.MB)

    def stores(self) -> list[str]:
        """Where workers keep results (each one's KILN_OUTPUT_URL, as it published it): an input
        uri must lie in one of them."""
        return sorted(_text(s) for s in self.connection.smembers(keys.STORES_KEY))

    def webhook_targets(self) -> set[str]:
        """Names of the webhook targets workers published (their URLs and secrets stay there)."""
        return {_text(name) for name in self.connection.smembers(keys.WEBHOOK_TARGETS_KEY)}

    def fetch(self, image: ImageFile | VideoFile) -> bytes:
        """One image's or video's bytes from the local dir or S3, from any host; its sha256 is
        checked. (The parameter keeps its name for callers that pass it by keyword.)"""
        return fetch_image(image)

    def queue_events(
        self, model: str, after: str = "$", timeout: float | None = None
    ) -> Iterator[JobEvent]:
        """Every job event of one model's queue, from one place: after="$" for new ones only,
        "0" for all that the stream still holds (its retention's worth), or an event id to
        resume."""
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
        """Validate, then enqueue on the model's queue for the request's priority (its lane).
        The same job_id twice renders once; a job_id that already names a different request,
        or a request for a model whose queue holds MAX_QUEUED jobs, is refused
        (RequestRejected)."""
        from rq import Queue, Retry
        from rq.serializers import JSONSerializer
        from rq.utils import now as rq_now

        parsed = RenderRequest.parse(request)
        resolved = self.validate(parsed)
        if job_id is not None and not JOB_ID.fullmatch(job_id):
            rule = f"must be 1-{MAX_JOB_ID_CHARS} letters, digits, _ or -"
            raise RequestRejected([Problem("job_id", job_id, rule)], model=resolved.model)
        if job_id is not None:
            resolved = self._same_request(job_id, parsed, resolved)
        queue = Queue(
            keys.queue_name(resolved.model, resolved.lane),
            connection=self.connection,
            serializer=JSONSerializer,
        )
        given, job_id = job_id is not None, job_id or uuid.uuid4().hex
        job = queue.create_job(
            RENDER_FUNC,
            kwargs={"request": request_payload(resolved)},
            job_id=job_id,
            retry=Retry(max=ABANDONED_RETRIES),
            timeout=timeout_s,
            result_ttl=RESULT_TTL_S,
            failure_ttl=RESULT_TTL_S,
            ttl=QUEUED_TTL_S,
            description=f"{resolved.model}: {resolved.prompt[:60]}",
        )
        job.enqueued_at = rq_now()
        queued = JobEvent(kind="queued", job_id=job_id, model=resolved.model, at=events.now())
        after = enqueue_new(
            self._enqueue, queue.key, job, queued, at_front, self.events_retention_s
        )
        if after is None and given:
            # Already submitted (idempotent: the same job back), or submitted by someone else
            # between the check above and the script: check again.
            self._same_request(job_id, parsed, resolved)
        return KilnJob(
            job_id, self.connection, after=after, events_retention_s=self.events_retention_s
        )

    def _same_request(
        self, job_id: str, parsed: RenderRequest, resolved: RenderRequest
    ) -> RenderRequest:
        """The request to enqueue under job_id, or RequestRejected when the id already names a
        different one in Redis. A request that leaves the seed to chance takes the queued job's
        seed, so resubmitting it is the same job, not a conflict."""
        from rq.exceptions import NoSuchJobError
        from rq.job import Job
        from rq.serializers import JSONSerializer

        try:
            existing = Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
            queued = existing.kwargs.get("request") if isinstance(existing.kwargs, dict) else None
        except NoSuchJobError:
            return resolved
        if not isinstance(queued, dict):
            queued = {}
        if parsed.seed is None and isinstance(queued.get("seed"), int):
            resolved = resolved.model_copy(update={"seed": queued["seed"]})
        if request_payload(resolved) != queued:
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
        return KilnJob(job_id, self.connection, events_retention_s=self.events_retention_s)

    def models(self) -> list[ModelInfo]:
        """Published manifests with measured timing fits, the workers serving each model and the
        jobs queued in each of its lanes."""
        manifests = self.manifests()
        fits: dict[str, dict[tuple[int, int], TimingFit]] = {}
        for name, fit in read_fits(self.connection.hgetall(keys.FITS_KEY)).items():
            model_id, width, height = fit_key(name) or ("", 0, 0)  # read_fits kept named ones
            fits.setdefault(model_id, {})[(width, height)] = fit
        serving: dict[str, list[str]] = {}
        resident: dict[str, list[str]] = {}
        blocked: dict[str, dict[str, str]] = {}
        for state in self.workers():
            for model_id in state.models:
                serving.setdefault(model_id, []).append(state.name)
                if state.blocked:
                    blocked.setdefault(model_id, {})[state.name] = state.blocked
            for model_id in state.resident:
                resident.setdefault(model_id, []).append(state.name)
        ordered = sorted(manifests.values(), key=lambda m: m.id)
        with self.connection.pipeline(transaction=False) as pipe:
            for m in ordered:
                for queue in keys.lane_queues(m.id):
                    pipe.llen(keys.rq_queue_key(queue))
            depths = iter(pipe.execute())
        queued = {m.id: {lane: int(next(depths)) for lane in keys.LANES} for m in ordered}
        return [
            ModelInfo(
                m,
                fits.get(m.id, {}),
                serving.get(m.id, []),
                resident.get(m.id, []),
                queued[m.id],
                blocked.get(m.id, {}),
            )
            for m in ordered
        ]

    def recent_jobs(self, model: str | None = None, limit: int = 20) -> list[JobEvent]:
        """The newest event of each recent job on one model's queues (every published model's
        when None), newest first: what each queue's event stream still holds (its retention),
        read with one bounded XREVRANGE a model."""
        models = [model] if model else sorted(self.manifests())
        with self.connection.pipeline(transaction=False) as pipe:
            for model_id in models:
                pipe.xrevrange(keys.queue_events_key(model_id), count=RECENT_SCAN)
            streams = pipe.execute()
        newest: dict[str, JobEvent] = {}
        for entries in streams:
            for entry_id, fields in entries:
                try:
                    event = JobEvent.model_validate_json(fields[events.FIELD])
                except (KeyError, ValueError):
                    continue  # anyone with write access may have put anything there
                event.id = _text(entry_id)
                seen = newest.get(event.job_id)
                if seen is None or event.at > seen.at:
                    newest[event.job_id] = event
        return sorted(newest.values(), key=lambda e: e.at, reverse=True)[:limit]

    def workers(self) -> list[WorkerState]:
        """Live workers' published state (those whose heartbeat key has not expired)."""
        return live_workers(self.connection)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
