"""The RQ side of kiln: a worker that never forks and keeps its pipelines resident.

The life of one job, in the order RQ calls into KilnWorker (hooks marked *) and what kiln does.
RQ's data stays RQ's (job hash, queues, intermediate list, registries, results stream), so RQ's
readers see kiln's jobs as any RQ job; RQ's own perform path, about 40 commands in six round
trips a job, is replaced by steps 3 and 7 (worker/execution.py; bench/RESULTS.md).

1. work() starts the Pulse thread (worker/pulse.py) and RQ's loop, round robin over the model
   queues. *dequeue_job_and_maintain_ttl moves a job id from its queue into RQ's intermediate
   list (a record kiln cannot read, or a key a client retyped, is moved aside into the
   quarantine); *reorder_queues runs right after the pop: from here the job must run, whatever
   signal arrives, or it would sit in no queue and no registry.
2. *execute_job caps the job's timeout at KILN_JOB_TIMEOUT_S and gives the job its entry point
   into kiln (RenderJob.run = KilnWorker.render_job with the job's RQJobContext).
3. _start, one round trip: the job hash says started, the execution takes the job's lease (its
   entry in the started registry, lapsing *get_heartbeat_ttl, 10 s, after its last push), the id
   leaves the intermediate list, the stop key is read. From here the Pulse thread pushes the
   lease every 3 s; a push that changes nothing means the lease was swept while this worker
   stalled (`lease_lost`). A cancel arrives as RQ's stop-job command on RQ's pub/sub thread
   (*handle_payload takes nothing else), which sets `cancelled`: the render reads it at its next
   step or phase boundary, with no Redis round trip per denoising step.
4. _perform runs job.perform() under TimeoutPenalty (SIGALRM -> JobDeadlineExceeded):
   RenderJob._execute -> render_job -> Renderer.render (worker/render.py: admit, validate,
   answer from the store, rung, load, generate, confirm the lease, save). A done job's timing
   record is held until step 7 commits it; any other ends here.
5. Heartbeats stop (the job is no longer _running) before the job's end is written.
6. Failure: a job whose lease is lost writes nothing ("lost"). A store outage that heals puts
   the job back for later (_retry_later: STORE_BACKOFF_S). Otherwise *handle_exception keeps the
   exception for *handle_job_failure (RQ's, one more round trip): a ShutdownStop goes back to
   the front of its queue; a JobStopped ends as stopped; anything else fails
   (RenderJob.should_retry is False: only jobs abandoned by a dead worker are retried); a
   FatalWorkerError also ends this worker (exit 1).
7. _after_job: a success as RQ's worker writes it (_finish, one script that writes only while
   the lease is held: status, results stream, finished registry, result TTL; the jobs that
   depend on it are enqueued), then the job's one record is published; then one round trip with
   the model's timing fit, the worker's state if what is resident changed, and the job's last
   events (worker/events.py; the end one carries the result and wakes the client); then the
   job's webhook goes to its thread. RQ's loop calls *heartbeat, where a requested shutdown
   stops the loop.

Beside it, every 5 s, the Pulse thread re-queues jobs whose lease lapsed (*recover_abandoned;
not while Redis is back less than a lease ago, when every lease may have lapsed), moves jobs put
back for later to their queue when due, and delivers the webhook outbox; every 10 s it
publishes the worker's state with RQ's worker hash (state, current job, counters) and reads the
running job's stop key (a stop-job command lost while pub/sub reconnected).
Signals: the first SIGTERM/SIGINT finishes the job and exits (*request_stop); a second stops it
at its next step and re-queues it (*request_force_stop).

Over 300 lines because this docstring and every RQ hook override stay in one place: the order
in which RQ calls them is the thing to read together.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from functools import partial
from types import FrameType
from typing import Any, Literal

from redis import Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as RedisRetry
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job
from rq.registry import StartedJobRegistry, clean_registries
from rq.serializers import JSONSerializer
from rq.suspension import WORKERS_SUSPENDED
from rq.timeouts import UnixSignalDeathPenalty
from rq.utils import current_timestamp, now, utcformat
from rq.worker import DequeueStrategy, WorkerStatus
from rq.worker_registration import clean_worker_registry

from api_client import keys
from api_client.connection import connect
from api_client.errors import short
from api_client.schema import WorkerState
from worker import device as dev
from worker import events as job_events
from worker import execution, keytypes, metrics, quarantine
from worker.errors import (
    FatalWorkerError,
    JobDeadlineExceeded,
    JobStopped,
    LeaseLost,
    ShutdownStop,
    StoreUnavailable,
)
from worker.job import LEASE_LOST, RenderJob, RQJobContext, record_error
from worker.manifest import publish_manifests
from worker.pulse import REDIS_ERRORS, Pulse
from worker.render import Renderer
from worker.timings import FitTracker, TimingRecord
from worker.webhooks import Dispatcher, parse_targets

log = logging.getLogger(__name__)
WORKER_STATE_TTL_S = 60
# The worker's published state, RQ's worker hash and the `rq suspend` check are refreshed this
# often (their TTLs are 60 s and more), not around every job.
STATE_INTERVAL_S = 10.0
FIT_INTERVAL_S = 10.0
Outcome = Literal["finished", "failed", "lost", "retried"]
# A store outage (S3 5xx, a refused connection) puts the job back for later this many times,
# after these many seconds, before it fails naming the cause.
STORE_BACKOFF_S = (10, 30, 90)
# A lease pushed less than (its TTL - this) ago cannot have been swept, even by a worker whose
# clock runs this much ahead: no Redis round trip is needed to know it holds.
LEASE_MARGIN_S = 5.0


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
    timing fit (fixed + per-step seconds, where clients read ETAs) queued on a pipeline the
    worker already sends (flush): a size's first fit at once, later ones at most every
    FIT_INTERVAL_S (fits move slowly; the rest go out with the worker's state)."""

    def __init__(self) -> None:
        self.fits = FitTracker()
        self._changed: set[tuple[str, int, int]] = set()
        self._written_at: dict[tuple[str, int, int], float] = {}
        self._lock = threading.Lock()  # the render thread adds, the pulse thread may flush

    def __call__(self, record: TimingRecord) -> None:
        metrics.observe(record)
        with self._lock:
            key = self.fits.add(record)
            if key is not None:
                self._changed.add(key)

    def flush(self, pipe: Any, everything: bool = False) -> None:
        moment = time.monotonic()
        with self._lock:
            due = {
                key
                for key in self._changed
                if everything or moment - self._written_at.get(key, -math.inf) >= FIT_INTERVAL_S
            }
            for key in due:
                fit = self.fits.fit(key).model_dump_json()
                pipe.hset(keys.FITS_KEY, keys.fit_field(*key), fit)
                self._written_at[key] = moment
            self._changed -= due


class KilnWorker(SimpleWorker):
    """One process per device; the pipeline stays resident across jobs (no fork per job)."""

    job_class = RenderJob
    death_penalty_class = TimeoutPenalty
    heartbeat_interval_s = 3.0
    heartbeat_ttl_s = 10
    sweep_interval_s = 5.0  # a killed worker's job is back on its queue within about 15 s
    state_interval_s = STATE_INTERVAL_S
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
        # The renderer's records go to the worker's publisher (one kept across workers).
        listener = renderer.on_record
        self.publisher = listener if isinstance(listener, RecordPublisher) else RecordPublisher()
        renderer.on_record = self.publisher
        self.job_timeout_s = job_timeout_s
        self.served = [q.name.removeprefix(keys.QUEUE_PREFIX) for q in self.queues]
        self._running: Job | None = None
        self._running_lock = threading.Lock()
        self._last_exception: BaseException | None = None
        self._pulse: Pulse | None = None
        self._holding_job = False
        # Set by a second SIGTERM/SIGINT: the running job stops at its next step and is re-queued.
        self.shutdown_now = threading.Event()
        # Set by a stop-job command for the running job (a cancel), or by the Pulse thread
        # finding its stop key.
        self.cancelled = threading.Event()
        # Set when the running job's lease is found lapsed and taken (execution.py).
        self.lease_lost = threading.Event()
        self._finisher = execution.Finisher(self.connection)
        self._enqueue_due = self.connection.register_script(execution.ENQUEUE_DUE)
        # Monotonic time until which the running job's lease surely holds (holds_lease).
        self._lease_until = -math.inf
        # RQ's counters in the worker hash (rq info, rq-exporter), written with the state beat.
        self.done_jobs = 0
        self.working_s = 0.0
        # When Redis last came back after an outage (inf while it is away): see redis_unsettled.
        self._redis_back_at = -math.inf
        self.fatal: FatalWorkerError | None = None  # why this worker must exit non-zero
        self._suspension_checked_at = float("-inf")
        self._published_resident: list[str] = []
        self.webhooks = Dispatcher.from_settings(renderer.settings)

    # -- the work loop --------------------------------------------------------------------------

    def work(self, burst: bool = False, **kwargs: Any) -> bool:  # type: ignore[override]
        # Round robin across model queues: a busy model must not starve the others.
        kwargs.setdefault("dequeue_strategy", DequeueStrategy.ROUND_ROBIN)
        self.shutdown_now.clear()
        self._pulse = Pulse(self)
        self._pulse.start()
        try:
            return bool(super().work(burst=burst, **kwargs))
        finally:
            self._pulse.stop()
            self.webhooks.close()

    def drain_webhooks(self) -> None:
        """Send the outbox's deliveries for this worker's targets: job ends outside a render
        (cancelled while queued, abandoned, quarantined), queued where no target is known."""
        self.webhooks.drain_outbox(self.connection)

    def register_birth(self) -> None:
        super().register_birth()  # type: ignore[no-untyped-call]
        self.publish_state()  # clients see the worker before its first heartbeat

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
                if isinstance(exc, REDIS_ERRORS):
                    raise
                if quarantine.wrong_type(exc):  # a queue, or the popped job's hash, retyped
                    moved = self.repair_keys(job_id)
                    if job_id is None and moved:
                        continue
                if job_id is None:
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
        minutes on an error) and ids that are not job ids moved aside before rq reads them.
        Not right after an outage (redis_unsettled): rq would fail every running job."""
        if self.redis_unsettled():
            return
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
        """Steps 2-7 in place of RQ's prepare_execution / perform_job / handle_job_success, which
        take about 40 Redis commands in six round trips a job: here the start is one round trip
        and a success is written with the job's end events in the round trip after it."""
        if not isinstance(job, RenderJob):  # its queues are made with job_class=RenderJob
            raise TypeError(f"job {job.id} is a {type(job).__name__}, not a RenderJob")
        # KILN_JOB_TIMEOUT_S bounds every job, whatever timeout the producer asked for.
        if self.job_timeout_s is not None and (
            job.timeout is None or not 0 < job.timeout <= self.job_timeout_s
        ):
            job.timeout = self.job_timeout_s
        stop_asked = self._start(job, queue)
        outcome: Outcome = "failed"
        ctx = None
        try:
            ctx = RQJobContext(
                job,
                self.shutdown_now,
                self.cancelled,
                self.renderer.store,
                stop_asked,
                lease_lost=self.lease_lost,
                holds_lease=self.holds_lease,
            )
            job.run = partial(self.render_job, ctx)
            outcome = self._perform(job, queue)
        finally:
            with self._running_lock:
                self._running = None
            self._after_job(job, queue, outcome, ctx.done_record if ctx else None)
            self.execution = None
            self._state = WorkerStatus.IDLE

    def _start(self, job: Job, queue: Queue) -> bool:
        """Step 3, one round trip (worker/execution.py start): the job hash says started (RQ's
        fields), the execution takes the job's lease until its heartbeat lapses, the job leaves
        RQ's intermediate list, and its stop key is read (True: a cancel came while queued)."""
        self.execution = held = Execution(uuid.uuid4().hex, job.id, self.connection, self.name)
        self._state = WorkerStatus.BUSY
        self.cancelled.clear()
        self.lease_lost.clear()
        with self._running_lock:  # from here a stop-job command for it is taken
            self._running = job

        def send() -> Any:
            with self.connection.pipeline(transaction=False) as pipe:
                execution.start(pipe, job, queue, held, self, self.heartbeat_ttl_s)
                return pipe.execute()[-1]

        try:
            sent_at = time.monotonic()
            stop_asked = self._retyped(job.id, send)
            self._lease_until = sent_at + self.heartbeat_ttl_s
        except BaseException:
            # Redis gone for good (after the connection's minute of retries): the job stays in
            # the intermediate list, where RQ's maintenance fails it, as with RQ's own start.
            with self._running_lock:
                self._running, self.execution = None, None
            raise
        return bool(stop_asked)

    def _perform(self, job: Job, queue: Queue) -> Outcome:
        """Step 4: the render under the job's deadline. "failed" when it raised (RQ's failure
        handling has then run, hooks in step 6), "lost" when the job is no longer this worker's
        (nothing about it is written here)."""
        try:
            timeout = job.timeout or Queue.DEFAULT_TIMEOUT
            penalty = self.death_penalty_class(timeout, JobDeadlineExceeded, job_id=job.id)  # type: ignore[no-untyped-call]
            with penalty:
                job.perform()
        except BaseException:  # as RQ's perform_job: every way out of a job ends it
            job.ended_at = now()
            exc_info = sys.exc_info()
            # A failure is written only by the execution that holds the job: a worker that
            # stalled past its lease must not fail, stop or re-queue another worker's job.
            if isinstance(exc_info[1], LeaseLost) or not self.holds_lease():
                log.warning("job %s: %s", job.id, LEASE_LOST)
                return "lost"
            failure = exc_info[1]
            if isinstance(failure, StoreUnavailable) and self._retry_later(job, queue, failure):
                return "retried"
            self.handle_exception(job, *exc_info)
            exc_string = "".join(traceback.format_exception(*exc_info))
            self.handle_job_failure(job, queue, exc_string=exc_string)
            return "failed"
        job.ended_at = now()
        return "finished"

    def _finish(self, job: Job, queue: Queue) -> bool:
        """A success as RQ's readers see it (worker/execution.py), written only while this
        execution holds the job; then the jobs that depend on it are enqueued, as RQ does.
        False: the lease was lost and nothing was written."""
        held = self.execution
        assert held is not None
        dependents = self._retyped(
            job.id,
            lambda: self._finisher(
                job,
                queue,
                held,
                self,
                job.get_result_ttl(self.default_result_ttl),
                held.created_at,
                job.ended_at or now(),
                self.heartbeat_ttl_s,
            ),
        )
        if dependents is None:
            return False
        # RQ's worker counters, written with the state beat (publish_state).
        self.done_jobs += 1
        self.working_s += max(((job.ended_at or now()) - held.created_at).total_seconds(), 0.0)
        if dependents:
            queue.enqueue_dependents(job)
        return True

    def holds_lease(self) -> bool:
        """Whether the running execution still holds its job. No command while its last push
        landed recently enough that no sweep can have taken it (LEASE_MARGIN_S before it
        lapses, for clocks that differ between hosts); else one, which pushes it again."""
        job, held = self._running, self.execution
        if job is None or held is None:
            return True
        if time.monotonic() < self._lease_until - LEASE_MARGIN_S:
            return True
        sent_at = time.monotonic()
        if not execution.holds(self.connection, job, held, self.heartbeat_ttl_s):
            return False
        self._lease_until = sent_at + self.heartbeat_ttl_s
        return True

    def render_job(self, ctx: RQJobContext) -> dict[str, Any]:
        """Step 4: RQ's call into kiln. The reason for a failure goes into the job's meta."""
        job = ctx.job
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

    def maintain_running_job(self, look_for_stop: bool = True) -> bool:
        """One round trip: push the running job's entry in the started registry past the next
        beat and, with look_for_stop, read its stop key (a cancel normally arrives at once as
        RQ's stop-job command; this catches one sent while the pub/sub connection was down).
        True when Redis took it (or nothing is running)."""
        with self._running_lock:
            job, held = self._running, self.execution
            if job is None or held is None:
                return True
            try:
                sent_at = time.monotonic()
                with self._watching_redis(), self.connection.pipeline(transaction=False) as pipe:
                    execution.push_lease(pipe, job, held, self.heartbeat_ttl_s)
                    if look_for_stop:
                        pipe.exists(keys.stop_key(job.id))
                    pushed, *stop_asked = pipe.execute()
                if pushed:
                    self._lease_until = sent_at + self.heartbeat_ttl_s
            except ResponseError as exc:
                if not quarantine.wrong_type(exc) or not self.repair_keys(job.id):
                    raise
                # The registry a client retyped is gone with every lease in it: take ours again.
                self.connection.zadd(
                    job.started_job_registry.key,
                    {held.composite_key: execution.lease_score(self.heartbeat_ttl_s)},
                )
                return True
            if not pushed and not self.lease_lost.is_set():
                log.warning("job %s: %s", job.id, LEASE_LOST)
                self.lease_lost.set()  # the render stops at its next step or phase
            if any(stop_asked):
                self.cancelled.set()
        return True

    def get_current_job_id(self, pipeline: Any = None) -> str | None:
        # RQ reads this from its worker hash, which kiln does not write per job.
        with self._running_lock:
            return self._running.id if self._running is not None else None

    def handle_payload(self, message: Any) -> None:
        """A message on this worker's RQ pub/sub channel (RQ's pub/sub thread). Clients may
        publish there to cancel, so the only command taken is a stop-job for the running job
        (job.cancel(), or rq's send_stop_job_command): the render stops at its next step or
        phase. RQ's shutdown and kill-horse, anything unknown, and anything that is not a JSON
        command are logged and ignored; nothing a client sends ends the listener."""
        try:
            payload = json.loads(message["data"])
            command, job_id = payload.get("command"), payload.get("job_id")
        except Exception:
            log.warning("ignored a message that is not an RQ command: %s", short(repr(message)))
            return
        if command == "stop-job" and job_id is not None and job_id == self.get_current_job_id():
            log.info("stop-job command for job %s: stopping it at its next step", job_id)
            self._stopped_job_id = job_id
            self.cancelled.set()
        else:
            log.warning(
                "ignored command %s for job %s: a kiln worker takes only a stop-job for its "
                "running job (stop workers with SIGTERM)",
                short(repr(command)),
                short(repr(job_id)),
            )

    def kill_horse(self, sig: Any = None) -> None:
        """Never called by a command (handle_payload takes none that would): a kiln worker has
        no horse, and stops its render through `cancelled`."""
        self.cancelled.set()

    def recover_abandoned(self) -> None:
        """Jobs whose worker stopped heartbeating go back to their queue (if retries are left),
        and jobs put back for later whose time has come too. Two commands a queue when neither
        is due, which is nearly always."""
        if self.redis_unsettled():
            return
        stamp = current_timestamp()
        found = self._retyped(None, partial(self._due, stamp))
        if self.redis_unsettled():  # that read waited out an outage: every lease looks lapsed
            return
        for queue, (_, later) in zip(self.queues, found, strict=True):
            if later:
                self._enqueue_due(
                    keys=[queue.scheduled_job_registry.key, queue.key],
                    args=[stamp, Job.redis_job_namespace_prefix],
                )
        lapsed = [queue for queue, (due, _) in zip(self.queues, found, strict=True) if due]
        for queue in lapsed:
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
                quarantine.sweep(self.connection, queue.key, registry.key, stamp)
                registry.cleanup(stamp)
            finally:
                queue.release_maintenance_lock()

    def _due(self, stamp: float) -> list[tuple[Any, Any]]:
        """Per queue: a lapsed lease, if any; a job put back for later and due, if any."""
        with self._watching_redis(), self.connection.pipeline(transaction=False) as pipe:
            for queue in self.queues:
                pipe.zrangebyscore(queue.started_job_registry.key, 0, stamp, start=0, num=1)
                pipe.zrangebyscore(queue.scheduled_job_registry.key, 0, stamp, start=0, num=1)
            found = pipe.execute()
        return list(zip(found[::2], found[1::2], strict=True))

    def _retry_later(self, job: Job, queue: Queue, exc: StoreUnavailable) -> bool:
        """A store outage that may heal: the job goes back for later, after STORE_BACKOFF_S[n]
        seconds for its n-th time (the sweep moves it to the front of its queue then); False
        once it has had them all, and it fails naming the cause."""
        tries = int(job.meta.get("store_retries") or 0)
        if tries >= len(STORE_BACKOFF_S):
            message = f"the store stayed unavailable through {tries} retries: {exc.cause}"
            record_error(job, "StoreUnavailable", message)
            return False
        delay = STORE_BACKOFF_S[tries]
        job.meta["store_retries"] = tries + 1
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipeline=pipe)
            # Saves the job whole (its meta with the count too), status scheduled.
            queue.schedule_job(job, now() + timedelta(seconds=delay), pipeline=pipe)
            pipe.execute()
        log.warning(
            "job %s: the store is unavailable (%s); retry %d of %d in %d s",
            job.id,
            exc.cause,
            tries + 1,
            len(STORE_BACKOFF_S),
            delay,
        )
        return True

    def repair_keys(self, job_id: str | None = None) -> list[str]:
        """Move aside this worker's keys (and job_id's) that a client overwrote with another
        type (worker/keytypes.py); the keys moved."""
        expected = keytypes.shared([q.name for q in self.queues], self.key)
        if job_id is not None:
            expected |= keytypes.of_job(job_id)
        return quarantine.repair_types(self.connection, expected)

    def _retyped(self, job_id: str | None, call: Callable[[], Any]) -> Any:
        """call(), and once more if it met a key of the wrong type that was then moved aside."""
        try:
            return call()
        except ResponseError as exc:
            if not quarantine.wrong_type(exc) or not self.repair_keys(job_id):
                raise
        return call()

    @contextmanager
    def _watching_redis(self) -> Iterator[None]:
        """Notes when Redis was away: a command that failed, or one that took longer than a
        beat (the connection retries through an outage of up to a minute)."""
        began = time.monotonic()
        try:
            yield
        except REDIS_ERRORS:
            self._redis_back_at = math.inf
            raise
        if self._redis_back_at == math.inf or time.monotonic() - began > self.heartbeat_interval_s:
            self._redis_back_at = time.monotonic()

    def redis_unsettled(self) -> bool:
        """Redis is away, or came back less than a lease ago (the Pulse's watch of the
        connection's retries, or a command that took longer than a beat). Every running job's
        lease may have lapsed while no worker could push it: they are not abandoned, and their
        workers push them within a beat. Sweeping now would re-queue every running job."""
        back_at = self._redis_back_at
        watch = self._pulse.redis if self._pulse is not None else None
        if watch is not None:
            if watch.lost_at is not None:
                return True
            back_at = max(back_at, watch.regained_at)
        return time.monotonic() - back_at < self.heartbeat_ttl_s

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's loop calls this around every dequeue: here it only stops the loop when asked to.
        The worker's hash is kept alive by the Pulse thread (publish_state), not once a job."""
        if self._stop_requested and not self._holding_job:
            # RQ's dequeue loop heartbeats before each blocking pop: the safe point to stop.
            raise StopRequested()

    def check_for_suspension(self, burst: bool) -> None:
        # `rq suspend` is looked for every STATE_INTERVAL_S with one EXISTS, not around each job.
        if time.monotonic() - self._suspension_checked_at < self.state_interval_s:
            return
        self._suspension_checked_at = time.monotonic()
        if self.connection.exists(WORKERS_SUSPENDED):
            super().check_for_suspension(burst)

    def set_state(self, state: str, pipeline: Any = None) -> None:
        # Busy/idle change twice a job; they reach Redis with the next publish_state.
        self._state = state

    def publish_state(self, conn: Any = None, sweep: bool = True) -> None:
        """The worker's state for clients (models, resident, busy or idle), RQ's worker hash
        heartbeat and timing fits not yet written: every STATE_INTERVAL_S from the Pulse thread,
        and after a job that changed what is resident. sweep also drops the names of
        long-silent workers."""
        pipe = conn if conn is not None else self.connection.pipeline(transaction=False)
        moment = time.time()
        resident = self.renderer.cache.model_ids()
        running = self.get_current_job_id()
        state = WorkerState(
            name=self.name,
            models=self.served,
            resident=resident,
            device=self.renderer.info.torch_device,
            device_name=self.renderer.info.name,
            state=str(self.get_state()),
            heartbeat=moment,
            pid=os.getpid(),
            host=socket.gethostname(),
            profile=self.renderer.info.simulated,
            rungs=self.renderer.cache.rungs(),
            running=running,
            jobs_done=self.done_jobs,
            free_bytes=dev.free_bytes(self.renderer.info),
        )
        pipe.set(keys.worker_key(self.name), state.model_dump_json(), ex=WORKER_STATE_TTL_S)
        pipe.zadd(keys.WORKERS_KEY, {self.name: moment})
        if sweep:  # workers killed without a goodbye leave their name behind
            pipe.zremrangebyscore(keys.WORKERS_KEY, 0, moment - WORKER_STATE_TTL_S)
        self.last_heartbeat = now()
        pipe.hset(
            self.key,
            mapping={
                "last_heartbeat": utcformat(self.last_heartbeat),
                "state": state.state,
                "successful_job_count": self.done_jobs,
                "total_working_time": self.working_s,
                **({"current_job": running} if running else {}),
            },
        )
        if not running:
            pipe.hdel(self.key, "current_job")
        pipe.expire(self.key, self.worker_ttl + 60)
        self.publisher.flush(pipe, everything=True)
        self._published_resident = resident
        if conn is None:
            self._retyped(None, pipe.execute)

    def _after_job(
        self, job: Job, queue: Queue, outcome: Outcome, record: TimingRecord | None
    ) -> None:
        """Step 7: a success as RQ records it, only while the lease holds (_finish, one script),
        and then the job's one record; then in one round trip the model's timing fit, the
        worker's state when what is resident changed, and the job's last events (the end one
        wakes the client); then the job's webhook, sent from a background thread."""
        renderer = self.renderer
        metrics.observe_resident(renderer.cache.rungs(), dev.allocated_bytes(renderer.info))
        end = None
        try:
            if outcome == "finished" and not self._finish(job, queue):
                outcome = "lost"
                log.warning("job %s: %s", job.id, LEASE_LOST)
            if record is not None and outcome == "finished":
                renderer.publish(record)  # committed: no crash from here can make a second one
                record = None
            with self.connection.pipeline(transaction=False) as pipe:
                self.publisher.flush(pipe)
                if renderer.cache.model_ids() != self._published_resident:
                    self.publish_state(pipe, sweep=False)
                # A lost job's events are the other worker's to write: this one's are dropped.
                end = self._end_events(job, pipe if outcome != "lost" else None)
                pipe.execute()
        except REDIS_ERRORS as exc:
            # A success not committed is re-run once its lease lapses: answered from the store,
            # not rendered again (worker/render.py step 2), and recorded by that worker.
            log.warning("could not record the end of job %s: %s", job.id, exc)
        except ResponseError as exc:
            # A key retyped by a client: moved aside, the job's last events are lost (its status
            # is written), and the next job finds its keys in order.
            if not quarantine.wrong_type(exc):
                raise
            log.warning("job %s: its last events were not written: %s", job.id, exc)
            self.repair_keys(job.id)
        if record is not None and outcome == "lost":
            record.status, record.error = "stopped", f"job {job.id}: {LEASE_LOST}"
            renderer.publish(record)
        if end is not None and end[1] is not None:
            self.webhooks.send(end[1], end[0])

    def _end_events(self, job: Job, pipe: Any) -> Any:
        """The job's last events, in the same round trip as the state published after it; with
        no pipe the journal is closed and its events dropped."""
        if pipe is None:
            with self.connection.pipeline(transaction=False) as scratch:  # never sent
                job_events.close_journal(self.connection, scratch, job.id, job.origin, "", None)
            return None
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
            with self.connection.pipeline(transaction=False) as pipe:
                self.publisher.flush(pipe, everything=True)
                pipe.delete(keys.worker_key(self.name))
                pipe.zrem(keys.WORKERS_KEY, self.name)
                pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("could not withdraw worker state: %s", exc)


def make_worker(connection: Redis, renderer: Renderer, models: list[str]) -> KilnWorker:
    """A worker named as its renderer, listening on the queues of the models it serves."""
    # A key a client retyped would crash this worker at every start: moved aside first.
    job_events.set_retention(renderer.settings.events_retention_s)
    names = [keys.queue_name(m) for m in models]
    quarantine.repair_types(connection, keytypes.shared(names, f"rq:worker:{renderer.worker_name}"))
    publish_manifests(connection, {m: renderer.manifests[m] for m in models})
    # Where `rq info` and RQ's Queue.all() find queues (kiln's client does not register them).
    connection.sadd(Queue.redis_queues_keys, *[f"rq:queue:{keys.queue_name(m)}" for m in models])
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
