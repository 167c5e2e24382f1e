"""The RQ side: a worker that never forks, a Job class that only ever runs kiln's render function,
a side thread that keeps heartbeats fresh and recovers abandoned jobs, and the state a worker
publishes to Redis (manifests, resident models, timing fits)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from datetime import datetime, timezone
from types import FrameType
from typing import Any

from redis import Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as RedisRetry
from rq import Queue, SimpleWorker, get_current_job
from rq.exceptions import StopRequested
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.timeouts import UnixSignalDeathPenalty
from rq.worker import DequeueStrategy

from api_client import keys
from api_client.schema import RENDER_FUNC
from worker import metrics
from worker.manifest import publish_manifests
from worker.render import JobStopped, Renderer, requested_model
from worker.timings import FitTracker, TimingRecord, emit

log = logging.getLogger(__name__)
WORKER_STATE_TTL_S = 60
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)

_renderer: Renderer | None = None
# Set by a second SIGTERM/SIGINT: the running job stops at its next step and goes back to its queue.
_shutdown_now = threading.Event()


class JobTimedOut(BaseException):
    """KILN_JOB_TIMEOUT_S passed. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way (a compile fallback, a preview, a quantization check) can
    swallow it and leave the job running unbounded, as RQ's Exception-based timeout would."""


class TimeoutPenalty(UnixSignalDeathPenalty):
    """RQ's SIGALRM job timeout, raising JobTimedOut."""

    def handle_death_penalty(self, signum: int, frame: FrameType | None) -> None:
        raise JobTimedOut(f"ran past its timeout of {self._timeout} s")


class RefusedJob(Exception):
    """The job asks RQ to run something other than kiln's render function; nothing was run."""


class ShutdownStop(JobStopped):
    """A second shutdown signal stopped the job at a step boundary; it is re-queued, not failed."""


def install_renderer(renderer: Renderer | None) -> None:
    global _renderer
    _renderer = renderer


def current_renderer() -> Renderer:
    if _renderer is None:
        raise RuntimeError("no renderer installed: render_job runs only inside `kiln worker`")
    return _renderer


def worker_connection(url: str) -> Redis:
    """A connection that rides out a Redis restart: each command retries for about a minute.

    redis-py's default (10 quick retries) gives up within seconds, and RQ's work loop quits on
    the first error it does not expect, so a restart would otherwise take the worker down.
    """
    retry = RedisRetry(ExponentialBackoff(cap=2.0, base=0.1), retries=35)
    return Redis.from_url(
        url,
        retry=retry,
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=10,
    )


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
        self._preview: str | None = None

    def progress(self, phase: str, step: int, steps: int, preview: str | None = None) -> None:
        # The latest preview stays in every later update until a newer one replaces it.
        self._preview = preview or self._preview
        self.job.meta["progress"] = {
            "phase": phase,
            "step": step,
            "steps": steps,
            "preview": self._preview,
        }
        self.job.save_meta()

    def stop_requested(self) -> bool:
        if _shutdown_now.is_set():
            raise ShutdownStop(f"job {self.job_id} stopped by worker shutdown; re-queued")
        return bool(self.job.connection.exists(self._stop_key))


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def render_job(request: dict[str, Any]) -> dict[str, Any]:
    """The one function a kiln job may name. Runs in the worker process with a resident renderer."""
    job = get_current_job()
    if job is None:
        raise RuntimeError("render_job must run inside an RQ job")
    ctx = RQJobContext(job)
    try:
        # A job cancelled while it sat in a queue (or while its worker died) never loads a model.
        if ctx.stop_requested():
            raise JobStopped(f"job {job.id} stopped on request before it started")
        result = current_renderer().render(request, ctx)
    except ShutdownStop:
        raise
    except JobTimedOut:
        _record_error(job, "JobTimeout", f"job {job.id} ran past its timeout of {job.timeout} s")
        raise
    except Exception as exc:
        _record_error(job, type(exc).__name__, str(exc))
        raise
    return result.model_dump(mode="json")


def _record_error(job: Job, kind: str, message: str) -> None:
    job.meta["error"] = {"type": kind, "message": message}
    job.save_meta()


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
                problems.append(
                    f"{kind} callback {getattr(self, f'_{kind}_callback_name')!r} is not allowed"
                )
        if self.webhooks:
            problems.append("webhooks are not allowed")
        if list(self.args) or not isinstance(self.kwargs, dict) or set(self.kwargs) != {"request"}:
            problems.append("arguments must be exactly one keyword, request")
        if problems:
            message = f"refused job {self.id}: " + "; ".join(problems)
            _record_error(self, "RefusedJob", message)
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

    @property
    def should_retry(self) -> bool:
        # Retries are for abandoned jobs (a dead worker); a render that failed would fail again.
        return False

    def send_webhooks(self, status: Any, *, exc_string: str | None = None) -> None:
        return None


class Pulse(threading.Thread):
    """Beside the render: keep the running job's heartbeat fresh, publish the worker's state, and
    hand abandoned jobs (their worker's heartbeat lapsed) back to their queue.

    SimpleWorker only heartbeats between jobs; a render that outlives the heartbeat TTL would look
    abandoned, and a TTL long enough to cover any render would leave a killed worker's job stuck
    for that long. Every Redis call here goes through the worker's pool, which is thread-safe.
    """

    def __init__(self, worker: KilnWorker) -> None:
        super().__init__(name=f"kiln-pulse-{worker.name}", daemon=True)
        self.worker = worker
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.worker.heartbeat_interval_s):
            self.beat()

    def beat(self) -> None:
        try:
            fresh = self.worker.maintain_running_job()
            self.worker.publish_state()
            # Only sweep after our own heartbeat landed: after a Redis outage our own job's entry
            # may have lapsed, and it must not be mistaken for an abandoned one.
            if fresh:
                self.worker.recover_abandoned()
        except REDIS_ERRORS as exc:
            log.warning(
                "pulse: Redis unavailable (%s); retrying in %.0f s",
                exc,
                self.worker.heartbeat_interval_s,
            )
        except Exception:
            log.exception("pulse: unexpected error; carrying on")

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)


class KilnWorker(SimpleWorker):
    """One process per device; the pipeline stays resident across jobs (no fork per job)."""

    job_class = RenderJob
    death_penalty_class = TimeoutPenalty
    # A killed worker's job is recovered within heartbeat_ttl_s + heartbeat_interval_s.
    heartbeat_interval_s = 2.0
    heartbeat_ttl_s = 10
    # Reconnect quickly after a Redis restart instead of RQ's backoff up to a minute.
    max_connection_wait_time = 5.0

    def __init__(
        self, *args: Any, renderer: Renderer, job_timeout_s: int | None = None, **kwargs: Any
    ) -> None:
        kwargs.setdefault("serializer", JSONSerializer)
        kwargs.setdefault("job_class", RenderJob)
        # worker_ttl 20 makes RQ's blocking dequeue wake every 5 s, so an idle worker notices a
        # shutdown request promptly without the signal handler interrupting a dequeue half done.
        kwargs.setdefault("worker_ttl", 20)
        super().__init__(*args, **kwargs)
        self.renderer = renderer
        self.job_timeout_s = job_timeout_s
        self.fits = FitTracker()
        self.served = [q.name.removeprefix(keys.QUEUE_PREFIX) for q in self.queues]
        self._running: Job | None = None
        self._running_lock = threading.Lock()
        self._last_exception: BaseException | None = None
        self._pulse: Pulse | None = None
        self._holding_job = False

    # -- the work loop --------------------------------------------------------------------------

    def work(self, burst: bool = False, **kwargs: Any) -> bool:  # type: ignore[override]
        # Round robin across model queues: a busy model must not starve the others.
        kwargs.setdefault("dequeue_strategy", DequeueStrategy.ROUND_ROBIN)
        _shutdown_now.clear()
        self._pulse = Pulse(self)
        self._pulse.start()
        try:
            return bool(super().work(burst=burst, **kwargs))
        finally:
            self._pulse.stop()

    @property
    def stopping(self) -> bool:
        """A shutdown signal was received (the loop ends after the current job)."""
        return bool(self._stop_requested)

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> Any:
        self._holding_job = False
        return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)

    def reorder_queues(self, reference_queue: Queue) -> None:
        # RQ calls this right after a successful pop: from here on the job must run, whatever
        # signal arrives, or it would be off its queue and in no registry.
        self._holding_job = True
        super().reorder_queues(reference_queue)

    def execute_job(self, job: Job, queue: Queue) -> None:
        # KILN_JOB_TIMEOUT_S bounds every job, whatever timeout the producer asked for.
        if self.job_timeout_s is not None and (
            job.timeout is None or not 0 < job.timeout <= self.job_timeout_s
        ):
            job.timeout = self.job_timeout_s
        self.renderer.last_record = None
        try:
            super().execute_job(job, queue)
        finally:
            with self._running_lock:
                self._running = None
            self._publish_after_job()

    def prepare_execution(self, job: Job) -> Any:
        execution = super().prepare_execution(job)
        with self._running_lock:
            self._running = job
        return execution

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        # Stop heartbeating before RQ tears the execution down, so a late beat cannot revive it.
        with self._running_lock:
            self._running = None
        super().handle_execution_ended(job, queue, heartbeat_ttl)

    def get_heartbeat_ttl(self, job: Job) -> int:
        return self.heartbeat_ttl_s

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        self._last_exception = exc_info[1] if len(exc_info) > 1 else None
        super().handle_exception(job, *exc_info)

    def handle_job_failure(
        self, job: Job, queue: Queue, started_job_registry: Any = None, exc_string: str = ""
    ) -> None:
        exc, self._last_exception = self._last_exception, None
        if self.renderer.last_record is None:
            self._record_unrendered(job, exc)
        if isinstance(exc, ShutdownStop):
            self._requeue(job, queue)
            return
        if isinstance(exc, JobStopped):
            # RQ marks the job it was told to stop as STOPPED and never retries it.
            self._stopped_job_id = job.id
        super().handle_job_failure(job, queue, started_job_registry, exc_string)

    def _record_unrendered(self, job: Job, exc: BaseException | None) -> None:
        """Every job leaves one timing record, also one refused or stopped before rendering."""
        try:
            request = job.kwargs.get("request") if isinstance(job.kwargs, dict) else None
        except Exception:
            request = None
        record = TimingRecord(
            job_id=job.id,
            model=requested_model(request),
            status="stopped" if isinstance(exc, JobStopped) else "failed",
            error=f"{type(exc).__name__}: {exc}" if exc is not None else "failed before rendering",
            worker=self.name,
            device=self.renderer.info.torch_device,
            simulated_device=self.renderer.info.simulated,
        )
        self.renderer.last_record = record
        emit(record, self.renderer.settings.timings_log)

    def _requeue(self, job: Job, queue: Queue) -> None:
        """Back to the front of its queue, as if never started: it was stopped, not broken."""
        job.meta.pop("progress", None)
        job.started_at = job.ended_at = None
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipeline=pipe)
            queue._enqueue_job(job, pipeline=pipe, at_front=True)
            # job.save() skips an empty meta, which would leave the old progress in Redis.
            pipe.hset(job.key, "meta", self.serializer.dumps(job.meta))
            pipe.execute()
        log.warning("job %s stopped by shutdown and re-queued on %s", job.id, queue.name)

    # -- heartbeats, state, recovery (called from the pulse thread) -----------------------------

    def maintain_running_job(self) -> bool:
        """Refresh the running job's heartbeat; True when Redis took it (or nothing is running)."""
        with self._running_lock:
            if self._running is not None and self.execution is not None:
                self.maintain_heartbeats(self._running)
        return True

    def recover_abandoned(self) -> None:
        """Jobs whose worker stopped heartbeating go back to their queue (if retries are left)."""
        for queue in self.queues:
            # RQ's own lock: two sweepers would each re-queue the same job.
            if not queue.acquire_maintenance_lock():
                continue
            try:
                registry = StartedJobRegistry(
                    queue.name,
                    connection=self.connection,
                    job_class=RenderJob,
                    serializer=self.serializer,
                )
                registry.cleanup()
            finally:
                queue.release_maintenance_lock()

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        if pipeline is None and self._stop_requested and not self._holding_job:
            # RQ's dequeue loop heartbeats before each blocking pop: the safe point to stop.
            raise StopRequested()
        super().heartbeat(timeout, pipeline)
        self.publish_state(pipeline if pipeline is not None else self.connection)

    def publish_state(self, conn: Any = None) -> None:
        conn = conn if conn is not None else self.connection
        now = time.time()
        state = {
            "name": self.name,
            "models": self.served,
            "resident": list(self.renderer.cache.model_ids()),
            "device": self.renderer.info.torch_device,
            "device_name": self.renderer.info.name,
            "state": self.get_state(),
            "heartbeat": now,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        conn.set(keys.worker_key(self.name), json.dumps(state), ex=WORKER_STATE_TTL_S)
        conn.zadd(keys.WORKERS_KEY, {self.name: now})
        # Workers killed without a goodbye leave their name behind; drop the long-silent ones.
        conn.zremrangebyscore(keys.WORKERS_KEY, 0, now - WORKER_STATE_TTL_S)

    def _publish_after_job(self) -> None:
        record = self.renderer.last_record
        if record is not None:
            metrics.observe(record)
        key = self.fits.add(record) if record is not None else None
        try:
            with self.connection.pipeline() as pipe:
                if key is not None:
                    pipe.hset(keys.FITS_KEY, keys.fit_field(*key), json.dumps(self.fits.fit(key)))
                self.publish_state(pipe)
                pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("could not publish state after job: %s", exc)

    # -- shutdown ---------------------------------------------------------------------------------

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        """First SIGTERM/SIGINT: finish the current job (if any), then exit.

        Unlike RQ, never raise from the handler: an exception landing between a dequeue and the
        job's registration would drop the job on the floor. The loop stops at its next heartbeat.
        """
        log.warning("warm shutdown requested (signal %s): finishing the current job", signum)
        self._shutdown_requested_date = datetime.now(timezone.utc)
        self._stop_requested = True
        signal.signal(signal.SIGINT, self.request_force_stop)
        signal.signal(signal.SIGTERM, self.request_force_stop)

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        """Second signal: stop the running job at its next step and put it back on its queue."""
        log.warning("shutdown now requested (signal %s): stopping the job at its next step", signum)
        _shutdown_now.set()
        self._stop_requested = True

    def teardown(self) -> None:
        try:
            super().teardown()  # type: ignore[no-untyped-call]
            self.connection.delete(keys.worker_key(self.name))
            self.connection.zrem(keys.WORKERS_KEY, self.name)
        except REDIS_ERRORS as exc:
            log.warning("could not withdraw worker state: %s", exc)


def make_worker(
    connection: Redis, renderer: Renderer, models: list[str], name: str | None = None
) -> KilnWorker:
    """A worker listening on the queues of the models it serves, with the renderer installed."""
    publish_manifests(connection, {m: renderer.manifests[m] for m in models})
    # The queues carry RenderJob too: RQ's registry cleanups fetch jobs through queue.job_class,
    # and a plain Job there would import and run a payload's failure callback.
    queues = [
        Queue(
            keys.queue_name(m),
            connection=connection,
            serializer=JSONSerializer,
            job_class=RenderJob,
        )
        for m in models
    ]
    install_renderer(renderer)
    worker = KilnWorker(
        queues,
        connection=connection,
        renderer=renderer,
        name=name,
        job_timeout_s=renderer.settings.job_timeout_s,
    )
    renderer.worker_name = worker.name
    return worker
