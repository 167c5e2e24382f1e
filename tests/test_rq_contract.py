"""kiln against the rq it was written for. kiln overrides rq's worker hooks, calls rq's internals
and writes rq's records by hand (worker/queue/worker.py, job.py, execution.py, lease.py and
sweep.py), behind a pin to the tested line (pyproject.toml). rq changes these in minor releases
(3.0 changed perform_job and maintain_heartbeats), so this file records each one as rq 2.12 has
it: a signature (parameters and defaults), an attribute, or a name in Redis. A failure names the
hook, where kiln uses it, and rq 2.12's value beside the installed rq's. Last, the parts of
redis-py's Retry that worker/queue/upkeep/pulse.py subclasses."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import pytest
import rq
import rq.command
import rq.registry
import rq.utils
import rq.worker_registration
import tomllib
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from redis import Redis
from rq import Queue, SimpleWorker
from rq.executions import Execution
from rq.intermediate_queue import IntermediateQueue
from rq.job import JOB_ID_PATTERN, Job, JobStatus, Retry
from rq.registry import FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.suspension import WORKERS_SUSPENDED
from rq.timeouts import UnixSignalDeathPenalty
from rq.worker import DequeueStrategy, WorkerStatus

from tests.conftest import ROOT

TESTED_PIN = SpecifierSet(">=2.12,<2.13")

OWNERS: dict[str, Any] = {
    "SimpleWorker": SimpleWorker,
    "Job": Job,
    "Queue": Queue,
    "Retry": Retry,
    "StartedJobRegistry": StartedJobRegistry,
    "FinishedJobRegistry": FinishedJobRegistry,
    "IntermediateQueue": IntermediateQueue,
    "Execution": Execution,
    "Result": Result,
    "UnixSignalDeathPenalty": UnixSignalDeathPenalty,
    "rq.registry": rq.registry,
    "rq.worker_registration": rq.worker_registration,
    "rq.command": rq.command,
    "rq.utils": rq.utils,
}


@dataclass(frozen=True)
class Hook:
    name: str  # Owner.attribute, looked up through the owner's classes as kiln's subclass does
    tested: str  # rq 2.12's parameters and defaults, annotations left out; "property"
    use: str  # what kiln does with it, and where


OVERRIDE, CALL = "overridden by", "called by"
W, J, X, L, S = (
    "KilnWorker (worker/queue/worker.py)",
    "RenderJob (worker/queue/job.py)",
    "worker/queue/execution.py",
    "LeaseKeeper (worker/queue/lease.py)",
    "Sweeper (worker/queue/upkeep/sweep.py)",
)

HOOKS = [
    # The worker: SimpleWorker's hooks as KilnWorker overrides them, in the order rq calls them.
    Hook(
        "SimpleWorker.__init__",
        "(self, queues, name=None, default_result_ttl=500, connection=None, "
        "exception_handlers=None, maintenance_interval=600, default_worker_ttl=None, "
        "worker_ttl=None, job_class=None, queue_class=None, log_job_description=True, "
        "job_monitoring_interval=30, disable_default_exception_handler=False, "
        "prepare_for_work=True, serializer=None, work_horse_killed_handler=None)",
        f"{OVERRIDE} {W}: serializer, job_class and worker_ttl by keyword",
    ),
    Hook(
        "SimpleWorker.work",
        "(self, burst=False, logging_level=None, date_format='%H:%M:%S', "
        "log_format='%(asctime)s %(message)s', max_jobs=None, max_idle_time=None, "
        "with_scheduler=False, dequeue_strategy=<DequeueStrategy.DEFAULT: 'default'>)",
        f"{OVERRIDE} {W}: logging_level (worker/serve.py) by keyword",
    ),
    Hook("SimpleWorker.register_birth", "(self)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.check_for_suspension", "(self, burst)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.run_maintenance_tasks", "(self)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.clean_registries", "(self)", f"{OVERRIDE} {W}"),
    Hook(
        "SimpleWorker.dequeue_job_and_maintain_ttl",
        "(self, timeout, max_idle_time=None)",
        f"{OVERRIDE} {W}",
    ),
    Hook("SimpleWorker.heartbeat", "(self, timeout=None, pipeline=None)", f"{OVERRIDE} {W}"),
    Hook(
        "SimpleWorker.reorder_queues",
        "(self, reference_queue)",
        f"{OVERRIDE} {W}: sets _ordered_queues to kiln's lane order (worker/queue/lanes.py)",
    ),
    Hook("SimpleWorker.execute_job", "(self, job, queue)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.get_heartbeat_ttl", "(self, job)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.set_state", "(self, state, pipeline=None)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.get_state", "(self)", f"{CALL} {W} _snapshot"),
    Hook("SimpleWorker.handle_exception", "(self, job, *exc_info)", f"{OVERRIDE} {W}"),
    Hook(
        "SimpleWorker.handle_job_failure",
        "(self, job, queue, started_job_registry=None, exc_string='')",
        f"{OVERRIDE} {W}",
    ),
    Hook(
        "SimpleWorker.cleanup_execution",
        "(self, job, pipeline)",
        f"{OVERRIDE} {W}: a failed or stopped job's webhook delivery joins its end's commit",
    ),
    Hook("SimpleWorker.get_current_job_id", "(self, pipeline=None)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.subscribe", "(self)", f"{OVERRIDE} {W}: a 0.5 s read, not 60 s"),
    Hook(
        "SimpleWorker._pubsub_exception_handler",
        "(self, exc, pubsub, pubsub_thread)",
        f"{CALL} {W} subscribe",
    ),
    Hook("SimpleWorker.handle_payload", "(self, message)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.kill_horse", "(self, sig=<Signals.SIGKILL: 9>)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.request_stop", "(self, signum, frame)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.request_force_stop", "(self, signum, frame)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.teardown", "(self)", f"{OVERRIDE} {W}"),
    Hook("SimpleWorker.should_run_maintenance_tasks", "property", "read by rq's loop"),
    Hook(
        "UnixSignalDeathPenalty.__init__",
        "(self, timeout, exception=<class 'rq.timeouts.BaseTimeoutException'>, **kwargs)",
        f"{CALL} {W} perform, with job_id by keyword",
    ),
    Hook(
        "UnixSignalDeathPenalty.handle_death_penalty",
        "(self, signum, frame)",
        f"{OVERRIDE} TimeoutPenalty (worker/queue/job.py)",
    ),
    # The job: Job's hooks as RenderJob overrides them, and what kiln calls on jobs.
    Hook("Job.func", "property", f"{OVERRIDE} {J}: never imports the payload's name"),
    Hook("Job.perform", "(self)", f"{OVERRIDE} {J}"),
    Hook("Job._execute", "(self)", f"{OVERRIDE} {J}: what rq's perform() would run"),
    Hook("Job.restore", "(self, raw_data)", f"{OVERRIDE} {J}: quarantine first"),
    Hook(
        "Job.execute_failure_callback",
        "(self, death_penalty_class, *exc_info)",
        f"{OVERRIDE} {J}: notes killers",
    ),
    Hook("Job.success_callback", "property", f"{OVERRIDE} {J}: no callbacks"),
    Hook("Job.failure_callback", "property", f"{OVERRIDE} {J}: no callbacks"),
    Hook("Job.stopped_callback", "property", f"{OVERRIDE} {J}: no callbacks"),
    Hook("Job.should_retry", "property", f"{OVERRIDE} {J}"),
    Hook("Job.send_webhooks", "(self, status, *, exc_string=None)", f"{OVERRIDE} {J}"),
    Hook("Job.func_name", "property", f"{CALL} {J} problems"),
    Hook("Job.instance", "property", f"{CALL} {J} problems"),
    Hook("Job.args", "property", f"{CALL} {J} problems"),
    Hook("Job.kwargs", "property", f"{CALL} {J} problems, RQJobContext"),
    Hook("Job.prepare_for_execution", "(self, worker_name, pipeline)", f"{CALL} {X} start"),
    Hook("Job.get_result_ttl", "(self, default_ttl)", f"{CALL} {W} finish"),
    Hook("Job.get_status", "(self, refresh=True)", f"{CALL} kiln with refresh=False"),
    Hook("Job.get_meta", "(self, refresh=True)", f"{CALL} api_client/job.py"),
    Hook("Job.save_meta", "(self)", f"{CALL} worker/queue/job.py record_error"),
    Hook("Job.started_job_registry", "property", f"{CALL} {X} push_lease"),
    Hook("Job.dependents_key", "property", f"{CALL} {X} Finisher"),
    Hook("Job.key_for", "(job_id)", f"{CALL} worker/queue/upkeep/quarantine.py"),
    Hook("Job.fetch", "(id, connection=None, serializer=None)", f"{CALL} api_client"),
    Hook("Job.fetch_many", "(job_ids, connection, serializer=None)", f"{CALL} api_client/eta.py"),
    Hook(
        "Job.to_dict",
        "(self, include_meta=True, include_result=True)",
        f"{CALL} api_client/enqueue.py (the hash its script writes)",
    ),
    Hook("Job.latest_result", "(self, timeout=0)", f"{CALL} api_client/job.py"),
    Hook("Job.return_value", "(self, refresh=False)", f"{CALL} api_client/job.py"),
    Hook(
        "Job.cancel",
        "(self, pipeline=None, enqueue_dependents=False, remove_from_dependencies=False)",
        f"{CALL} api_client/job.py",
    ),
    Hook("Retry.__init__", "(self, max, interval=0, enqueue_at_front=False)", f"{CALL} client"),
    # Queues, registries, executions and results, written beside rq's own writes.
    Hook(
        "Queue.__init__",
        "(self, name='default', connection=None, default_timeout=None, is_async=True, "
        "job_class=None, serializer=None, "
        "death_penalty_class=<class 'rq.timeouts.UnixSignalDeathPenalty'>, **kwargs)",
        f"{CALL} worker/queue/build.py open_queues and the client: job_class and serializer "
        "by keyword",
    ),
    Hook(
        "Queue.create_job",
        "(self, func, args=None, kwargs=None, timeout=None, result_ttl=None, ttl=None, "
        "failure_ttl=None, description=None, depends_on=None, job_id=None, meta=None, "
        "status=<JobStatus.QUEUED: 'queued'>, retry=None, repeat=None, *, on_success=None, "
        "on_failure=None, on_stopped=None, webhooks=None, group_id=None)",
        f"{CALL} api_client/client.py submit",
    ),
    Hook(
        "Queue._enqueue_job",
        "(self, job, pipeline=None, at_front=False, unique=False)",
        f"{CALL} {W} _requeue: back to the front of its queue",
    ),
    Hook("Queue.acquire_maintenance_lock", "(self)", f"{CALL} {W} clean-ups and {S}"),
    Hook("Queue.release_maintenance_lock", "(self)", f"{CALL} {W} clean-ups and {S}"),
    Hook("Queue.intermediate_queue", "property", f"{CALL} {W} clean_registries"),
    Hook("Queue.intermediate_queue_key", "property", f"{CALL} {X} start"),
    Hook("Queue.started_job_registry", "property", f"{CALL} {W} and {X}"),
    Hook("IntermediateQueue.cleanup", "(self, worker, queue)", f"{CALL} {W} clean_registries"),
    Hook(
        "StartedJobRegistry.__init__",
        "(self, name='default', connection=None, job_class=None, queue=None, serializer=None, "
        "death_penalty_class=None)",
        f"{CALL} {S} sweep, api_client/eta.py",
    ),
    Hook(
        "StartedJobRegistry.cleanup",
        "(self, timestamp=None, exception_handlers=None)",
        f"{CALL} {S} sweep: rq re-queues abandoned jobs",
    ),
    Hook(
        "StartedJobRegistry.get_job_ids",
        "(self, start=0, end=-1, desc=False, cleanup=True)",
        f"{CALL} api_client/eta.py",
    ),
    Hook(
        "FinishedJobRegistry.__init__",
        "(self, name='default', connection=None, job_class=None, queue=None, serializer=None, "
        "death_penalty_class=None)",
        f"{CALL} {X} Finisher",
    ),
    Hook(
        "Execution.__init__",
        "(self, id, job_id, connection, worker_name='')",
        f"{CALL} {L} take",
    ),
    Hook("Execution.composite_key", "property", f"{CALL} {X}: the lease's member"),
    Hook(
        "Result.__init__",
        "(self, job_id, type, connection, id=None, created_at=None, return_value=None, "
        "exc_string=None, worker_name='', serializer=None, execution_id=None, "
        "execution_started_at=None, execution_ended_at=None)",
        f"{CALL} {X} Finisher",
    ),
    Hook("Result.serialize", "(self)", f"{CALL} {X} Finisher: the result stream's fields"),
    Hook("Result.get_key", "(job_id)", f"{CALL} {X} Finisher"),
    Hook(
        "rq.registry.clean_registries",
        "(queue, exception_handlers=None)",
        f"{CALL} {W} clean_registries",
    ),
    Hook("rq.worker_registration.clean_worker_registry", "(queue)", f"{CALL} {W}"),
    Hook(
        "rq.command.send_command",
        "(connection, worker_name, command, **kwargs)",
        f"{CALL} api_client/job.py cancel: stop-job",
    ),
    Hook("rq.utils.current_timestamp", "()", f"{CALL} {W} and {S}"),
    Hook("rq.utils.now", "()", f"{CALL} {W} and the client"),
    Hook("rq.utils.utcformat", "(dt)", f"{CALL} {W} and {X}"),
    Hook("rq.utils.str_to_date", "(date_str)", f"{CALL} worker/queue/upkeep/quarantine.py"),
]

# Attributes kiln reads or sets that rq creates (most of them private), on real rq objects.
ATTRIBUTES = {
    "SimpleWorker": (
        "_stop_requested",  # set by request_stop and on a fatal error; read by rq's loop
        "_shutdown_requested_date",
        "_stopped_job_id",  # rq marks this job STOPPED in handle_job_failure
        "_exc_handlers",  # handed to clean_registries
        "_ordered_queues",  # the order rq's dequeue pops in: kiln's lanes (reorder_queues)
        "execution",  # rq's failure handling reads and clears it: KilnWorker's lease keeper's
        "_state",
        "last_cleaned_at",
        "last_heartbeat",
        "default_result_ttl",
        "worker_ttl",
        "key",
        "name",
        "queues",
        "connection",
        "serializer",
        "job_class",
        "death_penalty_class",
        "max_connection_wait_time",
    ),
    "Job": (
        "_result",  # perform() sets it; the client reads what restore() read into it
        "_status",
        "_dependency_ids",
        "_success_callback_name",
        "_failure_callback_name",
        "_stopped_callback_name",
        "webhooks",
        "repeats_left",
        "repeat_intervals",
        "allow_dependency_failures",
        "retries_left",
        "retry_intervals",
        "number_of_retries",
        "worker_name",
        "description",
        "timeout",
        "ttl",
        "meta",
        "origin",
        "enqueued_at",
        "started_at",
        "ended_at",
        "serializer",
        "connection",
        "key",
    ),
    "Queue": ("key", "name", "job_class", "DEFAULT_TIMEOUT", "redis_queues_keys"),
    "Execution": ("id", "job_id"),
}

# Names in Redis and values that kiln's scripts (worker/queue/execution.py FINISH,
# api_client/enqueue.py ENQUEUE) and quarantine checks write or read without going through rq.
LAYOUT: dict[str, tuple[Any, Any]] = {
    "started registry key": (lambda: StartedJobRegistry("q", connection=Redis()).key, "rq:wip:q"),
    "finished registry key": (
        lambda: FinishedJobRegistry("q", connection=Redis()).key,
        "rq:finished:q",
    ),
    "intermediate list key": (
        lambda: Queue("q", connection=Redis()).intermediate_queue_key,
        "rq:queue:q:intermediate",
    ),
    "queues set key": (lambda: Queue.redis_queues_keys, "rq:queues"),
    "queue key prefix": (lambda: Queue.redis_queue_namespace_prefix, "rq:queue:"),
    "job key": (lambda: Job.key_for("j"), "rq:job:j"),
    "dependents key": (lambda: Job("j", connection=Redis()).dependents_key, "rq:job:j:dependents"),
    "results stream key": (lambda: Result.get_key("j"), "rq:results:j"),
    "execution member": (lambda: Execution("e", "j", connection=Redis()).composite_key, "j:e"),
    "suspension key": (lambda: WORKERS_SUSPENDED, "rq:suspended"),
    "job id pattern": (lambda: JOB_ID_PATTERN.pattern, "[A-Za-z0-9_-]+"),
    "job statuses": (
        lambda: [s.value for s in JobStatus],
        [
            "created",
            "queued",
            "finished",
            "failed",
            "started",
            "deferred",
            "scheduled",
            "stopped",
            "canceled",
        ],
    ),
    "worker statuses": (
        lambda: [s.value for s in WorkerStatus],
        ["started", "suspended", "busy", "idle"],
    ),
    "round robin strategy": (lambda: DequeueStrategy.ROUND_ROBIN.value, "round_robin"),
    "successful result type": (lambda: Result.Type.SUCCESSFUL.value, 1),
    "result stream fields": (
        lambda: sorted(_success().serialize()),
        [
            "execution_ended_at",
            "execution_id",
            "execution_started_at",
            "return_value",
            "type",
            "worker_name",
        ],
    ),
    "job hash fields (the client's job)": (
        lambda: sorted(_client_job().to_dict()),
        [
            "created_at",
            "data",
            "description",
            "ended_at",
            "failure_callback_name",
            "failure_ttl",
            "group_id",
            "last_heartbeat",
            "origin",
            "result_ttl",
            "retries_left",
            "retry_intervals",
            "started_at",
            "status",
            "stopped_callback_name",
            "success_callback_name",
            "timeout",
            "ttl",
            "worker_name",
        ],
    ),
}


def _success() -> Result:
    moment = rq.utils.now()
    return Result(
        "j",
        Result.Type.SUCCESSFUL,
        connection=Redis(),
        return_value={"images": []},
        worker_name="w",
        serializer=JSONSerializer,
        execution_id="e",
        execution_started_at=moment,
        execution_ended_at=moment,
    )


def _client_job() -> Job:
    """A job made as api_client/client.py submit makes one (no Redis command is sent)."""
    queue = Queue("kiln:m", connection=Redis(), serializer=JSONSerializer)
    return queue.create_job(
        "worker.queue.render_job",
        kwargs={"request": {"model": "m"}},
        job_id="j",
        retry=Retry(max=2),
        timeout=600,
        result_ttl=3600,
        failure_ttl=3600,
        ttl=3600,
        description="m: a fox",
    )


def parameters(obj: Any) -> str:
    """A callable's parameters and defaults as inspect shows them, without annotations (rq
    rewording a type hint changes no call)."""
    if isinstance(obj, property):
        return "property"
    signature = inspect.signature(obj)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def lookup(name: str) -> Any:
    """Owner.attribute as rq defines it: the raw class attribute (a property stays a property),
    found through the owner's classes as a subclass inherits it."""
    owner_name, _, attribute = name.rpartition(".")
    owner = OWNERS[owner_name]
    if not isinstance(owner, type):
        return getattr(owner, attribute)
    for cls in owner.__mro__:
        if attribute in cls.__dict__:
            raw = cls.__dict__[attribute]
            return (
                getattr(owner, attribute) if isinstance(raw, (classmethod, staticmethod)) else raw
            )
    raise AttributeError(f"{owner_name} has no attribute {attribute!r}")


def pinned_rq() -> SpecifierSet:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [pin] = [d for d in project["dependencies"] if d.replace(" ", "").startswith("rq>")]
    return SpecifierSet(pin.replace(" ", "").removeprefix("rq"))


def test_installed_rq_is_the_pinned_line_this_file_records() -> None:
    pin = pinned_rq()
    assert pin == TESTED_PIN, (
        f"pyproject.toml pins rq{pin}; this file records rq{TESTED_PIN}. Widen the pin only "
        "after re-recording every hook below against the new rq and fixing kiln's overrides."
    )
    assert Version(rq.__version__) in pin, f"rq {rq.__version__} is outside the pin rq{pin}"


@pytest.mark.parametrize("hook", HOOKS, ids=[h.name for h in HOOKS])
def test_rq_hook_keeps_the_signature_kiln_was_written_for(hook: Hook) -> None:
    try:
        found = parameters(lookup(hook.name))
    except AttributeError:
        found = "(missing)"
    assert found == hook.tested, (
        f"rq {rq.__version__} changed {hook.name}, {hook.use}:\n"
        f"  rq 2.12: {hook.tested}\n"
        f"  rq {rq.__version__}: {found}"
    )


@pytest.mark.parametrize(
    "owner, attribute",
    [(owner, attribute) for owner, names in ATTRIBUTES.items() for attribute in names],
)
def test_rq_objects_still_carry_the_attributes_kiln_uses(
    redis_conn: Redis, owner: str, attribute: str
) -> None:
    objects = {
        "SimpleWorker": lambda: SimpleWorker(
            [Queue("kiln:m", connection=redis_conn)], connection=redis_conn
        ),
        "Job": _client_job,
        "Queue": lambda: Queue("kiln:m", connection=redis_conn),
        "Execution": lambda: Execution("e", "j", connection=redis_conn),
    }
    assert hasattr(objects[owner](), attribute), (
        f"rq {rq.__version__}'s {owner} has no attribute {attribute!r} any more "
        f"(rq 2.12 sets it; kiln reads or writes it)"
    )


@pytest.mark.parametrize("what", list(LAYOUT))
def test_rq_redis_layout_is_what_kiln_writes_by_hand(what: str) -> None:
    read, tested = LAYOUT[what]
    found = read()
    assert found == tested, (
        f"rq {rq.__version__} changed the {what}, which kiln's scripts and checks write or read "
        f"directly:\n  rq 2.12: {tested!r}\n  rq {rq.__version__}: {found!r}"
    )


def test_every_rq_hook_kiln_overrides_is_recorded_here() -> None:
    """A new override (or a new attribute set over rq's) must come with its rq 2.12 record."""
    from worker.queue.job import RenderJob, TimeoutPenalty
    from worker.queue.worker import KilnWorker

    recorded = {h.name for h in HOOKS} | {
        f"{owner}.{name}" for owner, names in ATTRIBUTES.items() for name in names
    }
    missing = []
    # rq's SimpleWorker is KilnWorker's only base, so every hook it overrides is in its own body
    # (its lease keeper, sweeper and publishers are objects it owns, not bases).
    assert KilnWorker.__bases__ == (SimpleWorker,), KilnWorker.__bases__
    for ours, theirs, owner in (
        (KilnWorker, SimpleWorker, "SimpleWorker"),
        (RenderJob, Job, "Job"),
        (TimeoutPenalty, UnixSignalDeathPenalty, "UnixSignalDeathPenalty"),
    ):
        for name in vars(ours):
            shadows = hasattr(theirs, name) and (name == "__init__" or not name.startswith("__"))
            if shadows and f"{owner}.{name}" not in recorded:
                missing.append(f"{ours.__name__}.{name} over {owner}.{name}")
    assert missing == [], "record rq 2.12's side of these in HOOKS or ATTRIBUTES: " + ", ".join(
        missing
    )


def test_redis_retry_still_has_what_watched_retry_wraps() -> None:
    """worker/queue/upkeep/pulse.py WatchedRetry subclasses redis-py's Retry (redis is not pinned
    to a line): it copies the policy's private fields, wraps call_with_retry's first two
    parameters and forwards the rest, and relies on each new connection deep-copying the client's
    policy."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry as RedisRetry

    from worker.queue.upkeep.pulse import WatchedRetry, watch_connection

    policy = RedisRetry(NoBackoff(), 3)
    fields = [f for f in ("_backoff", "_retries", "_supported_errors") if not hasattr(policy, f)]
    assert fields == [], f"redis-py's Retry no longer has {fields} (WatchedRetry copies them)"
    found = list(inspect.signature(RedisRetry.call_with_retry).parameters)[:3]
    assert found == ["self", "do", "fail"], (
        "redis-py changed Retry.call_with_retry, overridden by WatchedRetry"
        f" (worker/queue/upkeep/pulse.py):\n"
        f"  tested: (self, do, fail, ...)\n  now: {found}"
    )
    client = Redis(retry=policy)
    watch = watch_connection(client)
    connection = client.connection_pool.make_connection()
    assert isinstance(connection.retry, WatchedRetry) and connection.retry.watch is watch, (
        "a new pooled connection no longer takes (a copy of) the client's retry policy"
    )


def test_the_function_every_kiln_job_names_resolves_and_refuses_a_plain_rq_worker() -> None:
    """Queued records name worker.queue.render_job (api_client.schema.RENDER_FUNC); RQ's readers
    resolve it as rq does. Run by a plain RQ worker it fails the job with the reason."""
    from rq.utils import import_attribute

    from api_client.schema import RENDER_FUNC

    render_job = import_attribute(RENDER_FUNC)
    with pytest.raises(RuntimeError, match="only under `kiln worker`"):
        render_job({"model": "tiny-sd15", "prompt": "x"})
