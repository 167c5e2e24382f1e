"""What a worker publishes for clients and operators: each job's record and timing fit
(RecordPublisher), the worker's own state beside RQ's worker hash (publish_state), and the end
of a job, written after its render in one round trip with its last events (after_job). KilnWorker
(worker/queue.py) mixes StatePublisher in; the Pulse thread calls publish_state every
STATE_INTERVAL_S."""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError
from rq import Queue
from rq.job import Job
from rq.utils import now, utcformat

from api_client import keys
from api_client.schema import WorkerState
from worker import device as dev
from worker import events as job_events
from worker import metrics, quarantine
from worker.job import LEASE_LOST
from worker.lease import Outcome
from worker.manifest import publish_manifests
from worker.pulse import REDIS_ERRORS
from worker.render import Renderer
from worker.timings import FitTracker, TimingRecord
from worker.webhooks import Dispatcher, parse_targets

log = logging.getLogger(__name__)
WORKER_STATE_TTL_S = 60
# The worker's published state, RQ's worker hash and the `rq suspend` check are refreshed this
# often (their TTLs are 60 s and more), not around every job.
STATE_INTERVAL_S = 10.0
MEMORY_POLL_S = 1.0  # how often a worker waiting for memory looks again
FIT_INTERVAL_S = 10.0


def announce(
    connection: Redis, renderer: Renderer, models: list[str], queue_names: list[str]
) -> None:
    """What clients and RQ's tools read before a worker's first job: its models' manifests, its
    queues where `rq info` and RQ's Queue.all() find them (kiln's client registers none), and
    its webhook targets' names (never URLs or secrets: a request's webhook is checked
    against them)."""
    publish_manifests(connection, {m: renderer.manifests[m] for m in models})
    connection.sadd(Queue.redis_queues_keys, *[keys.rq_queue_key(n) for n in queue_names])
    targets = sorted(parse_targets(renderer.settings.webhooks))
    if targets:
        connection.sadd(keys.WEBHOOK_TARGETS_KEY, *targets)


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


class StatePublisher:
    """KilnWorker's publishing. The attributes below are KilnWorker's (RQ's SimpleWorker, its
    own __init__ and LeaseKeeper)."""

    connection: Redis
    name: str
    key: str
    worker_ttl: int
    last_heartbeat: Any
    renderer: Renderer
    publisher: RecordPublisher
    served: list[str]
    done_jobs: int
    working_s: float
    blocked: str | None = None  # why no job is taken now (wait_for_memory), published
    webhooks: Dispatcher
    _published_resident: list[str]
    get_state: Callable[[], Any]
    _stop_requested: bool
    should_run_maintenance_tasks: bool
    run_maintenance_tasks: Callable[[], None]
    get_current_job_id: Callable[..., str | None]
    _finish: Callable[[Job, Queue], bool]
    _retyped: Callable[[str | None, Callable[[], Any]], Any]
    repair_keys: Callable[..., list[str]]

    def wait_for_memory(self, burst: bool) -> bool:
        """No job while no served model's measured need fits this worker's memory: it would
        take a job it must fail. The worker says why in its state, in kiln models and in
        kiln_waiting_for_memory, and looks again every MEMORY_POLL_S; False (take nothing)
        for a burst worker or one asked to stop."""
        while (why := self.renderer.cannot_fit()) is not None:
            if self.blocked is None:
                log.warning("%s: %s", self.name, why)
                self.blocked = why
                metrics.WAITING_FOR_MEMORY.set(1)
                self.publish_state()
            self.blocked = why  # the Pulse thread publishes it with the latest figures
            if burst or self._stop_requested:
                return False
            time.sleep(MEMORY_POLL_S)
            if self.should_run_maintenance_tasks:  # sweeps go on: other workers' jobs
                self.run_maintenance_tasks()
        if self.blocked is not None:
            log.info("%s: memory fits again; taking jobs", self.name)
            self.blocked = None
            metrics.WAITING_FOR_MEMORY.set(0)
            self.publish_state()
        return True

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
            blocked=self.blocked,
            ram=self.renderer.cache.ram.model_ids(),
            reading=self.renderer.prefetcher.reading(),
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

    def withdraw_state(self) -> None:
        """At exit: the fits not yet written go out, and clients stop seeing this worker."""
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                self.publisher.flush(pipe, everything=True)
                pipe.delete(keys.worker_key(self.name))
                pipe.zrem(keys.WORKERS_KEY, self.name)
                pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("could not withdraw worker state: %s", exc)
