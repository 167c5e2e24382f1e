"""The RQ side of kiln: a worker that never forks and keeps its pipelines resident.

The life of one job, in the order RQ calls into KilnWorker (hooks marked *) and what kiln does:

1. work() starts the Pulse thread (worker/pulse.py) and RQ's loop, round robin over the model
   queues. *dequeue_job_and_maintain_ttl moves a job id from its queue into RQ's intermediate
   list; *reorder_queues runs right after the pop: from here the job must run, whatever signal
   arrives, or it would sit in no queue and no registry.
2. *execute_job caps the job's timeout at KILN_JOB_TIMEOUT_S and gives the job its entry point
   into kiln (RenderJob.run = KilnWorker.render_job).
3. *prepare_execution: RQ registers the execution (StartedJobRegistry); the Pulse thread now
   keeps this job's heartbeat fresh (*get_heartbeat_ttl: 10 s, beat every 2 s) and, in the same
   beat, looks for the job's stop key: a cancel reaches the render within a beat, with no Redis
   round trip per denoising step.
4. RQ's perform_job runs job.perform() under TimeoutPenalty (SIGALRM -> JobDeadlineExceeded):
   RenderJob._execute -> render_job -> Renderer.render (worker/render.py: admit, validate,
   answer from disk, rung, load, generate, save). The render emits the job's one timing record
   and hands it to RecordPublisher (metrics, the model's timing fit in Redis).
5. *handle_execution_ended: stop heartbeating before RQ tears the execution down.
6. Success: RQ stores the result dict. Failure: *handle_exception keeps the exception for
   *handle_job_failure: a ShutdownStop goes back to the front of its queue; a JobStopped ends
   as stopped; anything else fails (RenderJob.should_retry is False: only jobs abandoned by a
   dead worker are retried); a FatalWorkerError also ends this worker (exit 1).
7. execute_job's finally sends one pipeline: the model's timing fit, the worker's state and the
   job's last events (worker/events.py, the end one carrying the result, which wakes the client),
   then hands the job's webhook to its thread. RQ's loop calls *heartbeat, which is where a
   requested shutdown stops the loop.

Beside it, every 2 s, the Pulse thread re-queues jobs whose worker stopped heartbeating
(*recover_abandoned). Signals: the first SIGTERM/SIGINT finishes the job and exits
(*request_stop); a second stops it at its next step and re-queues it (*request_force_stop).

Over 300 lines because this docstring and every RQ hook override stay in one place: the order
in which RQ calls them is the thing to read together.
"""

from __future__ import annotations

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
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.registry import StartedJobRegistry, clean_registries
from rq.serializers import JSONSerializer
from rq.timeouts import UnixSignalDeathPenalty
from rq.utils import current_timestamp, now
from rq.worker import DequeueStrategy
from rq.worker_registration import clean_worker_registry

from api_client import keys
from api_client.connection import connect
from api_client.schema import WorkerState
from worker import device as dev
from worker import events as job_events
from worker import metrics, quarantine
from worker.errors import FatalWorkerError, JobDeadlineExceeded, JobStopped, ShutdownStop
from worker.job import RenderJob, RQJobContext, record_error
from worker.manifest import publish_manifests
from worker.pulse import REDIS_ERRORS, Pulse
from worker.render import Renderer
from worker.timings import FitTracker, TimingRecord
from worker.webhooks import Dispatcher, parse_targets

log = logging.getLogger(__name__)
WORKER_STATE_TTL_S = 60
LOOP_BEAT_MIN_S = 1.0


class TimeoutPenalty(UnixSignalDeathPenalty):
    """RQ's SIGALRM job timeout, raising JobDeadlineExceeded (a BaseException)."""

    def handle_death_penalty(self, signum: int, frame: FrameType | None) -> None:
        raise JobDeadlineExceeded(f"ran past its timeout of {self._timeout} s")


def worker_connection(url: str) -> Redis:
    """A connection that rides out a Redis restart: each command retries for about a minute.

    redis-py's default (10 quick retries) gives up within seconds, and RQ's work loop quits on
    the first error it does not expect, so a restart would otherwise take the worker down.
    """
    retry = RedisRetry(ExponentialBackoff(cap=2.0, base=0.1), retries=35)
    return connect(
        url,
        retry=retry,
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=10,
    )


class RecordPublisher:
    """The renderer's record listener in a worker: Prometheus counters now, and the model's
    timing fit (fixed + per-step seconds, where clients read ETAs) in the worker's after-job
    round trip (flush), not in a Redis call of its own."""

    def __init__(self) -> None:
        self.fits = FitTracker()
        self._changed: set[tuple[str, int, int]] = set()

    def __call__(self, record: TimingRecord) -> None:
        metrics.observe(record)
        key = self.fits.add(record)
        if key is not None:
            self._changed.add(key)

    def flush(self, pipe: Any) -> None:
        for key in self._changed:
            pipe.hset(keys.FITS_KEY, keys.fit_field(*key), self.fits.fit(key).model_dump_json())
        self._changed.clear()


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
        self.served = [q.name.removeprefix(keys.QUEUE_PREFIX) for q in self.queues]
        self._running: Job | None = None
        self._running_lock = threading.Lock()
        self._last_exception: BaseException | None = None
        self._pulse: Pulse | None = None
        self._holding_job = False
        # Set by a second SIGTERM/SIGINT: the running job stops at its next step and is re-queued.
        self.shutdown_now = threading.Event()
        # Set by the heartbeat thread when the running job's stop key appears (a cancel).
        self.cancelled = threading.Event()
        self.fatal: FatalWorkerError | None = None  # why this worker must exit non-zero
        # RQ's loop beats and checks for `rq suspend` three times around every job; once a
        # second is plenty (the heartbeat thread keeps the running job fresh).
        self._beat_at = self._suspension_checked_at = float("-inf")
        self.webhooks = Dispatcher.from_settings(renderer.settings)

    # -- the work loop --------------------------------------------------------------------------

    def work(self, burst: bool = False, **kwargs: Any) -> bool:  # type: ignore[override]
        # Round robin across model queues: a busy model must not starve the others.
        kwargs.setdefault("dequeue_strategy", DequeueStrategy.ROUND_ROBIN)
        self.shutdown_now.clear()
        self.publish_state()  # clients see the worker before its first heartbeat
        self._pulse = Pulse(self)
        self._pulse.start()
        try:
            return bool(super().work(burst=burst, **kwargs))
        finally:
            self._pulse.stop()
            self.webhooks.close()

    @property
    def stopping(self) -> bool:
        """A shutdown signal was received (the loop ends after the current job)."""
        return bool(self._stop_requested)

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> Any:
        self._holding_job = False
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as exc:
                # rq tags a popped id it could not even make a Job of (not a job id at all).
                job_id = getattr(exc, "job_id", None)
                if job_id is None or isinstance(exc, REDIS_ERRORS):
                    raise
                queue = getattr(exc, "queue", None)
                reason = f"rq could not read it: {type(exc).__name__}: {exc}"
                quarantine.move_aside(
                    self.connection, str(job_id), [reason], [queue.key] if queue else []
                )

    def run_maintenance_tasks(self) -> None:
        # rq quits its work loop on any error here; a bad record must cost a log line, not a worker.
        try:
            super().run_maintenance_tasks()  # type: ignore[no-untyped-call]
        except REDIS_ERRORS:
            raise
        except Exception:
            log.exception("maintenance failed; carrying on")
            self.last_cleaned_at = now()  # type: ignore[assignment]

    def clean_registries(self) -> None:
        """rq's clean-up, with its lock released whatever happens (rq leaves it set for 15
        minutes on an error) and ids that are not job ids moved aside before rq reads them."""
        for queue in self.queues:
            if not queue.acquire_maintenance_lock():
                continue
            try:
                quarantine.sweep(
                    self.connection, queue.key, queue.started_job_registry.key, current_timestamp()
                )
                clean_registries(queue, self._exc_handlers)
                clean_worker_registry(queue)
                queue.intermediate_queue.cleanup(self, queue)
            except REDIS_ERRORS:
                raise
            except Exception:
                log.exception("clean-up of %s failed; carrying on", queue.name)
            finally:
                queue.release_maintenance_lock()
        self.last_cleaned_at = now()  # type: ignore[assignment]

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
        if isinstance(job, RenderJob):
            job.run = self.render_job
        try:
            super().execute_job(job, queue)
        finally:
            with self._running_lock:
                self._running = None
            self._after_job(job)

    def render_job(self, job: RenderJob) -> dict[str, Any]:
        """Step 4: RQ's call into kiln. The reason for a failure goes into the job's meta."""
        self.cancelled.clear()  # admit() reads the stop key itself, so no cancel is missed
        ctx = RQJobContext(job, self.shutdown_now, self.cancelled, self.renderer.store)
        try:
            result = self.renderer.render(ctx.payload, ctx)
            ctx.events.result = result
        except ShutdownStop:
            raise
        except JobDeadlineExceeded:
            message = f"job {job.id} ran past its timeout of {job.timeout} s"
            record_error(job, "JobDeadlineExceeded", message)
            raise
        except Exception as exc:
            record_error(job, type(exc).__name__, str(exc))
            raise
        return result.model_dump(mode="json")

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
        if isinstance(exc, ShutdownStop):
            self._requeue(job, queue)
            return
        if isinstance(exc, JobStopped):
            # RQ marks the job it was told to stop as STOPPED and never retries it.
            self._stopped_job_id = job.id
        if isinstance(exc, FatalWorkerError):
            log.error("worker %s cannot go on and will exit: %s", self.name, exc)
            self.fatal = exc
            self._stop_requested = True
        super().handle_job_failure(job, queue, started_job_registry, exc_string)

    def _requeue(self, job: Job, queue: Queue) -> None:
        """Back to the front of its queue, as if never started: it was stopped, not broken."""
        job.started_at = job.ended_at = None
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipeline=pipe)
            queue._enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.execute()
        log.warning("job %s stopped by shutdown and re-queued on %s", job.id, queue.name)

    # -- heartbeats, state, recovery (called from the pulse thread) -----------------------------

    def maintain_running_job(self) -> bool:
        """Refresh the running job's heartbeat and look for a cancel of it (the render reads the
        event at its next step); True when Redis took it (or nothing is running)."""
        with self._running_lock:
            job = self._running
            if job is not None and self.execution is not None:
                self.maintain_heartbeats(job)
                if self.connection.exists(keys.stop_key(job.id)):
                    self.cancelled.set()
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
                quarantine.sweep(self.connection, queue.key, registry.key, current_timestamp())
                registry.cleanup()
            finally:
                queue.release_maintenance_lock()

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        if pipeline is None and self._stop_requested and not self._holding_job:
            # RQ's dequeue loop heartbeats before each blocking pop: the safe point to stop.
            raise StopRequested()
        if pipeline is None:
            if time.monotonic() - self._beat_at < LOOP_BEAT_MIN_S:
                return
            self._beat_at = time.monotonic()
        super().heartbeat(timeout, pipeline)

    def check_for_suspension(self, burst: bool) -> None:
        if time.monotonic() - self._suspension_checked_at < LOOP_BEAT_MIN_S:
            return
        self._suspension_checked_at = time.monotonic()
        super().check_for_suspension(burst)

    def set_state(self, state: str, pipeline: Any = None) -> None:
        if pipeline is None and state == self._state:
            return  # RQ sets idle twice between two jobs
        super().set_state(state, pipeline)

    def publish_state(self, conn: Any = None, sweep: bool = True) -> None:
        """The worker's state for clients (models, resident, heartbeat), from the heartbeat
        thread and after each job; sweep also drops the names of long-silent workers."""
        conn = conn if conn is not None else self.connection
        now = time.time()
        state = WorkerState(
            name=self.name,
            models=self.served,
            resident=self.renderer.cache.model_ids(),
            device=self.renderer.info.torch_device,
            device_name=self.renderer.info.name,
            state=str(self.get_state()),
            heartbeat=now,
            pid=os.getpid(),
            host=socket.gethostname(),
        )
        conn.set(keys.worker_key(self.name), state.model_dump_json(), ex=WORKER_STATE_TTL_S)
        conn.zadd(keys.WORKERS_KEY, {self.name: now})
        if sweep:  # workers killed without a goodbye leave their name behind
            conn.zremrangebyscore(keys.WORKERS_KEY, 0, now - WORKER_STATE_TTL_S)

    def _after_job(self, job: Job) -> None:
        """Step 7, in one round trip: the model's timing fit, the worker's state and the job's
        last events; then the job's webhook, sent from a background thread."""
        renderer = self.renderer
        metrics.observe_resident(renderer.cache.rungs(), dev.allocated_bytes(renderer.info))
        end = None
        try:
            with self.connection.pipeline() as pipe:
                if isinstance(renderer.on_record, RecordPublisher):
                    renderer.on_record.flush(pipe)
                self.publish_state(pipe, sweep=False)
                end = self._end_events(job, pipe)
                pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("could not publish state after job: %s", exc)
        if end is not None and end[1] is not None:
            self.webhooks.send(end[1], end[0])

    def _end_events(self, job: Job, pipe: Any) -> Any:
        """The job's last events, in the same round trip as the state published after it."""
        status = job.get_status(refresh=False)
        error = (job.meta.get("error") or {}).get("message")
        return job_events.close_journal(
            self.connection, pipe, job.id, job.origin, str(getattr(status, "value", status)), error
        )

    # -- shutdown ---------------------------------------------------------------------------------

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        """First SIGTERM/SIGINT: finish the current job (if any), then exit.

        Unlike RQ, never raise from the handler: an exception landing between a dequeue and the
        job's registration would drop the job on the floor. The loop stops at its next heartbeat.
        """
        # Re-arm first: a second signal that lands while this one is still being handled (or
        # logged) must already mean "now".
        signal.signal(signal.SIGINT, self.request_force_stop)
        signal.signal(signal.SIGTERM, self.request_force_stop)
        self._shutdown_requested_date = datetime.now(timezone.utc)
        self._stop_requested = True
        log.warning("warm shutdown requested (signal %s): finishing the current job", signum)

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        """Second signal: stop the running job at its next step and put it back on its queue."""
        log.warning("shutdown now requested (signal %s): stopping the job at its next step", signum)
        self.shutdown_now.set()
        self._stop_requested = True

    def teardown(self) -> None:
        try:
            super().teardown()  # type: ignore[no-untyped-call]
            self.connection.delete(keys.worker_key(self.name))
            self.connection.zrem(keys.WORKERS_KEY, self.name)
        except REDIS_ERRORS as exc:
            log.warning("could not withdraw worker state: %s", exc)


def make_worker(connection: Redis, renderer: Renderer, models: list[str]) -> KilnWorker:
    """A worker named as its renderer, listening on the queues of the models it serves."""
    publish_manifests(connection, {m: renderer.manifests[m] for m in models})
    # Names only (never URLs or secrets): clients check a request's webhook against them.
    targets = sorted(parse_targets(renderer.settings.webhooks))
    if targets:
        connection.sadd(keys.WEBHOOK_TARGETS_KEY, *targets)
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
    return KilnWorker(
        queues,
        connection=connection,
        renderer=renderer,
        name=renderer.worker_name,
        job_timeout_s=renderer.settings.job_timeout_s,
    )
