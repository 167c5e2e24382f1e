"""The RQ side of kiln: a worker that never forks and keeps its pipelines resident.

RQ's data stays RQ's (job hash, queues, registries, results stream), so RQ's readers see kiln's
jobs as any RQ job; RQ's own perform path, about 40 commands in six round trips a job, is
replaced by execute_job's steps (worker/queue/execution.py; bench/RESULTS.md).

Where RQ calls in, in its order (the hooks KilnWorker overrides, marked *):

- *work starts the Pulse thread beside RQ's loop (the lease pushed every 3 s, the sweep every
  5 s, the state published every 10 s); *register_birth publishes the state at once.
- Each turn of the loop: *check_for_suspension (nothing: the claim reads `rq suspend`),
  *run_maintenance_tasks and *clean_registries (not right after an outage), *heartbeat (the safe
  point to stop), *dequeue_job_and_maintain_ttl (the memory gate, then the claim script, which
  takes the job off its queue and under this worker's lease at once, worker/queue/claim.py; a
  record kiln cannot read is quarantined), *reorder_queues after the claim, then *execute_job:
  the job's five steps, with *handle_exception and *handle_job_failure when its render raised
  (its *cleanup_execution puts a failed or stopped job's webhook delivery in the end's commit).
  *set_state and *get_heartbeat_ttl keep RQ's per-job writes away.
- RQ's pub/sub thread: *get_current_job_id, *handle_payload and *kill_horse take only a stop-job
  for the running job.
- Signals: *request_stop finishes the job and exits (idle: at once, Redis or not); a second,
  *request_force_stop, stops it at its next step and re-queues it. *teardown at exit.

Over 400 lines because each RQ hook KilnWorker overrides stays beside the job's steps it runs
around, in RQ's order of calls (tests/test_rq_contract.py holds each to rq's signature).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
import traceback
import uuid
from datetime import datetime, timezone
from functools import partial
from types import FrameType
from typing import Any

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job
from rq.registry import clean_registries
from rq.serializers import JSONSerializer
from rq.utils import current_timestamp, now
from rq.worker import WorkerStatus
from rq.worker_registration import clean_worker_registry

from api_client import keys
from api_client.errors import short
from worker.crashes import crash_point
from worker.errors import (
    FatalWorkerError,
    JobDeadlineExceeded,
    JobStopped,
    LeaseLost,
    ShutdownStop,
    StoreUnavailable,
)
from worker.queue.claim import Claimed, Claimer
from worker.queue.job import LEASE_LOST, RenderJob, RQJobContext, TimeoutPenalty, record_error
from worker.queue.lanes import LaneOrder
from worker.queue.lease import LeaseKeeper, Outcome
from worker.queue.memory_gate import MemoryGate
from worker.queue.upkeep import quarantine
from worker.queue.upkeep.publisher import (
    STATE_INTERVAL_S,
    RecordPublisher,
    Snapshot,
    StatePublisher,
    state_name,
)
from worker.queue.upkeep.pulse import REDIS_ERRORS, Beats, Outages, Pulse, watch_connection
from worker.queue.upkeep.repair import KeyRepair
from worker.queue.upkeep.sweep import Sweeper
from worker.queue.upkeep.webhooks import Dispatcher, queue_failure_delivery
from worker.render.renderer import Renderer

log = logging.getLogger(__name__)
# The pub/sub listener's read timeout. rq unsubscribes, then stops the thread, which redis-py 8
# joins: a thread that read the unsubscribe's answer first waits out one more read (at rq's 60 s,
# burst workers in CI returned a minute late).
LISTEN_S = 0.5


class KilnWorker(SimpleWorker):
    """One process per device; the pipeline stays resident across jobs (no fork per job).

    Handed its queues, their lane order, the renderer, the renderer's record publisher and the
    webhook dispatcher (worker/serve.py builds them); it owns the job it holds (LeaseKeeper),
    the sweep for jobs others dropped (Sweeper), the memory gate before each pop (MemoryGate)
    and what it publishes (StatePublisher)."""

    job_class = RenderJob
    death_penalty_class = TimeoutPenalty
    state_interval_s = STATE_INTERVAL_S
    # Reconnect quickly after a Redis restart instead of RQ's backoff up to a minute.
    max_connection_wait_time = 5.0

    def __init__(
        self,
        queues: list[Queue],
        *,
        connection: Redis,
        name: str,
        renderer: Renderer,
        lanes: LaneOrder,
        records: RecordPublisher,
        webhooks: Dispatcher,
        job_timeout_s: int | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("serializer", JSONSerializer)
        kwargs.setdefault("job_class", RenderJob)
        # worker_ttl 20 makes RQ's blocking dequeue wake every 5 s, so an idle worker notices a
        # shutdown request promptly without the signal handler interrupting a dequeue half done.
        kwargs.setdefault("worker_ttl", 20)
        timing = renderer.settings  # KILN_LEASE_S, KILN_HEARTBEAT_S, KILN_SWEEP_S
        self.heartbeat_ttl_s, self.heartbeat_interval_s = timing.lease_s, timing.heartbeat_s
        self.sweep_interval_s = timing.sweep_s
        self.cancelled = threading.Event()  # a stop-job command, or the job's stop key found
        # Set by a second SIGTERM/SIGINT: the running job stops at its next step and is re-queued.
        self.shutdown_now = threading.Event()
        self.repair = KeyRepair(
            connection, [q.name for q in queues], self.redis_worker_namespace_prefix + name
        )
        self.outages = Outages(
            watch_connection(connection), self.heartbeat_ttl_s, self.heartbeat_interval_s
        )
        # Before RQ's own set-up, which sets `execution`: the lease keeper holds it.
        self.lease = LeaseKeeper(
            connection,
            name,
            self.heartbeat_ttl_s,
            cancelled=self.cancelled,
            outages=self.outages,
            repair=self.repair,
            store_backoff_s=timing.store_backoff_s,
        )
        super().__init__(queues, connection=connection, name=name, **kwargs)
        self.renderer = renderer
        self.lanes = lanes
        self._ordered_queues = lanes.order()
        self.webhooks = webhooks
        self.job_timeout_s = job_timeout_s
        self.sweeper = Sweeper(
            connection,
            self.queues,
            self.serializer,
            self.outages,
            self.repair,
            finish_ended=lambda job_id: self.publisher.publish_orphaned_end(job_id),
        )
        self.memory = MemoryGate(name, renderer.cannot_fit)
        served = list(dict.fromkeys(keys.model_of(q.name) for q in self.queues))
        self.publisher = StatePublisher(
            connection,
            name,
            self.key,
            self.worker_ttl,
            served,
            renderer,
            records,
            webhooks,
            self.repair,
        )
        self.claimer = Claimer(connection, name, self.heartbeat_ttl_s)
        self._claimed: Claimed | None = None  # claimed, not yet started
        self.fatal: FatalWorkerError | None = None  # why this worker must exit non-zero
        self._last_exception: BaseException | None = None
        self._holding_job = False

    @property
    def execution(self) -> Execution | None:
        """RQ's attribute, read and cleared by its failure handling: the lease keeper's."""
        return self.lease.execution

    @execution.setter
    def execution(self, held: Execution | None) -> None:
        self.lease.execution = held

    # -- the work loop --------------------------------------------------------------------------

    def work(self, burst: bool = False, **kwargs: Any) -> bool:  # type: ignore[override]
        self.shutdown_now.clear()
        beats = Beats(self.heartbeat_interval_s, self.sweep_interval_s, self.state_interval_s)
        pulse = Pulse(
            self.name,
            self.outages.watch,
            beats,
            push_lease=self.lease.push,
            publish_state=self.publish_state,
            sweep=self.sweep,
        )
        pulse.start()
        self.webhooks.start()  # its senders deliver from the outbox in Redis, any worker's writes
        try:
            return bool(super().work(burst=burst, **kwargs))
        finally:
            pulse.stop()
            self.webhooks.close()

    def register_birth(self) -> None:
        super().register_birth()  # type: ignore[no-untyped-call]
        self.publish_state()  # clients see the worker before its first heartbeat

    @property
    def stopping(self) -> bool:
        """A shutdown signal was received (the loop ends after the current job)."""
        return bool(self._stop_requested)

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        """In place of RQ's BLPOP and later start: the memory gate, then the claim script
        (worker/queue/claim.py), which takes the job off its queue and under this worker's
        lease at once; between claims, a wait on the served models' event streams. None in
        burst when nothing is queued, or once max_idle_time passes idle."""
        self._holding_job = False
        if not self.memory.wait(
            burst=timeout is None,  # rq passes no timeout in burst
            stopping=lambda: self.stopping,
            changed=self.publish_state,
            meanwhile=self._maintain_if_due,
        ):
            return None
        self.set_state(WorkerStatus.IDLE)
        idle_since = time.monotonic()
        backoff_s = 1.0
        while True:
            self.heartbeat()  # the safe point to stop: no job is held
            self._maintain_if_due()
            try:
                found: tuple[Job, Queue] | None = self.repair.call(None, self._claim)
                if found is not None:
                    return found
                if timeout is None:
                    return None
                if max_idle_time is not None and time.monotonic() - idle_since > max_idle_time:
                    return None
                self.repair.call(None, self.claimer.wait)
                backoff_s = 1.0
            except RedisConnectionError as exc:  # the watch logs the outage once (redis_lost)
                self.outages.watch.failed(exc)
                time.sleep(0 if self.outages.watch.leaving.is_set() else backoff_s)
                backoff_s = min(backoff_s * 2, self.max_connection_wait_time)

    def _claim(self) -> tuple[Job, Queue] | None:
        """One claim: the job, read, and the queue it came from; None when none was queued
        (or the fleet is suspended: the state says so). A record rq cannot read is moved
        aside, its lease with it, and the next one claimed."""
        while True:
            claimed = self.claimer.claim(
                self._ordered_queues, uuid.uuid4().hex, sent_at=time.monotonic()
            )
            self._note_suspension(self.claimer.suspended)
            if claimed is None:
                return None
            self._holding_job = True  # from here the job must run or go back (its lease)
            crash_point("claim")
            job = self.claimer.read(claimed, self.job_class, self.serializer, self.repair)
            if job is None:  # unreadable (quarantined) or gone: its lease is taken out
                self._holding_job = False
                continue
            self._claimed = claimed
            self.reorder_queues(claimed.queue)
            log.info("%s: %s", claimed.queue.name, job.id)
            return job, claimed.queue

    def _note_suspension(self, suspended: bool) -> None:
        """`rq suspend` found by the claim: the state says suspended until `rq resume`."""
        if suspended != (self._state == WorkerStatus.SUSPENDED):
            log.info("suspended (rq suspend)" if suspended else "resumed (rq resume)")
            self.set_state(WorkerStatus.SUSPENDED if suspended else WorkerStatus.IDLE)
            self.publish_state()

    def reorder_queues(self, reference_queue: Queue) -> None:
        # kiln's lane order (worker/queue/lanes.py) in place of RQ's dequeue strategies.
        self._ordered_queues = self.lanes.after(reference_queue)

    # -- one job ----------------------------------------------------------------------------------

    def execute_job(self, job: Job, queue: Queue) -> None:
        """A job's life, in place of RQ's prepare_execution / perform_job / handle_job_success:
        its start is one round trip, and a success is written with its end events in the round
        trip after it."""
        # 1. Only a RenderJob, and within KILN_JOB_TIMEOUT_S whatever its producer asked.
        claimed = self.checked(job)
        # 2. Start: the lease the claim took becomes the running job's (the Pulse pushes it from
        # here, reading its stop key each time).
        self.start(claimed, queue)
        outcome: Outcome | None = "failed"
        ctx = None
        try:
            # 3. Perform: the render under the job's deadline. A failure ends here as RQ ends
            # one, or puts the job back; a done job's record waits for step 5.
            ctx = self.job_context(claimed)
            outcome = self.perform(claimed, queue, ctx)
        finally:
            # 4. Finish: the lease is pushed no more; a success is committed while it holds.
            outcome = self.finish(claimed, queue, outcome)
            if outcome == "finished":
                crash_point("finish")
            # 5. Publish: the record, the fit, the state, the last events, the webhook.
            record = ctx.done_record if ctx else None
            lease = self.execution.composite_key if self.execution else None
            self.publisher.end_job(claimed, outcome, record, now=self._snapshot, lease=lease)
            self.execution = None  # idle again
            self._state = WorkerStatus.IDLE

    def checked(self, job: Job) -> RenderJob:
        if not isinstance(job, RenderJob):  # its queues are made with job_class=RenderJob
            raise TypeError(f"job {job.id} is a {type(job).__name__}, not a RenderJob")
        if self.job_timeout_s is not None and not 0 < (job.timeout or 0) <= self.job_timeout_s:
            job.timeout = self.job_timeout_s
        return job

    def start(self, job: RenderJob, queue: Queue) -> None:
        """Busy, and the claimed job is this worker's running one (LeaseKeeper.take: the Pulse
        pushes its lease from here)."""
        self._state = WorkerStatus.BUSY
        self.outages.watch.leaving.clear()  # claimed as a stop came: the job rides out outages
        claimed, self._claimed = self._claimed, None
        if claimed is None or claimed.job_id != job.id:
            raise RuntimeError(f"job {job.id} was not claimed by this worker")
        self.lease.take(job, claimed)
        crash_point("start")

    def job_context(self, job: RenderJob) -> RQJobContext:
        return RQJobContext(
            job,
            self.shutdown_now,
            self.cancelled,
            self.renderer.store,
            lease_lost=self.lease.lost,
            holds_lease=self.lease.holds,
        )

    def perform(self, job: RenderJob, queue: Queue, ctx: RQJobContext) -> Outcome:
        """The render under the job's deadline: "finished"; "failed" when it raised (RQ's
        failure handling has then run); "retried" when a store outage put it back for later;
        "lost" when the job is no longer this worker's (nothing about it is written here)."""
        job.run = partial(self.render_job, ctx)
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
            if isinstance(exc_info[1], LeaseLost) or not self.lease.holds():
                log.warning("job %s: %s", job.id, LEASE_LOST)
                return "lost"
            failure = exc_info[1]
            if isinstance(failure, StoreUnavailable) and self.lease.retry_later(
                job, queue, failure, self.cleanup_execution
            ):
                return "retried"
            self.handle_exception(job, *exc_info)
            exc_string = "".join(traceback.format_exception(*exc_info))
            self.handle_job_failure(job, queue, exc_string=exc_string)
            return "failed"
        job.ended_at = now()
        return "finished"

    def render_job(self, ctx: RQJobContext) -> dict[str, Any]:
        """RQ's call into kiln (RenderJob.run). The reason for a failure goes into the job's
        meta."""
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

    def finish(self, job: RenderJob, queue: Queue, outcome: Outcome | None) -> Outcome | None:
        """The Pulse stops pushing the lease; a success is written as RQ's worker writes it,
        only while the lease holds (LeaseKeeper.commit: "lost" when it no longer did, None when
        its end could not be written)."""
        self.lease.stop_beating()
        if outcome != "finished":
            return outcome
        return self.lease.commit(job, queue, job.get_result_ttl(self.default_result_ttl))

    # -- a job that raised ----------------------------------------------------------------------

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        self._last_exception = exc_info[1] if len(exc_info) > 1 else None
        if isinstance(self._last_exception, JobStopped):
            # A cancel or a shutdown honoured as asked: a line at info, not RQ's error traceback.
            log.info("job %s stopped: %s", job.id, self._last_exception)
            return
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

    def cleanup_execution(self, job: Job, pipeline: Any) -> None:
        """RQ's, on the pipeline that commits a job's end (handle_job_failure's MULTI; also the
        retry_later and _requeue ones, which end nothing): a failed or stopped job's webhook
        delivery joins that commit."""
        super().cleanup_execution(job, pipeline=pipeline)
        queue_failure_delivery(pipeline, job)

    def _requeue(self, job: Job, queue: Queue) -> None:
        """Back to the front of its queue, as if never started: it was stopped, not broken."""
        job.started_at = job.ended_at = None
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipeline=pipe)
            queue._enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.execute()
        log.warning("job %s stopped by shutdown and re-queued on %s", job.id, queue.name)

    # -- the Pulse thread, RQ's pub/sub thread, and maintenance ---------------------------------

    def publish_state(self) -> None:
        """The worker's state for clients, RQ's worker hash and the timing fits not yet
        written: every STATE_INTERVAL_S from the Pulse thread, and as it waits for memory."""
        self.publisher.publish(self._snapshot())

    def _snapshot(self) -> Snapshot:
        self.last_heartbeat = now()
        return Snapshot(
            state=state_name(self.get_state()),
            running=self.get_current_job_id(),
            jobs_done=self.lease.done_jobs,
            working_s=self.lease.working_s,
            blocked=self.memory.blocked,
            heartbeat=self.last_heartbeat,
        )

    def sweep(self) -> None:
        """The Pulse's sweep for jobs that lost their worker; then the webhook senders look in
        the outbox at once, where the abandoned jobs it failed have their deliveries."""
        self.sweeper.sweep()
        self.webhooks.wake()

    def get_current_job_id(self, pipeline: Any = None) -> str | None:
        # RQ reads this from its worker hash, which kiln does not write per job.
        return self.lease.running_id()

    def subscribe(self) -> None:
        """rq's listener on this worker's channel, reading LISTEN_S at a time, not rq's 60 s."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        errors = self.outages.watch.quiet_pubsub(self._pubsub_exception_handler)
        self.pubsub_thread = self.pubsub.run_in_thread(  # type: ignore[assignment]
            sleep_time=LISTEN_S, daemon=True, exception_handler=errors
        )

    def handle_payload(self, message: Any) -> None:
        """A message on this worker's RQ pub/sub channel. Clients may publish there to cancel,
        so the only command taken is a stop-job for the running job (job.cancel(), or rq's
        send_stop_job_command): the render stops at its next step or phase. RQ's shutdown and
        kill-horse, anything unknown, and anything that is not a JSON command are logged and
        ignored; nothing a client sends ends the listener."""
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
        """Never called by a command (handle_payload takes none): the render stops through this."""
        self.cancelled.set()

    def get_heartbeat_ttl(self, job: Job) -> int:
        return self.heartbeat_ttl_s

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's, around every dequeue: here it stops the loop when asked to (the Pulse beats)."""
        if self._stop_requested and not self._holding_job:
            # RQ's dequeue loop heartbeats before each blocking pop: the safe point to stop.
            self.outages.watch.leaving.set()  # RQ's teardown next: no minute of retries
            raise StopRequested()

    def check_for_suspension(self, burst: bool) -> None:
        # `rq suspend` is read by the claim script (worker/queue/claim.py) from the instant set.
        return None

    def set_state(self, state: str, pipeline: Any = None) -> None:
        # Busy/idle change twice a job; they reach Redis with the next publish_state.
        self._state = state

    def run_maintenance_tasks(self) -> None:
        # rq quits its work loop on any error here; a bad record must cost a log line, not a worker.
        try:
            super().run_maintenance_tasks()  # type: ignore[no-untyped-call]
        except REDIS_ERRORS:
            raise
        except Exception:
            log.exception("maintenance failed; carrying on")
            self.last_cleaned_at = now()  # type: ignore[assignment]

    def _maintain_if_due(self) -> None:
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()

    def clean_registries(self) -> None:
        """rq's clean-up, with its lock released whatever happens (rq leaves it set for 15
        minutes on an error) and ids that are not job ids moved aside before rq reads them.
        Not right after an outage (Outages.unsettled): rq would fail every running job."""
        if self.outages.unsettled():
            return
        for queue in self.queues:
            self._clean_queue(queue)
        self.last_cleaned_at = now()  # type: ignore[assignment]

    def _clean_queue(self, queue: Queue) -> None:
        if not queue.acquire_maintenance_lock():
            return
        try:
            stamp = current_timestamp()
            quarantine.sweep(self.connection, queue.key, queue.started_job_registry.key, stamp)
            # Before RQ's clean-up, which would take any lapsed entry for a dead worker's job.
            self.sweeper.drop_what_is_not_a_lease(queue.started_job_registry.key, stamp)
            clean_registries(queue, self._exc_handlers)
            clean_worker_registry(queue)
            queue.intermediate_queue.cleanup(self, queue)
        except REDIS_ERRORS:
            raise
        except Exception:
            log.exception("clean-up of %s failed; carrying on", queue.name)
        finally:
            queue.release_maintenance_lock()

    # -- shutdown ---------------------------------------------------------------------------------

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        """First SIGTERM/SIGINT: finish the current job (if any), then exit; idle, at once.

        Unlike RQ, never raise from the handler: an exception landing between a dequeue and the
        job's registration would drop the job on the floor. The loop stops at its next heartbeat.
        """
        # Re-arm first: a second signal that lands while this one is still being handled (or
        # logged) must already mean "now".
        signal.signal(signal.SIGINT, self.request_force_stop)
        signal.signal(signal.SIGTERM, self.request_force_stop)
        self._shutdown_requested_date = datetime.now(timezone.utc)
        self._stop_requested = True
        if not self._holding_job:  # Redis is waited on no more (RedisWatch.leaving)
            self.outages.watch.leaving.set()
        doing = "finishing the current job" if self._holding_job else "no job running, stopping"
        log.warning("warm shutdown requested (signal %s): %s", signum, doing)

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        """Second signal: stop the running job at its next step and put it back on its queue."""
        log.warning("shutdown now requested (signal %s): stopping the job at its next step", signum)
        self.shutdown_now.set()
        self._stop_requested = True

    def teardown(self) -> None:
        try:
            super().teardown()  # type: ignore[no-untyped-call]
        except REDIS_ERRORS as exc:
            log.warning("could not withdraw worker state: %s", exc)
            return
        self.publisher.withdraw()
