"""Small helpers shared by tests: run an in-process worker over real Redis."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from redis import Redis

from api_client import KilnClient
from worker.manifest import load_manifests
from worker.queue import KilnWorker, RecordPublisher, make_worker
from worker.render import Renderer
from worker.settings import Settings
from worker.timings import TimingRecord, read_records


def make_renderer(settings: Settings, models: list[str] | None = None) -> Renderer:
    """A renderer as `kiln worker` builds one: its records publish timing fits and metrics."""
    return Renderer(
        settings,
        load_manifests(settings.manifests, models),
        worker_name=f"test-{uuid.uuid4().hex[:8]}",
        on_record=RecordPublisher(),
    )


def burst(conn: Redis, renderer: Renderer, models: list[str]) -> KilnWorker:
    """Work every queued job of these models in this process, then return the worker."""
    worker = make_worker(conn, renderer, models)
    worker.work(burst=True)
    return worker


def client_for(conn: Redis, settings: Settings) -> KilnClient:
    return KilnClient(connection=conn, manifests_dir=settings.manifests)


def records(log: Path) -> list[TimingRecord]:
    return list(read_records(log)) if log.exists() else []


def enqueue_raw(
    conn: Redis,
    model: str,
    kwargs: dict[str, Any],
    func: str = "worker.queue.render_job",
    **options: Any,
) -> str:
    """Put a job on a kiln queue without the client's validation, as a hostile producer could."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    queue = Queue(f"kiln:{model}", connection=conn, serializer=JSONSerializer)
    job = queue.enqueue_call(func, kwargs=kwargs, **options)
    return str(job.id)
