"""What a worker publishes for clients and operators: each job's record and timing fit
(RecordPublisher, the renderer's record listener), and the worker's own state beside RQ's worker
hash (StatePublisher: every STATE_INTERVAL_S from the Pulse thread, and with the end of each job,
written after its render in one round trip with its last events)."""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError
from rq import Queue
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from api_client import keys
from api_client.errors import short
from api_client.schema import JobEvent, RenderResult, WorkerState
from worker.manifest import publish_manifests
from worker.memory import device as dev
from worker.pipelines.switches import switch
from worker.queue import events as job_events
from worker.queue.job import LEASE_LOST
from worker.queue.lease import Outcome
from worker.queue.upkeep import metrics, quarantine
from worker.queue.upkeep.pulse import REDIS_ERRORS
from worker.queue.upkeep.repair import KeyRepair
from worker.queue.upkeep.webhooks import Dispatcher
from worker.render.renderer import Renderer
from worker.render.timings import FitTracker, TimingRecord

log = logging.getLogger(__name__)
WORKER_STATE_TTL_S = 60
# The worker's published state, RQ's worker hash and the `rq suspend` check are refreshed this
# often (their TTLs are 60 s and more), not around every job.
STATE_INTERVAL_S = 10.0
FIT_INTERVAL_S = 10.0


def announce(
    connection: Redis, renderer: Renderer, models: list[str], queue_names: list[str]
) -> None:
    """What clients and RQ's tools read before a worker's first job: its models' manifests, its
    queues where `rq info` and RQ's Queue.all() find them (kiln's client registers none), and
    its webhook targets' names (never URLs or secrets: a request's webhook is checked
    against them), and where its store is (a client refuses an input outside every store)."""
    publish_manifests(connection, {m: renderer.manifests[m] for m in models})
    connection.sadd(Queue.redis_queues_keys, *[keys.rq_queue_key(n) for n in queue_names])
    connection.sadd(keys.STORES_KEY, renderer.settings.published_store)
    targets = sorted(renderer.webhook_targets)
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


@dataclass(frozen=True)
class Snapshot:
    """The worker's own figures at one beat, beside what its renderer holds."""

    state: str  # RQ's worker state (busy, idle, suspended): state_name's
    running: str | None  # the id of the job it runs
    jobs_done: int  # RQ's successful_job_count
    working_s: float  # RQ's total_working_time
    blocked: str | None  # why it takes no job now (worker/queue/memory_gate.py)
    heartbeat: datetime  # RQ's last_heartbeat


def state_name(state: object) -> str:
    """RQ's worker state as its value (busy, idle, suspended): str() of its enum would publish
    "WorkerStatus.BUSY" to every reader of kiln:worker:<name>."""
    return str(getattr(state, "value", state))


class StatePublisher:
    """One worker's state for clients (models, resident, busy or idle; kiln models, kiln top),
    RQ's worker hash heartbeat and the timing fits not yet written; and the round trip that ends
    each job."""

    def __init__(
        self,
        connection: Redis,
        name: str,
        rq_key: str,
        rq_ttl_s: int,
        served: list[str],
        renderer: Renderer,
        records: RecordPublisher,
        webhooks: Dispatcher,
        repair: KeyRepair,
    ) -> None:
        self.connection = connection
        self.name = name
        self.rq_key = rq_key  # RQ's worker hash
        self.rq_ttl_s = rq_ttl_s  # RQ's worker_ttl
        self.served = served
        self.renderer = renderer
        self.records = records
        self.webhooks = webhooks
        self.repair = repair
        self._published_resident: list[str] = []
        # The gateway refuses a tenant's step_cache: true for a model no serving worker allows it.
        self.step_cache_off = [
            model
            for model in served
            if model in renderer.manifests
            and switch(renderer.manifests[model], renderer.settings, "step_cache") == "off"
        ]

    def publish(self, now: Snapshot, conn: Any = None, sweep: bool = True) -> None:
        """The state as of now, queued on conn or sent in one round trip. sweep also drops the
        names of long-silent workers."""
        pipe = conn if conn is not None else self.connection.pipeline(transaction=False)
        moment = time.time()
        renderer = self.renderer
        resident = renderer.cache.model_ids()
        state = WorkerState(
            name=self.name,
            models=self.served,
            resident=resident,
            device=renderer.info.torch_device,
            device_name=renderer.info.name,
            state=now.state,
            heartbeat=moment,
            pid=os.getpid(),
            host=socket.gethostname(),
            profile=renderer.info.simulated,
            rungs=renderer.cache.rungs(),
            running=now.running,
            jobs_done=now.jobs_done,
            free_bytes=dev.free_bytes(renderer.info),
            blocked=now.blocked,
            ram=renderer.cache.ram.model_ids(),
            reading=renderer.prefetcher.reading(),
            step_cache_off=self.step_cache_off,
        )
        pipe.set(keys.worker_key(self.name), state.model_dump_json(), ex=WORKER_STATE_TTL_S)
        pipe.zadd(keys.WORKERS_KEY, {self.name: moment})
        if sweep:  # workers killed without a goodbye leave their name behind
            pipe.zremrangebyscore(keys.WORKERS_KEY, 0, moment - WORKER_STATE_TTL_S)
        pipe.hset(
            self.rq_key,
            mapping={
                "last_heartbeat": utcformat(now.heartbeat),
                "state": state.state,
                "successful_job_count": now.jobs_done,
                "total_working_time": now.working_s,
                **({"current_job": now.running} if now.running else {}),
            },
        )
        if not now.running:
            pipe.hdel(self.rq_key, "current_job")
        pipe.expire(self.rq_key, self.rq_ttl_s + 60)
        self.records.flush(pipe, everything=True)
        self._published_resident = resident
        if conn is None:
            self.repair.call(None, pipe.execute)

    def end_job(
        self,
        job: Job,
        outcome: Outcome | None,
        record: TimingRecord | None,
        now: Callable[[], Snapshot],
        lease: str | None = None,
    ) -> None:
        """What a job's end publishes, once its end is committed (outcome None: it could not
        be, and nothing more is said): one round trip with the model's timing fit, the worker's
        state if what is resident changed (now() gives its figures), the job's last events (the
        end one wakes the client) and, for a finished job, its lease taken out; then a done
        job's one record; then its webhook's sender is woken (the delivery was committed with
        the end, worker/queue/upkeep/webhooks.py). A job whose lease was lost records itself as
        stopped and leaves its events to the worker that holds it now.

        A finished job's lease stays in the started registry from the commit until that round
        trip. If the worker dies before it, or the round trip fails (Redis away past the
        connection's retries), the lease lapses and the sweep publishes the record and events
        (publish_orphaned_end); so the record is written here only once the lease is out (its
        timing fit is observed before, to go out in the round trip), one record either way."""
        renderer = self.renderer
        metrics.observe_resident(renderer.cache.rungs(), dev.allocated_bytes(renderer.info))
        if outcome is None:
            return
        finished = outcome == "finished"
        if record is not None and finished:
            renderer.observe(record)  # its timing fit goes out in the round trip
        end, sent = self._end_round_trip(
            job, written=outcome != "lost", now=now, lease=lease if finished else None
        )
        if record is not None and finished and sent:
            renderer.publish(record, observed=True)
        if record is not None and outcome == "lost":
            record.status, record.error = "stopped", f"job {job.id}: {LEASE_LOST}"
            renderer.publish(record)
        if end is not None and end[1] is not None:
            self.webhooks.wake(end[1])  # its delivery was committed with its end

    def publish_orphaned_end(self, job_id: str) -> None:
        """What end_job publishes after a commit, for a job whose worker died between the two
        (the sweep found its lease lapsed on a finished job and took it out): the record of
        its render, from the committed result, and its last events."""
        try:
            job = Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
            latest = Result.fetch_latest(job, serializer=JSONSerializer)
            result = RenderResult.model_validate(latest.return_value if latest else None)
        except Exception as exc:
            log.warning("job %s: its end cannot be published: %s", job_id, short(str(exc)))
            return
        self.renderer.publish(TimingRecord.recovered(result))
        self._end_round_trip(job, written=True, now=None)

    def _end_round_trip(
        self,
        job: Job,
        written: bool,
        now: Callable[[], Snapshot] | None,
        lease: str | None = None,
    ) -> tuple[tuple[JobEvent, str | None] | None, bool]:
        """The end event and its webhook target, and whether the round trip was sent; with
        written False (another worker writes this job's end) its events are dropped. lease: a
        finished job's lease, taken out with them."""
        end, sent = None, False
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                self.records.flush(pipe)
                if now is not None and self.renderer.cache.model_ids() != self._published_resident:
                    self.publish(now(), pipe, sweep=False)
                end = self._end_events(job, pipe if written else None)
                if lease is not None:
                    pipe.zrem(job.started_job_registry.key, lease)
                pipe.execute()
                sent = True
        except REDIS_ERRORS as exc:
            # The lease stays and lapses: the sweep publishes a committed end (its record and
            # events); one not committed is re-run and answered from the store.
            log.warning("could not record the end of job %s: %s", job.id, exc)
        except ResponseError as exc:
            # A key retyped by a client: moved aside, the job's last events are lost (its status
            # is written), and the next job finds its keys in order.
            if not quarantine.wrong_type(exc):
                raise
            log.warning("job %s: its last events were not written: %s", job.id, exc)
            self.repair.repair(job.id)
            sent = True  # a pipeline without MULTI ran its other commands, the lease's too
        return end, sent

    def _end_events(self, job: Job, pipe: Any) -> tuple[JobEvent, str | None] | None:
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

    def withdraw(self) -> None:
        """At exit: the fits not yet written go out, and clients stop seeing this worker."""
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                self.records.flush(pipe, everything=True)
                pipe.delete(keys.worker_key(self.name))
                pipe.zrem(keys.WORKERS_KEY, self.name)
                pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("could not withdraw worker state: %s", exc)
