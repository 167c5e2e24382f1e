"""The RQ side: a worker that never forks, a Job class that only ever runs kiln's render function,
and the state a worker publishes to Redis (manifests, resident models, timing fits)."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import datetime, timezone
from typing import Any

from redis import Redis
from rq import Queue, SimpleWorker, get_current_job
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.worker import DequeueStrategy

from api_client import keys
from api_client.schema import RENDER_FUNC
from worker.manifest import publish_manifests
from worker.render import Renderer
from worker.timings import FitTracker

log = logging.getLogger(__name__)
WORKER_STATE_TTL_S = 60

_renderer: Renderer | None = None


class RefusedJob(Exception):
    """The job asks RQ to run something other than kiln's render function; nothing was run."""


def install_renderer(renderer: Renderer | None) -> None:
    global _renderer
    _renderer = renderer


def current_renderer() -> Renderer:
    if _renderer is None:
        raise RuntimeError("no renderer installed: render_job runs only inside `kiln worker`")
    return _renderer


class RQJobContext:
    """Progress into job.meta (written by the worker only) and stop requests from the client."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.job_id: str = job.id
        enqueued = job.enqueued_at
        started = job.started_at or datetime.now(timezone.utc)
        self.queue_wait_s = (
            max((_aware(started) - _aware(enqueued)).total_seconds(), 0.0) if enqueued else 0.0
        )
        self._stop_key = keys.stop_key(job.id)

    def progress(self, phase: str, step: int, steps: int) -> None:
        self.job.meta["progress"] = {"phase": phase, "step": step, "steps": steps}
        self.job.save_meta()

    def stop_requested(self) -> bool:
        return bool(self.job.connection.exists(self._stop_key))


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def render_job(request: dict[str, Any]) -> dict[str, Any]:
    """The one function a kiln job may name. Runs in the worker process with a resident renderer."""
    job = get_current_job()
    if job is None:
        raise RuntimeError("render_job must run inside an RQ job")
    try:
        result = current_renderer().render(request, RQJobContext(job))
    except Exception as exc:
        job.meta["error"] = {"type": type(exc).__name__, "message": str(exc)}
        job.save_meta()
        raise
    return result.model_dump(mode="json")


class RenderJob(Job):
    """A Job that resolves its function by whitelist, never by import, and runs no callbacks.

    RQ's own Job imports whatever dotted name the payload carries: a pure-JSON job naming
    os.system would run it. Here any name but kiln's render function is refused unrun.
    """

    @property
    def func(self) -> Any:
        self.verify()
        return render_job

    def verify(self) -> None:
        problems = []
        if self.func_name != RENDER_FUNC:
            problems.append(f"function {self.func_name!r} is not {RENDER_FUNC}")
        if self.instance is not None:
            problems.append("jobs must not carry an instance")
        for kind in ("success", "failure", "stopped"):
            if getattr(self, f"_{kind}_callback_name", None):
                problems.append(f"{kind} callback {getattr(self, f'_{kind}_callback_name')!r} is not allowed")
        if self.webhooks:
            problems.append("webhooks are not allowed")
        if list(self.args) or set(self.kwargs) != {"request"}:
            problems.append("arguments must be exactly one keyword, request")
        if problems:
            message = f"refused job {self.id}: " + "; ".join(problems)
            self.meta["error"] = {"type": "RefusedJob", "message": message}
            self.save_meta()
            raise RefusedJob(message)

    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None

    def send_webhooks(self, status: Any, *, exc_string: str | None = None) -> None:
        return None


class KilnWorker(SimpleWorker):
    """One process per device; the pipeline stays resident across jobs (no fork per job)."""

    job_class = RenderJob

    def __init__(self, *args: Any, renderer: Renderer, **kwargs: Any) -> None:
        kwargs.setdefault("serializer", JSONSerializer)
        kwargs.setdefault("job_class", RenderJob)
        super().__init__(*args, **kwargs)
        self.renderer = renderer
        self.fits = FitTracker()
        self.served = [q.name.removeprefix(keys.QUEUE_PREFIX) for q in self.queues]

    def work(self, burst: bool = False, **kwargs: Any) -> bool:
        # Round robin across model queues: a busy model must not starve the others.
        kwargs.setdefault("dequeue_strategy", DequeueStrategy.ROUND_ROBIN)
        return bool(super().work(burst=burst, **kwargs))

    def execute_job(self, job: Job, queue: Queue) -> None:
        self.renderer.last_record = None
        try:
            super().execute_job(job, queue)
        finally:
            self._publish_after_job()

    def _publish_after_job(self) -> None:
        record = self.renderer.last_record
        key = self.fits.add(record) if record is not None else None
        with self.connection.pipeline() as pipe:
            if key is not None:
                pipe.hset(keys.FITS_KEY, keys.fit_field(*key), json.dumps(self.fits.fit(key)))
            self._publish_state(pipe)
            pipe.execute()

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        super().heartbeat(timeout, pipeline)
        self._publish_state(pipeline if pipeline is not None else self.connection)

    def _publish_state(self, conn: Any) -> None:
        state = {
            "name": self.name,
            "models": self.served,
            "resident": self.renderer.cache.model_ids(),
            "device": self.renderer.info.torch_device,
            "device_name": self.renderer.info.name,
            "heartbeat": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        conn.set(keys.worker_key(self.name), json.dumps(state), ex=WORKER_STATE_TTL_S)
        conn.zadd(keys.WORKERS_KEY, {self.name: state["heartbeat"]})

    def register_death(self) -> None:
        super().register_death()
        self.connection.delete(keys.worker_key(self.name))
        self.connection.zrem(keys.WORKERS_KEY, self.name)


def make_worker(connection: Redis, renderer: Renderer, models: list[str], name: str | None = None) -> KilnWorker:
    """A worker listening on the queues of the models it serves, with the renderer installed."""
    publish_manifests(connection, {m: renderer.manifests[m] for m in models})
    queues = [Queue(keys.queue_name(m), connection=connection, serializer=JSONSerializer) for m in models]
    install_renderer(renderer)
    worker = KilnWorker(queues, connection=connection, renderer=renderer, name=name)
    renderer.worker_name = worker.name
    return worker
