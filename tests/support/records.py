"""Records a test writes or reads: rq jobs written straight into Redis, as a producer with Redis
access (a hostile one included) could write them, and a worker's timings log (its parsed records,
or its lines as text)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from redis import Redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from api_client import keys
from api_client.schema import RENDER_FUNC
from worker.render.timings import TimingRecord, read_records


def render_record(conn: Redis, model: str, request: dict[str, Any], **options: Any) -> Job:
    """A real rq job record for kiln's render call on model's queue, saved as queued and put
    on no queue: a test then makes a field garbage, or pushes it, as it needs."""
    job = Job.create(
        RENDER_FUNC,
        kwargs={"request": request},
        connection=conn,
        serializer=JSONSerializer,
        origin=keys.queue_name(model),
        status=JobStatus.QUEUED,
        **options,
    )
    job.save()
    return job


def enqueue_raw(
    conn: Redis,
    model: str,
    kwargs: dict[str, Any],
    func: str = "worker.queue.render_job",
    **options: Any,
) -> str:
    """Put a job on a kiln queue without the client's validation, as a hostile producer could."""
    queue = Queue(f"kiln:{model}", connection=conn, serializer=JSONSerializer)
    job = queue.enqueue_call(func, kwargs=kwargs, **options)
    return str(job.id)


def records(log: Path) -> list[TimingRecord]:
    """The timing log's records (none before it exists)."""
    return list(read_records(log)) if log.exists() else []


def log_lines(log: Path, *job_ids: str) -> list[str]:
    """The timing log's lines that name any of these jobs, read as text: a line that is not a
    record counts too."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if any(job_id in line for job_id in job_ids)]
