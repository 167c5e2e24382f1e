"""Jobs that lost their worker, found by any worker of their queues: the Pulse thread's sweep
(every KILN_SWEEP_S) re-queues jobs whose lease lapsed (RQ's registry clean-up,
which counts each death and fails a poison job, worker/queue/job.py) and moves jobs put back
for later (a store outage's backoff) to the front of their queue when their time has come.

Not while Redis is back less than a lease ago (Outages.unsettled), when every lease may have
lapsed with no worker able to push it.

A lapsed entry is a lease only if it names its job's holder: the execution id the claim wrote
into the job's hash (claim.EXECUTION_FIELD), while the job says started. Anything else in a
started registry (an entry a client wrote, a second entry for a running job, one left for a job
that ended) is dropped without a re-queue or a death noted (NOT_A_LEASE), so no write to the
registry can make a healthy job run twice or be failed as poison.

A finished job's lease stays in the registry from its commit (the FINISH script pushes it once
more) until its record and last events are published: a worker that dies between the two
leaves it to lapse, and the sweep publishes that end (finish_ended), once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from redis import Redis
from rq import Queue
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.utils import current_timestamp

from worker.queue import execution
from worker.queue.claim import EXECUTION_FIELD
from worker.queue.job import RenderJob
from worker.queue.upkeep import quarantine
from worker.queue.upkeep.pulse import Outages
from worker.queue.upkeep.repair import KeyRepair

log = logging.getLogger(__name__)

# KEYS: a started registry. ARGV: now (unix s), job key prefix, the holder field, most entries.
# Takes out the lapsed entries that are not a running job's lease; returns them, each with what
# its job hash said (status, holder) and whether it is an end to finish (a job its holder
# finished, whose worker died before publishing the end: claim.EXECUTION_FIELD names it).
NOT_A_LEASE = """
local dropped = {}
for _, member in ipairs(redis.call("ZRANGEBYSCORE", KEYS[1], 0, ARGV[1], "LIMIT", 0, ARGV[4])) do
    local at = string.find(member, ":", 1, true)
    if at then
        local job, execution = string.sub(member, 1, at - 1), string.sub(member, at + 1)
        local held = redis.call("HMGET", ARGV[2] .. job, "status", ARGV[3])
        -- No holder at all: a job claimed by a worker older than the claim script (a rolling
        -- upgrade), whose lease it is.
        local holder = not held[2] or held[2] == execution
        if held[1] ~= "started" or not holder then
            redis.call("ZREM", KEYS[1], member)
            local ended = held[1] == "finished" and held[2] == execution
            dropped[#dropped + 1] = {member, held[1] or "", held[2] or "", ended and 1 or 0}
        end
    end
end
return dropped
"""
SWEEP_BATCH = 100


class Sweeper:
    """The sweep over one worker's queues: one command for all of them when nothing is due,
    which is nearly always (execution.ANY_DUE)."""

    def __init__(
        self,
        connection: Redis,
        queues: list[Queue],
        serializer: Any,
        outages: Outages,
        repair: KeyRepair,
        finish_ended: Callable[[str], None],
    ) -> None:
        self.connection = connection
        self.queues = queues
        self.serializer = serializer
        self.outages = outages
        self.repair = repair
        # Publishes what a job's end publishes after its commit (the record, the last events),
        # for a job whose worker died between the two (StatePublisher.publish_orphaned_end).
        self.finish_ended = finish_ended
        self._enqueue_due = connection.register_script(execution.ENQUEUE_DUE)
        self._any_due = connection.register_script(execution.ANY_DUE)
        self._not_a_lease = connection.register_script(NOT_A_LEASE)

    def sweep(self) -> None:
        """Jobs whose worker stopped heartbeating go back to their queue (if retries are left),
        and jobs put back for later whose time has come too."""
        if self.outages.unsettled():
            return
        stamp = current_timestamp()
        found = self.repair.call(None, partial(self._due, stamp))
        if self.outages.unsettled():  # that read waited out an outage: every lease looks lapsed
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
                self.drop_what_is_not_a_lease(registry.key, stamp)
                registry.cleanup(stamp)
            finally:
                queue.release_maintenance_lock()

    def drop_what_is_not_a_lease(self, registry: str, stamp: float) -> None:
        dropped = self._not_a_lease(
            keys=[registry],
            args=[stamp, Job.redis_job_namespace_prefix, EXECUTION_FIELD, SWEEP_BATCH],
        )
        for member, status, holder, ended in dropped:
            job_id = _text(member).split(":", 1)[0]
            if ended:
                log.warning(
                    "job %s: its worker died after committing its end; publishing it", job_id
                )
                self.finish_ended(job_id)
                continue
            if quarantine.if_unreadable(
                self.connection, job_id, "id: not a job id (in the started registry)"
            ):
                continue
            log.warning(
                "dropped %s from %s: not its job's lease (the job is %s, held by execution %s);"
                " its job is not re-queued and no death is noted",
                _text(member),
                registry,
                _text(status) or "gone",
                _text(holder) or "none",
            )

    def _due(self, stamp: float) -> list[tuple[Any, Any]]:
        """Per queue: whether a lease lapsed; whether a job put back for later is due. One
        command for every lane of every queue (execution.ANY_DUE)."""
        registries = [
            key
            for queue in self.queues
            for key in (queue.started_job_registry.key, queue.scheduled_job_registry.key)
        ]
        with self.outages.watching():
            found = self._any_due(keys=registries, args=[stamp])
        return list(zip(found[::2], found[1::2], strict=True))


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
