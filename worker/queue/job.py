"""One kiln job as RQ sees it: RenderJob only ever runs kiln's render (the function named in a
payload is checked, never imported), and RQJobContext is the job as the renderer sees it:
its payload, admission, progress into job.meta and stop requests."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from types import FrameType
from typing import Any

from rq.exceptions import AbandonedJobError
from rq.job import Job
from rq.timeouts import UnixSignalDeathPenalty

from api_client import events, keys
from api_client.client import ABANDONED_RETRIES
from api_client.errors import MESSAGE_LIMIT, short
from api_client.schema import RENDER_FUNC, JobError, JobEvent
from api_client.webhooks import queue_webhook, webhook_target
from worker.errors import JobDeadlineExceeded, JobStopped, LeaseLost, RefusedJob, ShutdownStop
from worker.files.store import Store
from worker.queue import events as job_events
from worker.queue.upkeep import quarantine
from worker.render.timings import TimingRecord

log = logging.getLogger(__name__)
# A job whose worker died under it this many times is failed and quarantined, not run again.
POISON_DEATHS = 2
DEATHS_FIELD = "kiln_deaths"  # job.meta: [{worker, phase}] of each run that died
LEASE_LOST = (
    "lease lost: its heartbeat lapsed (this worker stalled or lost Redis) and the job went back "
    "to its queue; this worker stopped it and wrote nothing"
)


class RenderJob(Job):
    """A Job that runs kiln's render whatever its payload names, and runs no callbacks.

    RQ's own Job imports whatever dotted name the payload carries: a pure-JSON job naming
    os.system would run it. Here the name is only compared with RENDER_FUNC; a job asking for
    anything else is refused unrun (see problems()), inside the render so it leaves a record.
    """

    # Set by the worker that executes this job: its entry point into kiln's render.
    run: Callable[[], dict[str, Any]] | None = None

    @property
    def func(self) -> Callable[..., Any]:
        return self._execute

    def _execute(self) -> Any:
        if self.run is None:
            raise RuntimeError(f"job {self.id}: a kiln job runs only inside `kiln worker`")
        return self.run()

    def perform(self) -> Any:
        # rq's perform() also sends a PERSIST: the worker's start round trip does, when needed.
        self._result = self._execute()
        return self._result

    def restore(self, raw_data: Any) -> None:
        # rq's own tools may rewrite meta in their serializer (`rq requeue` writes pickle): it is
        # read as empty, never unpickled, and the job runs (a job is never deleted for it).
        dropped = quarantine.unreadable_meta(raw_data)
        if dropped:
            log.warning("job %s: ignoring its meta, which kiln cannot read (%s)", self.id, dropped)
            raw_data = {k: v for k, v in raw_data.items() if k != b"meta"}
        # Every fetch passes here: a record kiln cannot read is quarantined, never half-read.
        reasons = quarantine.unreadable(raw_data, self.id)
        if not reasons:
            try:
                super().restore(raw_data)
            except Exception as exc:
                reasons = [f"rq could not read it: {short(f'{type(exc).__name__}: {exc}')}"]
        if reasons:
            entry = quarantine.move_aside(self.connection, self.id, reasons)
            raise quarantine.UnreadableJob(f"job {entry.job_id} quarantined: {entry.reason}")
        # rq logs the description of every job it takes; a client may have made it 10 MB.
        self.description = short(self.description) if self.description else self.description

    def problems(self) -> list[str]:
        """Why this job must not run: anything but one render call with one request."""
        found = []
        try:
            func_name, args, kwargs = self.func_name, list(self.args), self.kwargs
        except Exception as exc:  # undecodable data: refused, never unpickled or imported
            return [f"job data cannot be read: {type(exc).__name__}: {exc}"]
        if func_name != RENDER_FUNC:
            found.append(f"function {func_name!r} is not {RENDER_FUNC}")
        if self.instance is not None:
            found.append("jobs must not carry an instance")
        for kind in ("success", "failure", "stopped"):
            name = getattr(self, f"_{kind}_callback_name", None)
            if name:
                found.append(f"{kind} callback {name!r} is not allowed")
        if self.webhooks:
            found.append("webhooks are not allowed")
        found += self._run_options()
        if args or not isinstance(kwargs, dict) or set(kwargs) != {"request"}:
            found.append("arguments must be exactly one keyword, request")
        return found

    def _run_options(self) -> list[str]:
        """rq options that change what runs or how often (Job hash fields in rq 2.12): repeats
        (repeats_left, repeat_intervals), dependencies (dependency_ids, dependency_id,
        allow_dependency_failures), and retries beyond kiln's own for abandoned jobs
        (retries_left, retry_intervals) or scheduled for later (no kiln worker runs a scheduler)."""
        problems = []
        if self.repeats_left or self.repeat_intervals:
            problems.append(f"repeat (repeats_left={short(self.repeats_left)}) is not allowed")
        if self._dependency_ids or self.allow_dependency_failures:
            ids = short(list(self._dependency_ids))
            problems.append(f"depends_on {ids} is not allowed")
        if self.retries_left is not None and self.retries_left > ABANDONED_RETRIES:
            problems.append(f"retry max {self.retries_left} exceeds {ABANDONED_RETRIES}")
        if any(self.retry_intervals or []):
            problems.append(f"retry intervals {short(self.retry_intervals)} are not allowed")
        return problems

    def execute_failure_callback(self, death_penalty_class: Any, *exc_info: Any) -> None:
        # rq's clean-up calls this for each abandoned job (no callback ever runs here), then
        # re-queues it while retries are left. Each death is noted with where it happened; a
        # job whose workers died under it POISON_DEATHS times is a poison job (it kills what
        # runs it: an OOM kill, a segfault) and is failed now instead of killing another.
        if not exc_info or exc_info[0] is not AbandonedJobError:
            return
        deaths = [*self.meta.get(DEATHS_FIELD, []), self._death()]
        self.meta[DEATHS_FIELD] = deaths
        reason = None
        if len(deaths) >= POISON_DEATHS:
            self.retries_left = 0  # rq's clean-up reads it next: the job fails, not re-queued
            reason = poison_reason(deaths)
        elif not self.retries_left:
            runs = (self.number_of_retries or 0) + 1
            reason = (
                f"abandoned {runs} time(s): its worker died running it (last: {self.worker_name})"
            )
        if reason is None:
            self.save_meta()  # type: ignore[no-untyped-call]
            return
        record_error(self, "WorkerDied", reason)  # what a client's wait says, not rq's words
        quarantine.note_killer(self.connection, self.id, reason, self.origin or None)
        # rq fails it next: its event stream ends (and expires) as any failed job's does.
        model = keys.model_of(self.origin) if self.origin else None
        failed = JobEvent(kind="failed", job_id=self.id, model=model, at=events.now(), error=reason)
        with self.connection.pipeline(transaction=False) as pipe:
            job_events.add_ended(pipe, [failed])
            queue_webhook(pipe, webhook_target(_request_of(self)), failed)
            pipe.execute()

    def _death(self) -> dict[str, str]:
        """Where the run that just died was: its worker and the phase of its newest progress."""
        try:
            progress = events.latest_progress(self.connection, keys.events_key(self.id))
        except Exception:  # an unreadable stream: the death still counts
            progress = None
        phase = progress.phase if progress is not None else "load"  # no step reported yet
        return {"worker": str(self.worker_name or "an unnamed worker"), "phase": phase}

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


def poison_reason(deaths: list[dict[str, str]]) -> str:
    """The cause, e.g. `killed in denoise on workers A and B` (each death's phase where they
    differ)."""
    workers = [d["worker"] for d in deaths]
    phases = {d["phase"] for d in deaths}
    if len(phases) == 1:
        named = ", ".join(workers[:-1]) + f" and {workers[-1]}"
        return f"killed in {phases.pop()} on workers {named}"
    return "killed " + ", then ".join(f"in {d['phase']} on {d['worker']}" for d in deaths)


def record_error(job: Job, kind: str, message: str) -> None:
    """The reason a job ended without a result, where the client reads it (job.meta)."""
    job.meta["error"] = JobError(type=kind, message=short(message, MESSAGE_LIMIT)).model_dump()
    job.save_meta()


class RQJobContext:
    """The job as a render sees it: progress and previews into its event journal (which writes
    them a few times a second, worker/queue/events.py), and stop requests, read without a Redis
    round trip of their own: `stop_asked` from the worker's start round trip, `cancelled` on RQ's
    stop-job command or when its heartbeat thread finds the job's stop key, `shutdown_now` on a
    second shutdown signal, `lease_lost` when its heartbeat finds the job is no longer its own.
    `holds_lease` asks Redis that last question at once (before any file is written).
    A done job's record is kept here for the worker to publish once the job's end is committed."""

    def __init__(
        self,
        job: RenderJob,
        shutdown_now: threading.Event,
        cancelled: threading.Event,
        store: Store,
        stop_asked: bool = False,
        lease_lost: threading.Event | None = None,
        holds_lease: Callable[[], bool] | None = None,
    ) -> None:
        self.job = job
        self.stop_asked = stop_asked  # its stop key, read when the worker took it
        self.job_id: str = job.id
        enqueued = job.enqueued_at
        started = job.started_at or datetime.now(timezone.utc)
        self.queue_wait_s = (
            max((_aware(started) - _aware(enqueued)).total_seconds(), 0.0) if enqueued else 0.0
        )
        self.payload = _request_of(job)
        self.events = job_events.open_journal(job.connection, job.id, job.origin, self.payload)
        self._store = store
        self._shutdown_now = shutdown_now
        self._cancelled = cancelled
        self._lease_lost = lease_lost or threading.Event()
        self._holds_lease = holds_lease
        self.done_record: TimingRecord | None = None

    def admit(self) -> None:
        problems = self.job.problems()
        if problems:
            message = f"refused job {self.job_id}: " + "; ".join(problems)
            raise RefusedJob(short(message, MESSAGE_LIMIT))
        # A job cancelled while it sat in a queue (or while its worker died) never loads a model.
        if self.stop_asked:
            raise JobStopped(f"job {self.job_id} stopped on request before it started")

    def progress(self, phase: str, step: int, steps: int, preview: str | None = None) -> None:
        if preview:  # a new preview (the uri stays the same: preview.jpg is replaced)
            self.events.preview(self._store.preview_ref(preview))
        self.events.progress(phase, step, steps)

    def stop_requested(self) -> bool:
        if self._lease_lost.is_set():
            raise LeaseLost(f"job {self.job_id}: {LEASE_LOST}")
        if self._shutdown_now.is_set():
            raise ShutdownStop(f"job {self.job_id} stopped by worker shutdown; re-queued")
        return self._cancelled.is_set()

    def confirm(self) -> None:
        if self._holds_lease is not None and not self._holds_lease():
            self._lease_lost.set()
        self.stop_requested()

    def hold_done_record(self, record: TimingRecord) -> bool:
        self.done_record = record
        return True


def _request_of(job: Job) -> Any:
    """The request payload, or None when the job's data cannot be read (admit() refuses it)."""
    try:
        kwargs = job.kwargs
    except Exception:
        return None
    return kwargs.get("request") if isinstance(kwargs, dict) else None


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


class TimeoutPenalty(UnixSignalDeathPenalty):
    """RQ's SIGALRM job timeout, raising JobDeadlineExceeded (a BaseException)."""

    def handle_death_penalty(self, signum: int, frame: FrameType | None) -> None:
        raise JobDeadlineExceeded(f"ran past its timeout of {self._timeout} s")
