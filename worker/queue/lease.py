"""The job this worker holds, and its hold on Redis: the lease its claim took
(worker/queue/claim.py), pushed and confirmed, and the finish written only while it holds. The
Redis commands themselves are worker/queue/execution.py's; KilnWorker (worker/queue/worker.py)
owns one LeaseKeeper and calls it from a job's steps 2 and 4, the Pulse thread pushes its lease.
Jobs that lose their worker are the Sweeper's (worker/queue/upkeep/sweep.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Literal

from redis import Redis
from redis.exceptions import ResponseError
from rq import Queue
from rq.executions import Execution
from rq.job import Job
from rq.utils import now

from api_client import keys
from api_client.connection import connect
from api_client.enqueue import QUEUED_TTL_S, running_ttl_s
from worker.errors import StoreUnavailable
from worker.queue import execution
from worker.queue.claim import Claimed
from worker.queue.execution import STREAM_REFRESH_AFTER_S, Finisher
from worker.queue.job import LEASE_LOST, record_error
from worker.queue.upkeep import quarantine
from worker.queue.upkeep.pulse import REDIS_ERRORS, Outages
from worker.queue.upkeep.repair import KeyRepair

log = logging.getLogger(__name__)
Outcome = Literal["finished", "failed", "lost", "retried"]
# A lease pushed less than (its TTL - this) ago cannot have been swept, even by a worker whose
# clock runs this much ahead: no Redis round trip is needed to know it holds.
LEASE_MARGIN_S = 5.0


def worker_connection(url: str) -> Redis:
    """The worker's connection: each command retries for about a minute, riding out a Redis
    restart or a failover (api_client/connection.py, the one place connections come from)."""
    return connect(url, ride_out_restarts=True)


class LeaseKeeper:
    """The running job of one worker and its execution (the lease: its entry in the started
    registry), from the start round trip to the end written while it holds. `execution` is
    RQ's attribute of the same name on KilnWorker (RQ's failure handling reads and clears it).

    The render reads `lost` (the lease found lapsed and taken) at its next step; `cancelled`
    is the worker's, set here when the job's stop key is found."""

    def __init__(
        self,
        connection: Redis,
        worker_name: str,
        ttl_s: int,
        *,
        cancelled: threading.Event,
        outages: Outages,
        repair: KeyRepair,
        store_backoff_s: tuple[float, ...],
    ) -> None:
        self.connection = connection
        self.worker_name = worker_name
        self.ttl_s = ttl_s  # a lease lapses this long after its last push
        self.cancelled = cancelled  # a stop-job command, or the stop key found
        self.lost = threading.Event()  # the running job's lease found lapsed and taken
        self.outages = outages
        self.repair = repair
        # A store outage (S3 5xx, a refused connection) puts the job back for later this many
        # times, after these many seconds, before it fails naming the cause (KILN_STORE_BACKOFF_S).
        self.store_backoff_s = store_backoff_s
        self.running: Job | None = None  # pushed by the Pulse while set
        self.execution: Execution | None = None
        self.lock = threading.Lock()  # running and execution, between the job and the Pulse
        self._finisher = Finisher(connection)
        # Monotonic time until which the running job's lease surely holds (holds).
        self._until = -math.inf
        # RQ's counters in the worker hash (rq info, rq-exporter), written with the state beat.
        self.done_jobs = 0
        self.working_s = 0.0

    def running_id(self) -> str | None:
        with self.lock:
            return self.running.id if self.running is not None else None

    def take(self, job: Job, claimed: Claimed) -> None:
        """The claimed job becomes the running one: its execution is the lease the claim script
        entered (worker/queue/claim.py), which holds until TTL after the script was sent; from
        here the Pulse pushes it, and reads its stop key with each push.

        The job's hash and event stream keep the lifetime kiln's submit gave them (QUEUED_TTL_S),
        which outlasts any run, unless the job waited over STREAM_REFRESH_AFTER_S for a worker
        or its producer gave it a shorter `ttl` (RQ's "discard if not started in time"): then
        both are renewed (one round trip), so neither can expire under its run."""
        self.execution = Execution(claimed.execution_id, job.id, self.connection, self.worker_name)
        self._until = claimed.claimed_at + self.ttl_s
        self.cancelled.clear()
        self.lost.clear()
        with self.lock:  # from here a stop-job command for it is taken
            self.running = job
        waited = (now() - job.enqueued_at).total_seconds() if job.enqueued_at else 0.0
        short_lived = job.ttl is not None and 0 <= job.ttl < QUEUED_TTL_S
        if waited > STREAM_REFRESH_AFTER_S or short_lived:
            with self.connection.pipeline(transaction=False) as pipe:
                for key in (job.key, keys.events_key(job.id)):
                    pipe.expire(key, running_ttl_s(job.timeout))
                pipe.execute()

    def retry_later(
        self,
        job: Job,
        queue: Queue,
        exc: StoreUnavailable,
        cleanup: Callable[..., None],
    ) -> bool:
        """A store outage that may heal: the job goes back for later, after store_backoff_s[n]
        seconds for its n-th time (the sweep moves it to the front of its queue then); False
        once it has had them all, and it fails naming the cause. cleanup: the worker's
        cleanup_execution, on the same pipeline."""
        tries = int(job.meta.get("store_retries") or 0)
        if tries >= len(self.store_backoff_s):
            message = f"the store stayed unavailable through {tries} retries: {exc.cause}"
            record_error(job, "StoreUnavailable", message)
            return False
        delay = self.store_backoff_s[tries]
        job.meta["store_retries"] = tries + 1
        with self.connection.pipeline() as pipe:
            cleanup(job, pipeline=pipe)
            # Saves the job whole (its meta with the count too), status scheduled.
            queue.schedule_job(job, now() + timedelta(seconds=delay), pipeline=pipe)
            pipe.execute()
        log.warning(
            "job %s: the store is unavailable (%s); retry %d of %d in %d s",
            job.id,
            exc.cause,
            tries + 1,
            len(self.store_backoff_s),
            delay,
        )
        return True

    def holds(self) -> bool:
        """Whether the running execution still holds its job. No command while its last push
        landed recently enough that no sweep can have taken it (LEASE_MARGIN_S before it
        lapses, for clocks that differ between hosts); else one, which pushes it again."""
        job, held = self.running, self.execution
        if job is None or held is None:
            return True
        if time.monotonic() < self._until - LEASE_MARGIN_S:
            return True
        sent_at = time.monotonic()
        if not execution.holds(self.connection, job, held, self.ttl_s):
            return False
        self._until = sent_at + self.ttl_s
        return True

    def push(self, look_for_stop: bool = True) -> bool:
        """One round trip: push the running job's entry in the started registry past the next
        beat and, with look_for_stop, read its stop key (a cancel normally arrives at once as
        RQ's stop-job command; this catches one sent while the pub/sub connection was down).
        True when Redis took it (or nothing is running)."""
        with self.lock:
            job, held = self.running, self.execution
            if job is None or held is None:
                return True
            try:
                sent_at = time.monotonic()
                with self.outages.watching(), self.connection.pipeline(transaction=False) as pipe:
                    execution.push_lease(pipe, job, held, self.ttl_s)
                    if look_for_stop:
                        pipe.exists(keys.stop_key(job.id))
                    pushed, *stop_asked = pipe.execute()
                if pushed:
                    self._until = sent_at + self.ttl_s
            except ResponseError as exc:
                if not quarantine.wrong_type(exc) or not self.repair.repair(job.id):
                    raise
                # The registry a client retyped is gone with every lease in it: take ours again.
                self.connection.zadd(
                    job.started_job_registry.key,
                    {held.composite_key: execution.lease_score(self.ttl_s)},
                )
                return True
            if not pushed and not self.lost.is_set():
                log.warning("job %s: %s", job.id, LEASE_LOST)
                self.lost.set()  # the render stops at its next step or phase
            if any(stop_asked):
                self.cancelled.set()
        return True

    def stop_beating(self) -> None:
        """The job is over: the Pulse pushes its lease no more (its execution stays, to finish)."""
        with self.lock:
            self.running = None

    def commit(self, job: Job, queue: Queue, result_ttl: int | None) -> Outcome | None:
        """A done job's success as RQ's worker writes it: "finished", or "lost" when the lease
        no longer held and nothing was written. None when its end could not be written (Redis
        away past the connection's retries, a key retyped again): nothing more is said of the
        job, which is re-run once its lease lapses and answered from the store."""
        try:
            if self.finish(job, queue, result_ttl):
                return "finished"
        except REDIS_ERRORS as exc:
            log.warning("could not record the end of job %s: %s", job.id, exc)
            return None
        except ResponseError as exc:
            if not quarantine.wrong_type(exc):
                raise
            log.warning("job %s: its last events were not written: %s", job.id, exc)
            self.repair.repair(job.id)
            return None
        log.warning("job %s: %s", job.id, LEASE_LOST)
        return "lost"

    def finish(self, job: Job, queue: Queue, result_ttl: int | None) -> bool:
        """A success as RQ's readers see it (worker/queue/execution.py), written only while this
        execution holds the job; then the jobs that depend on it are enqueued, as RQ does.
        False: the lease was lost and nothing was written."""
        held = self.execution
        assert held is not None
        dependents = self.repair.call(
            job.id,
            lambda: self._finisher(
                job,
                queue,
                held,
                self.worker_name,
                result_ttl,
                held.created_at,
                job.ended_at or now(),
                self.ttl_s,
            ),
        )
        if dependents is None:
            return False
        # RQ's worker counters, written with the state beat.
        self.done_jobs += 1
        self.working_s += max(((job.ended_at or now()) - held.created_at).total_seconds(), 0.0)
        if dependents:
            queue.enqueue_dependents(job)
        return True
