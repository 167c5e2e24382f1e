"""A job's hold on Redis while this worker runs it: the start round trip that takes its lease,
the lease pushed and confirmed, the finish written only while it holds, and what happens to jobs
that lose their worker: abandoned ones re-queued, store outages put back for later, stopped ones
put back in front. The Redis commands themselves are worker/execution.py's; KilnWorker
(worker/queue.py) mixes this in and calls it from steps 3, 6 and 7 and from the Pulse thread.

Over 300 lines because a lease's take, pushes and conditional finish, and the sweep that re-queues
lapsed ones, are one protocol whose invariant (only the holder writes) is read across all of them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Literal

from redis import Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as RedisRetry
from rq import Queue
from rq.executions import Execution
from rq.job import Job
from rq.registry import StartedJobRegistry, clean_registries
from rq.utils import current_timestamp, now
from rq.worker import WorkerStatus
from rq.worker_registration import clean_worker_registry

from api_client import keys
from api_client.connection import connect
from worker import execution, keytypes, quarantine
from worker.errors import StoreUnavailable
from worker.execution import Finisher
from worker.job import LEASE_LOST, RenderJob, record_error
from worker.pulse import REDIS_ERRORS, Pulse

log = logging.getLogger(__name__)
Outcome = Literal["finished", "failed", "lost", "retried"]
# A store outage (S3 5xx, a refused connection) puts the job back for later this many times,
# after these many seconds, before it fails naming the cause.
STORE_BACKOFF_S = (10, 30, 90)
# A lease pushed less than (its TTL - this) ago cannot have been swept, even by a worker whose
# clock runs this much ahead: no Redis round trip is needed to know it holds.
LEASE_MARGIN_S = 5.0


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


class LeaseKeeper:
    """KilnWorker's round trips for the job it holds and the jobs others dropped. The attributes
    below are KilnWorker's (RQ's SimpleWorker and its own __init__)."""

    connection: Redis
    name: str
    key: str
    queues: list[Queue]
    serializer: Any
    default_result_ttl: int
    execution: Execution | None
    heartbeat_interval_s: float
    heartbeat_ttl_s: int
    cancelled: threading.Event
    lease_lost: threading.Event
    done_jobs: int
    working_s: float
    cleanup_execution: Callable[..., Any]
    _exc_handlers: list[Any]
    _state: Any
    _running: Job | None
    _running_lock: threading.Lock
    _pulse: Pulse | None
    _finisher: Finisher
    _enqueue_due: Any
    _any_due: Any
    _lease_until: float
    _redis_back_at: float

    def init_lease(self) -> None:
        self._running = None
        self._running_lock = threading.Lock()
        self.cancelled = threading.Event()  # a stop-job command, or the stop key found
        self.lease_lost = threading.Event()  # the running job's lease found lapsed and taken
        self._finisher = Finisher(self.connection)
        self._enqueue_due = self.connection.register_script(execution.ENQUEUE_DUE)
        self._any_due = self.connection.register_script(execution.ANY_DUE)
        # Monotonic time until which the running job's lease surely holds (holds_lease).
        self._lease_until = -math.inf
        # RQ's counters in the worker hash (rq info, rq-exporter), written with the state beat.
        self.done_jobs = 0
        self.working_s = 0.0
        # When Redis last came back after an outage (inf while it is away): see redis_unsettled.
        self._redis_back_at = -math.inf

    # -- the job this worker holds ------------------------------------------------------------

    def _start(self, job: Job, queue: Queue) -> bool:
        """Step 3, one round trip (worker/execution.py start): the job hash says started (RQ's
        fields), the execution takes the job's lease until its heartbeat lapses, and its stop
        key is read (True: a cancel came while queued)."""
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
            # Redis gone for good (after the connection's minute of retries): as with RQ's own
            # start after a pop from several queues, the job is in no registry; its hash says
            # queued until it expires, and a client's wait ends with its timeout.
            with self._running_lock:
                self._running, self.execution = None, None
            raise
        return bool(stop_asked)

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

    # -- jobs put back on their queue -------------------------------------------------------

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

    def _requeue(self, job: Job, queue: Queue) -> None:
        """Back to the front of its queue, as if never started: it was stopped, not broken."""
        job.started_at = job.ended_at = None
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipeline=pipe)
            queue._enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.execute()
        log.warning("job %s stopped by shutdown and re-queued on %s", job.id, queue.name)

    def recover_abandoned(self) -> None:
        """Jobs whose worker stopped heartbeating go back to their queue (if retries are left),
        and jobs put back for later whose time has come too. One command for all queues when
        neither is due, which is nearly always."""
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
        """Per queue: whether a lease lapsed; whether a job put back for later is due. One
        command for every lane of every queue (execution.ANY_DUE)."""
        registries = [
            key
            for queue in self.queues
            for key in (queue.started_job_registry.key, queue.scheduled_job_registry.key)
        ]
        with self._watching_redis():
            found = self._any_due(keys=registries, args=[stamp])
        return list(zip(found[::2], found[1::2], strict=True))

    def clean_queue(self, queue: Queue) -> None:
        """RQ's clean-up of one queue's registries under its lock, released whatever happens
        (RQ leaves it set for 15 minutes on an error); ids that are not job ids are moved aside
        before RQ reads them."""
        if not queue.acquire_maintenance_lock():
            return
        try:
            quarantine.sweep(
                self.connection, queue.key, queue.started_job_registry.key, current_timestamp()
            )
            clean_registries(queue, self._exc_handlers)
            clean_worker_registry(queue)
            queue.intermediate_queue.cleanup(self, queue)  # type: ignore[arg-type]  # KilnWorker
        except REDIS_ERRORS:
            raise
        except Exception:
            log.exception("clean-up of %s failed; carrying on", queue.name)
        finally:
            queue.release_maintenance_lock()

    # -- keys a client retyped, and Redis outages -------------------------------------------

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
