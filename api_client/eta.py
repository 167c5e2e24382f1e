"""ETAs from what workers measured: each model's timing fit (fixed + steps * per_step seconds
per image, by size, published in kiln:fits) applied to the jobs ahead of a job: those before it
in its lane's queue, and those of the model's other lane that the lane rule takes first.

An ETA only reads, and reads a bounded amount: the job's place in its queue by LPOS, a few fields
(HMGET) of at most AHEAD_READ queued jobs and of the running ones; with more jobs ahead than that,
the rest are counted at the mean of those read. It never goes through RQ's Job or registries:
their readers run RQ's clean-up (StartedJobRegistry.get_job_ids() re-queues abandoned jobs and
imports the failure callbacks their records name), which is the workers' job, under their rules.
"""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, cast

from pydantic import ValidationError

from api_client import keys
from api_client.errors import short
from api_client.schema import TimingFit, WorkerState

if TYPE_CHECKING:
    from redis import Redis

AHEAD_READ = 200  # queued jobs read per ETA; the rest ahead are counted at their mean
ENDED = ("finished", "failed", "stopped", "canceled")
FIELDS = ("status", "origin", "data", "started_at")
MAX_DATA_BYTES = 1 << 20  # a record's data is inflated this far at most (a zlib bomb stops here)
REPORTED_MAX = 1000  # unreadable fits remembered as logged; past it they are logged again
log = logging.getLogger(__name__)
_reported: set[tuple[str, int]] = set()  # (field, hash of value) already logged


@dataclass(frozen=True)
class JobSummary:
    """The few fields of a job hash an ETA needs. request is None when the record cannot be read
    as a kiln job: a worker refuses such a job at once, so it costs no time ahead of others."""

    id: str
    status: str
    origin: str
    request: dict[str, Any] | None
    started_at: datetime | None


def read_jobs(connection: Redis, job_ids: list[str]) -> list[JobSummary | None]:
    """Each job's summary (None where its hash is gone), in one round trip."""
    if not job_ids:
        return []
    with connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hmget(keys.rq_job_key(job_id), FIELDS)
        rows: list[list[bytes | None]] = pipe.execute()
    return [_summary(job_id, row) for job_id, row in zip(job_ids, rows, strict=True)]


def job_eta(connection: Redis, job: JobSummary) -> float | None:
    """Seconds until job's result is expected: the work ahead of it (queued before it in its
    lane, the other lane's jobs the lane rule takes first, and what runs now) shared among the
    workers serving its model, then its own render. 0 once the job ended; None while a model
    and size in play has no measured fit yet."""
    if job.status in ENDED:
        return 0.0
    model, lane = keys.model_of(job.origin), keys.lane_of(job.origin)
    own_key = keys.rq_queue_key(job.origin)
    other_key = keys.rq_queue_key(
        keys.queue_name(model, "interactive" if lane == "batch" else "batch")
    )
    with connection.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.FITS_KEY)
        pipe.lpos(own_key, job.id)
        pipe.llen(own_key)
        pipe.lrange(own_key, 0, AHEAD_READ - 1)
        pipe.llen(other_key)
        pipe.lrange(other_key, 0, AHEAD_READ - 1)
        # Live executions only: lapsed ones are abandoned jobs, the workers' sweep's to recover.
        live = f"({time.time()}"
        for queue in keys.lane_queues(model):
            pipe.zrangebyscore(keys.RQ_STARTED_PREFIX + queue, live, "+inf", 0, AHEAD_READ)
        raw_fits, position, length, head, other_length, other_head, *executions = pipe.execute()
    fits = read_fits(raw_fits)
    own = _estimate(job, fits)
    if own is None:
        return None
    if job.status == "started":
        return _remaining(job, own)
    ahead = position if position is not None else length  # not in the list: behind them all
    cutting_in = taken_first(lane, ahead, other_length)
    queued = [_text(i) for i in head[:ahead]]
    cutting = [_text(i) for i in other_head[:cutting_in]]
    # "<job id>:<execution id>"; a worker may take this job between the reads: never count it.
    running = [_text(e).rsplit(":", 1)[0] for found in executions for e in found]
    running = [i for i in running if i != job.id]
    summaries = read_jobs(connection, [*queued, *cutting, *running])
    first, second = len(queued), len(queued) + len(cutting)
    queued_s = _scaled(_work(summaries[:first], fits, started=False), ahead, len(queued))
    other_s = _scaled(_work(summaries[first:second], fits, started=False), cutting_in, len(cutting))
    running_s = _work(summaries[second:], fits, started=True)
    if queued_s is None or other_s is None or running_s is None:
        return None
    work = queued_s + other_s + running_s
    return work / max(_workers_serving(connection, job.origin), 1) + own


def read_fits(raw: Mapping[bytes | str, bytes | str]) -> dict[str, TimingFit]:
    """kiln:fits (HGETALL) as TimingFit by field, "<model>:<w>x<h>". Clients can write that hash:
    a field that is no such name or whose value is no finite timing fit is skipped, and logged
    once (naming the key and the field), so no forged fit stops a reader of the others."""
    fits: dict[str, TimingFit] = {}
    for raw_field, value in raw.items():
        name = _text(raw_field)
        try:
            if fit_key(name) is None:
                raise ValueError('the field is not "<model>:<width>x<height>"')
            fit = TimingFit.model_validate_json(value)
            if not all(math.isfinite(x) for x in (fit.fixed_s, fit.per_step_s)):
                raise ValueError("fixed_s and per_step_s must be finite")
        except ValueError as exc:  # pydantic's ValidationError is one
            _report_unreadable(name, value, exc)
            continue
        fits[name] = fit
    return fits


def fit_key(name: str) -> tuple[str, int, int] | None:
    """A kiln:fits field's model, width and height; None when it is not "<model>:<w>x<h>"."""
    model, _, size = name.rpartition(":")
    width, _, height = size.partition("x")
    if not (model and width.isdecimal() and height.isdecimal()):
        return None
    return model, int(width), int(height)


def _report_unreadable(name: str, value: bytes | str, exc: ValueError) -> None:
    seen = (name, hash(value))
    if seen in _reported:
        return
    if len(_reported) >= REPORTED_MAX:
        _reported.clear()
    _reported.add(seen)
    if isinstance(exc, ValidationError):  # its first error, without the value echoed back
        first = exc.errors()[0]
        why = f"{'.'.join(map(str, first['loc'])) or 'value'}: {first['msg']}"
    else:
        why = str(exc)
    log.warning(
        "%s field %r is not a timing fit, skipped: %s (value %r)",
        keys.FITS_KEY,
        short(name, 100),
        short(why, 200),
        short(_text(value), 100),
    )


def taken_first(lane: str, ahead: int, other_queued: int) -> int:
    """How many of the other lane's queued jobs the workers take before a job with `ahead` jobs
    before it in its own lane (keys.BATCH_EVERY, worker/queue/lanes.py): an interactive job lets one
    batch job through for every BATCH_EVERY - 1 interactive ones ahead of it; a batch job waits
    for at most BATCH_EVERY - 1 interactive jobs for each batch job up to and including itself."""
    if lane == "batch":
        return min(other_queued, (keys.BATCH_EVERY - 1) * (ahead + 1))
    return min(other_queued, ahead // (keys.BATCH_EVERY - 1))


def _scaled(seconds: float | None, count: int, read: int) -> float | None:
    """seconds of the `read` jobs read, scaled to all `count` (the rest at their mean)."""
    if seconds is None or not read or count <= read:
        return seconds
    return seconds * count / read


def _work(jobs: list[JobSummary | None], fits: dict[str, TimingFit], started: bool) -> float | None:
    """Seconds of work these jobs hold (what is left of started ones); None if one has no fit."""
    total = 0.0
    for job in jobs:
        if job is None:
            continue  # ended and expired between the reads
        seconds = _estimate(job, fits)
        if seconds is None:
            return None
        total += _remaining(job, seconds) if started else seconds
    return total


def _estimate(job: JobSummary, fits: dict[str, TimingFit]) -> float | None:
    request = job.request
    if request is None:
        return 0.0
    try:
        width, height = int(request.get("width") or 0), int(request.get("height") or 0)
        steps, images = int(request.get("steps") or 0), int(request.get("num_images") or 1)
    except (TypeError, ValueError):
        return 0.0  # not a request kiln renders: refused at once
    fit = fits.get(keys.fit_field(keys.model_of(job.origin), width, height))
    return None if fit is None else fit.eta(steps, images)


def _remaining(job: JobSummary, seconds: float) -> float:
    started = job.started_at
    if started is None:
        return seconds
    aware = started if started.tzinfo else started.replace(tzinfo=timezone.utc)
    return max(seconds - (datetime.now(timezone.utc) - aware).total_seconds(), 0.0)


def _summary(job_id: str, row: list[bytes | None]) -> JobSummary | None:
    status, origin, data, started = row
    if status is None and origin is None and data is None:
        return None
    return JobSummary(
        id=job_id,
        status=_text(status or b""),
        origin=_text(origin or b""),
        request=_request_of(data),
        started_at=_date(started),
    )


def _request_of(data: bytes | None) -> dict[str, Any] | None:
    """The request in RQ's data field (zlib-compressed JSON [func, instance, args, kwargs]),
    read as data only: no name in it is ever looked up."""
    if not data:
        return None
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(data, MAX_DATA_BYTES)
        if inflater.unconsumed_tail:
            return None
    except zlib.error:
        raw = data  # rq stores uncompressed data too, and reads both
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError included; nested past the stack
        return None
    if not (isinstance(payload, list) and len(payload) == 4 and isinstance(payload[3], dict)):
        return None
    request = payload[3].get("request")
    return request if isinstance(request, dict) else None


def _date(value: bytes | None) -> datetime | None:
    """RQ's utcformat ("...T05:10:55.123456Z"); Python 3.10's fromisoformat needs +00:00."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(_text(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def _workers_serving(connection: Redis, queue: str) -> int:
    model = keys.model_of(queue)
    return sum(1 for state in live_workers(connection) if model in state.models)


def live_workers(connection: Redis) -> list[WorkerState]:
    """Workers whose published state has not expired (a silent worker's key lapses in 60 s)."""
    names = [_text(n) for n in cast(list[bytes], connection.zrange(keys.WORKERS_KEY, 0, -1))]
    if not names:
        return []
    states = cast(list[bytes | None], connection.mget([keys.worker_key(n) for n in names]))
    return [WorkerState.model_validate_json(raw) for raw in states if raw]


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
