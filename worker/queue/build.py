"""What `kiln worker` builds a KilnWorker on: its queues, and Redis made ready for it (the events'
retention, keys a client retyped moved aside, what clients read before its first job). The
composition root (worker/serve.py) builds every collaborator and hands it in here."""

from __future__ import annotations

from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from api_client import keys
from worker.queue import events as job_events
from worker.queue.job import RenderJob
from worker.queue.lanes import LaneOrder, worker_queues
from worker.queue.upkeep import keytypes, quarantine
from worker.queue.upkeep.publisher import RecordPublisher, announce
from worker.queue.upkeep.webhooks import Dispatcher
from worker.queue.worker import KilnWorker
from worker.render.renderer import Renderer


def open_queues(connection: Redis, models: list[str]) -> list[Queue]:
    """Both lanes of every model (worker/queue/lanes.py), carrying RenderJob: RQ's registry
    clean-ups fetch jobs through queue.job_class, and a plain Job there would import and run a
    payload's failure callback."""
    return [
        Queue(name, connection=connection, serializer=JSONSerializer, job_class=RenderJob)
        for name in worker_queues(models)
    ]


def make_worker(
    connection: Redis,
    renderer: Renderer,
    queues: list[Queue],
    *,
    lanes: LaneOrder,
    records: RecordPublisher,
    webhooks: Dispatcher,
) -> KilnWorker:
    """A worker named as its renderer, on these queues, with Redis made ready for it first: the
    events' retention set, keys a client retyped moved aside (they would crash it at every
    start), its models' manifests, its queues and webhook targets announced."""
    job_events.set_retention(renderer.settings.events_retention_s)
    names = [q.name for q in queues]
    quarantine.repair_types(connection, keytypes.shared(names, f"rq:worker:{renderer.worker_name}"))
    models = list(dict.fromkeys(keys.model_of(name) for name in names))
    announce(connection, renderer, models, names)
    return KilnWorker(
        queues,
        connection=connection,
        name=renderer.worker_name,
        renderer=renderer,
        lanes=lanes,
        records=records,
        webhooks=webhooks,
        job_timeout_s=renderer.settings.job_timeout_s,
    )
