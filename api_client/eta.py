"""ETAs from what workers measured: each model's timing fit (fixed + steps * per_step seconds
per image, by size, published in kiln:fits) applied to the jobs ahead of a job in its queue."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast

from redis import Redis
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from api_client import keys
from api_client.schema import TimingFit, WorkerState

ENDED = (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED)


def job_eta(connection: Redis, job: Job) -> float | None:
    """Seconds until job's result is expected: the work ahead of it (queued before it, and
    running now) shared among the workers serving its model, then its own render. 0 once the
    job ended; None while a model and size in play has no measured fit yet."""
    status = job.get_status(refresh=False)
    if status in ENDED:
        return 0.0
    fits = {_text(k): TimingFit.model_validate_json(v) for k, v in _hgetall(connection).items()}
    own = _estimate(job, fits)
    if own is None:
        return None
    if status == JobStatus.STARTED:
        return _remaining(job, own)
    queue_key = f"rq:queue:{job.origin}"
    queued = [_text(i) for i in cast(list[bytes], connection.lrange(queue_key, 0, -1))]
    ahead = queued[: queued.index(job.id)] if job.id in queued else queued
    running = StartedJobRegistry(job.origin, connection=connection).get_job_ids()
    # A worker may take this job between the reads above: never count it as ahead of itself.
    ids = [other for other in ahead + running if other != job.id]
    others = Job.fetch_many(ids, connection=connection, serializer=JSONSerializer)
    work = 0.0
    for other in others:
        if other is None:
            continue  # ended and expired between the two reads
        seconds = _estimate(other, fits)
        if seconds is None:
            return None
        started = other.get_status(refresh=False) == JobStatus.STARTED
        work += _remaining(other, seconds) if started else seconds
    return work / max(_workers_serving(connection, job.origin), 1) + own


def _estimate(job: Job, fits: dict[str, TimingFit]) -> float | None:
    request: dict[str, Any] = job.kwargs.get("request") or {}
    model = job.origin.removeprefix(keys.QUEUE_PREFIX)
    fit = fits.get(keys.fit_field(model, request.get("width") or 0, request.get("height") or 0))
    if fit is None:
        return None
    return fit.eta(int(request.get("steps") or 0), int(request.get("num_images") or 1))


def _remaining(job: Job, seconds: float) -> float:
    started = job.started_at
    if started is None:
        return seconds
    aware = started if started.tzinfo else started.replace(tzinfo=timezone.utc)
    return max(seconds - (datetime.now(timezone.utc) - aware).total_seconds(), 0.0)


def _workers_serving(connection: Redis, queue: str) -> int:
    model = queue.removeprefix(keys.QUEUE_PREFIX)
    return sum(1 for state in live_workers(connection) if model in state.models)


def live_workers(connection: Redis) -> list[WorkerState]:
    """Workers whose published state has not expired (a silent worker's key lapses in 60 s)."""
    names = [_text(n) for n in cast(list[bytes], connection.zrange(keys.WORKERS_KEY, 0, -1))]
    if not names:
        return []
    states = cast(list[bytes | None], connection.mget([keys.worker_key(n) for n in names]))
    return [WorkerState.model_validate_json(raw) for raw in states if raw]


def _hgetall(connection: Redis) -> dict[Any, Any]:
    return connection.hgetall(keys.FITS_KEY)  # type: ignore[return-value]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
