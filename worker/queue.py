"""The RQ side of kiln: a worker that never forks and keeps its pipelines resident.

The life of one job, in the order RQ calls into KilnWorker (hooks marked *) and what kiln does.
RQ's data stays RQ's (job hash, queues, registries, results stream), so RQ's readers see kiln's
jobs as any RQ job; RQ's own perform path, about 40 commands in six round trips a job, is
replaced by steps 3 and 7 (worker/execution.py; bench/RESULTS.md). The round trips of the job a
worker holds are LeaseKeeper's (worker/lease.py); what it publishes is StatePublisher's
(worker/publisher.py).

1. work() starts the Pulse thread (worker/pulse.py) and RQ's loop over both lanes of every model
   it serves. *dequeue_job_and_maintain_ttl pops a job id from the first queue in the lane
   order that holds one (one BLPOP over them all; a record kiln cannot read, or a key a client
   retyped, is moved aside into the quarantine); *reorder_queues runs right after the pop and
   sets the next lane order (worker/lanes.py: interactive first, batch at least one job in
   four): from here the job must run, whatever signal arrives, or it would sit in no queue and
   no registry.
2. *execute_job caps the job's timeout at KILN_JOB_TIMEOUT_S and gives the job its entry point
   into kiln (RenderJob.run = KilnWorker.render_job with the job's RQJobContext).
3. _start, one round trip: the job hash says started, the execution takes the job's lease (its
   entry in the started registry, lapsing *get_heartbeat_ttl, 10 s, after its last push), the
   stop key is read. From here the Pulse thread pushes the
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
in which RQ calls them is the thing to read together (tests/test_rq_contract.py holds each
override to rq's signature).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
import traceback
from datetime import datetime, timezone
from functools import partial
from types import FrameType
from typing import Any

from redis import Redis
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.suspension import WORKERS_SUSPENDED
from rq.timeouts import UnixSignalDeathPenalty
from rq.utils import now
from rq.worker import WorkerStatus

from api_client import keys
from api_client.errors import short
from worker import events as job_events
from worker import keytypes, quarantine
from worker.errors import (
    FatalWorkerError,
    JobDeadlineExceeded,
    JobStopped,
    LeaseLost,
    ShutdownStop,
    StoreUnavailable,
)
from worker.job import LEASE_LOST, RenderJob, RQJobContext, record_error
from worker.lanes import LaneOrder, worker_queues
from worker.lease import LeaseKeeper, Outcome, worker_connection
from worker.publisher import STATE_INTERVAL_S, RecordPublisher, StatePublisher, announce
from worker.pulse import REDIS_ERRORS, Pulse
from worker.render import Renderer
from worker.webhooks import Dispatcher

# Importers of worker.queue find these here as before (tests, worker/serve.py).
__all__ = [
    "KilnWorker",
    "RecordPublisher",
    "RenderJob",
    "TimeoutPenalty",
    "make_worker",
    "worker_connection",
]
log = logging.getLogger(__name__)


class TimeoutPenalty(UnixSignalDeathPenalty):
    """RQ's SIGALRM job timeout, raising JobDeadlineExceeded (a BaseException)."""

    def handle_death_penalty(self, signum: int, frame: FrameType | None) -> None:
        raise JobDeadlineExceeded(f"ran past its timeout of {self._timeout} s")


class KilnWorker(LeaseKeeper, StatePublisher, SimpleWorker):
    """One process per device; the pipeline stays resident across jobs (no fork per job).
    RQ's hooks are all here, in the order the module docstring tells; the round trips of the
    job it holds are LeaseKeeper's (worker/lease.py), what it publishes StatePublisher's
    (worker/publisher.py)."""

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
        self.served = list(dict.fromkeys(keys.model_of(q.name) for q in self.queues))
        self.lanes = LaneOrder(self.queues)
        renderer.prefetcher.upcoming = self.lanes.upcoming_model  # what to read ahead
        self._ordered_queues = self.lanes.order()
        self.init_lease()
        self._last_exception: BaseException | None = None
        self._pulse: Pulse | None = None
        self._holding_job = False
        # Set by a second SIGTERM/SIGINT: the running job stops at its next step and is re-queued.
        self.shutdown_now = threading.Event()
        self.fatal: FatalWorkerError | None = None  # why this worker must exit non-zero
        self._suspension_checked_at = float("-inf")
        self._published_resident: list[str] = []
        self.webhooks = Dispatcher.from_settings(renderer.settings)

    # -- the work loop --------------------------------------------------------------------------

    def work(self, burst: bool = False, **kwargs: Any) -> bool:  # type: ignore[override]
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
        if not self.wait_for_memory(burst=timeout is None):  # rq passes no timeout in burst
            return None
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
            self.clean_queue(queue)
        self.last_cleaned_at = now()  # type: ignore[assignment]

    def reorder_queues(self, reference_queue: Queue) -> None:
        # RQ calls this right after a successful pop: from here on the job must run, whatever
        # signal arrives, or it would be off its queue and in no registry.
        self._holding_job = True
        # kiln's lane order (worker/lanes.py) in place of RQ's dequeue strategies.
        self._ordered_queues = self.lanes.after(reference_queue)

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

    # -- heartbeats, state, recovery (called from the pulse thread) -----------------------------

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
        except REDIS_ERRORS as exc:
            log.warning("could not withdraw worker state: %s", exc)
            return
        self.withdraw_state()


def make_worker(connection: Redis, renderer: Renderer, models: list[str]) -> KilnWorker:
    """A worker named as its renderer, listening on both lanes of the models it serves."""
    job_events.set_retention(renderer.settings.events_retention_s)
    names = worker_queues(models)  # both lanes of every model
    # A key a client retyped would crash this worker at every start: moved aside first.
    quarantine.repair_types(connection, keytypes.shared(names, f"rq:worker:{renderer.worker_name}"))
    announce(connection, renderer, models, names)
    # The queues carry RenderJob too: RQ's registry cleanups fetch jobs through queue.job_class,
    # and a plain Job there would import and run a payload's failure callback.
    queues = [
        Queue(name, connection=connection, serializer=JSONSerializer, job_class=RenderJob)
        for name in names
    ]
    return KilnWorker(
        queues,
        connection=connection,
        renderer=renderer,
        name=renderer.worker_name,
        job_timeout_s=renderer.settings.job_timeout_s,
    )
