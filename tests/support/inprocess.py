"""A worker in the test's own process over real Redis: a renderer and a worker built as
`kiln worker` builds them (worker/serve.py), burst through the queued jobs, and a client of the
same Redis and manifests."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from redis import Redis

from api_client import KilnClient
from worker.manifest import load_manifests
from worker.queue.build import make_worker as build_worker
from worker.queue.build import open_queues
from worker.queue.lanes import LaneOrder
from worker.queue.upkeep.publisher import RecordPublisher
from worker.queue.upkeep.webhooks import Dispatcher
from worker.queue.worker import KilnWorker
from worker.render.renderer import Renderer
from worker.settings import Settings


def make_renderer(
    settings: Settings,
    models: list[str] | None = None,
    upcoming: Callable[[], str | None] | None = None,
) -> Renderer:
    """A renderer as `kiln worker` builds one: its records publish timing fits and metrics.
    upcoming: the model of the job that comes next (a worker's lanes), for reading ahead."""
    return Renderer(
        settings,
        load_manifests(settings.manifests, models),
        worker_name=f"test-{uuid.uuid4().hex[:8]}",
        on_record=RecordPublisher(),
        upcoming=upcoming,
    )


def make_worker(conn: Redis, renderer: Renderer, models: list[str]) -> KilnWorker:
    """A worker of these models around renderer, built as worker/serve.py builds one: its
    queues, their lane order and its webhook dispatcher made here, the renderer's record
    publisher its own. The renderer reads ahead only what it was made with (serving_worker
    makes one that reads from the worker's lanes)."""
    queues = open_queues(conn, models)
    return _assemble(conn, renderer, queues, LaneOrder(queues))


def serving_worker(conn: Redis, settings: Settings, models: list[str]) -> KilnWorker:
    """A worker built whole as `kiln worker` builds one, its renderer reading ahead the model of
    the job its lanes pop next."""
    queues = open_queues(conn, models)
    lanes = LaneOrder(queues)
    renderer = make_renderer(settings, models, upcoming=lanes.upcoming_model)
    return _assemble(conn, renderer, queues, lanes)


def _assemble(conn: Redis, renderer: Renderer, queues: list[Any], lanes: LaneOrder) -> KilnWorker:
    records = renderer.on_record
    assert isinstance(records, RecordPublisher), "make the renderer with make_renderer"
    webhooks = Dispatcher.from_settings(renderer.settings, renderer.webhook_targets, conn)
    return build_worker(conn, renderer, queues, lanes=lanes, records=records, webhooks=webhooks)


def burst(conn: Redis, renderer: Renderer, models: list[str]) -> KilnWorker:
    """Work every queued job of these models in this process, then return the worker."""
    worker = make_worker(conn, renderer, models)
    worker.work(burst=True)
    return worker


def client_for(conn: Redis, settings: Settings) -> KilnClient:
    return KilnClient(connection=conn, manifests_dir=settings.manifests)
