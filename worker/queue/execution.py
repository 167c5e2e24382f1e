"""One execution of a job in Redis, as RQ's readers expect to find it: its lease and its end, each
one round trip (its start is the claim's, worker/queue/claim.py).

The lease is the execution's entry in the queue's started registry (`rq:wip:<queue>`), scored by
when it lapses. The Pulse thread pushes it forward (`ZADD XX CH`); a worker that stalls past the
score (GIL-bound load, swap, a long Redis failover) has its entry swept by another worker and its
job re-queued. The stalled worker learns it when its push changes nothing, and from then on
writes nothing about the job: its end is a script that writes only while the entry is there.

A success is written the way RQ's own worker writes one (rq 2.12 `handle_job_success`), so
Job.return_value(), latest_result(), the finished registry, `rq info`, rq-dashboard and
rq-exporter see kiln's jobs as any RQ job: status and end time in the job hash, the result in
the job's results stream, the job in the finished registry, the worker's counters.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

from redis import Redis
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import FinishedJobRegistry
from rq.results import Result
from rq.utils import utcformat

from api_client.webhooks import OUTBOX_WRITE, REFUSED, log_refused, outbox_write
from worker.queue.upkeep.webhooks import end_delivery

log = logging.getLogger(__name__)

# A job that waited longer than this for a worker has its event stream's lifetime renewed as it
# starts, so the stream cannot expire under its run (and be written again without one).
STREAM_REFRESH_AFTER_S = 24 * 3600

# KEYS: started registry, job hash, finished registry, results stream, dependents set, then
#       with a webhook the target's outbox entries, due and refused keys
# ARGV: execution entry, job id, ended at, result ttl (-1: keep), finished score, lease score,
#       execution id, the delivery's id ("": no webhook), entry JSON, due at and bound
#       (api_client.webhooks.outbox_write), then the result's stream fields
# Returns -1 when the lease no longer held (nothing written), else {dependents, the delivery's
# write: 1 written, 0 there already, -1 refused (the outbox is full), -2 failed, 2 no webhook}.
FINISH = (
    OUTBOX_WRITE
    + """
local function written_already()
    -- This execution's result is the stream's newest entry: a connection error made the client
    -- send this script again after it ran.
    local last = redis.call("XREVRANGE", KEYS[4], "+", "-", "COUNT", 1)[1]
    if last then
        for i = 1, #last[2], 2 do
            if last[2][i] == "execution_id" and last[2][i + 1] == ARGV[7] then
                return true
            end
        end
    end
    return false
end
-- The lease is pushed once more (ZADD XX CH answers 0 when it is no longer this execution's)
-- and stays in the started registry until the job's end is published (its record and last
-- events, StatePublisher.end_job): a worker that dies in between leaves a finished job's lease
-- to lapse, and the sweep publishes that end (worker/queue/upkeep/sweep.py).
if redis.call("ZADD", KEYS[1], "XX", "CH", ARGV[6], ARGV[1]) == 0 then
    if written_already() then
        return {redis.call("SCARD", KEYS[5]), 0}
    end
    return -1
end
local already = false
local written, failure = pcall(function()
    local ttl = tonumber(ARGV[4])
    -- kiln_ended is new to the hash on the first send; a second send that finds it and this
    -- execution's result written has nothing left to do.
    local ended = {"status", "finished", "ended_at", ARGV[3], "kiln_ended", ARGV[7]}
    if redis.call("HSET", KEYS[2], unpack(ended)) == 0 and written_already() then
        already = true
        return
    end
    redis.call("ZADD", KEYS[3], ARGV[5], ARGV[2])
    redis.call("XADD", KEYS[4], "MAXLEN", "10", "*", unpack(ARGV, 12))
    if ttl >= 0 then
        redis.call("EXPIRE", KEYS[2], ttl)
        redis.call("EXPIRE", KEYS[4], ttl)
    else
        redis.call("PERSIST", KEYS[2])
    end
end)
if not written then
    -- A key of the wrong type: the lease is still held, so the worker can move the key aside
    -- and send this again.
    return redis.error_reply(type(failure) == "table" and failure.err or tostring(failure))
end
if already then
    return {redis.call("SCARD", KEYS[5]), 0}
end
-- The end's webhook commits with the end; a key of the wrong type there loses the delivery
-- (logged), never the end.
local delivery = 2
if ARGV[8] ~= "" then
    local ok, answer = pcall(
        kiln_outbox_write, KEYS[6], KEYS[7], KEYS[8], ARGV[8], ARGV[9], ARGV[10], ARGV[11]
    )
    delivery = ok and answer or -2
end
return {redis.call("SCARD", KEYS[5]), delivery}
"""
)


# KEYS: scheduled registry, queue list. ARGV: now (unix s), job key prefix.
# Jobs put back for later (a store outage's backoff) whose time has come go to the front of
# their queue; ZREM decides which of several workers moves each one.
ENQUEUE_DUE = """
local due = redis.call("ZRANGEBYSCORE", KEYS[1], 0, ARGV[1], "LIMIT", 0, 100)
for _, id in ipairs(due) do
    if redis.call("ZREM", KEYS[1], id) == 1 and redis.call("EXISTS", ARGV[2] .. id) == 1 then
        redis.call("HSET", ARGV[2] .. id, "status", "queued")
        redis.call("LPUSH", KEYS[2], id)
    end
end
return #due
"""


# KEYS: registries (sorted sets scored by when each entry is due). ARGV: now (unix s).
# 1 for each registry holding an entry due by now (a lapsed lease, a job put back whose time has
# come), else 0: the sweep's look at every lane of every queue in one command.
ANY_DUE = """
local found = {}
for i, key in ipairs(KEYS) do
    found[i] = #redis.call("ZRANGEBYSCORE", key, 0, ARGV[1], "LIMIT", 0, 1)
end
return found
"""


def lease_score(ttl_s: float) -> float:
    """When a lease pushed now lapses. Fractional seconds, so that every push changes the score
    and `ZADD XX CH` answers 1 exactly while the entry is there."""
    return time.time() + ttl_s


def push_lease(pipe: Any, job: Job, execution: Execution, ttl_s: float) -> None:
    """Queue the lease's push on pipe; its reply is 1 while this execution holds the job."""
    pipe.zadd(
        job.started_job_registry.key,
        {execution.composite_key: lease_score(ttl_s)},
        xx=True,
        ch=True,
    )


def holds(connection: Redis, job: Job, execution: Execution, ttl_s: float) -> bool:
    """Push the lease now (one command); whether this execution still holds the job."""
    with connection.pipeline(transaction=False) as pipe:
        push_lease(pipe, job, execution, ttl_s)
        (changed,) = pipe.execute()
    return bool(changed)


class Finisher:
    """The end of a successful execution, written only while its lease is held (one script).
    The worker's own counters (RQ's successful_job_count, total_working_time) and busy or idle
    go out with its state beat, not once a job."""

    def __init__(self, connection: Redis) -> None:
        self.script = connection.register_script(FINISH)

    def __call__(
        self,
        job: Job,
        queue: Queue,
        execution: Execution,
        worker_name: str,
        result_ttl: int | None,
        started_at: datetime,
        ended_at: datetime,
        lease_ttl_s: float,
    ) -> int | None:
        """Record job's success as RQ's worker would; the number of jobs that depend on it, or
        None when this execution no longer holds the job (nothing was written)."""
        ttl = -1 if result_ttl is None else int(result_ttl)
        score = "+inf" if ttl < 0 else str(time.time() + ttl)
        result = Result(
            job.id,
            Result.Type.SUCCESSFUL,
            connection=job.connection,
            return_value=job._result,
            worker_name=worker_name,
            serializer=job.serializer,
            execution_id=execution.id,
            execution_started_at=started_at,
            execution_ended_at=ended_at,
        )
        fields = [item for pair in result.serialize().items() for item in pair]
        target, done = end_delivery(job, "done")
        outbox_keys, outbox_args = outbox_write(target, done) if target and done else ([], [""] * 4)
        answer = self.script(
            keys=[
                queue.started_job_registry.key,
                job.key,
                FinishedJobRegistry(queue.name, connection=job.connection).key,
                Result.get_key(job.id),
                job.dependents_key,
                *outbox_keys,
            ],
            args=[
                execution.composite_key,
                job.id,
                utcformat(ended_at),
                ttl,
                score,
                lease_score(lease_ttl_s),
                execution.id,
                *outbox_args,
                *fields,
            ],
        )
        if not isinstance(answer, list):
            return None
        job._status = JobStatus.FINISHED
        dependents, delivery = (int(n) for n in answer)
        if target and done and delivery == REFUSED:
            log_refused(target, done)
        elif target and done and delivery < 0:
            log.error(
                "job %s: its webhook to %s could not be written (a key retyped?)", job.id, target
            )
        return dependents
