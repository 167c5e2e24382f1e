"""One execution of a job in Redis, as RQ's readers expect to find it: its start, its lease and
its end, each one round trip.

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

import time
from datetime import datetime
from typing import Any

from redis import Redis
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import FinishedJobRegistry
from rq.results import Result
from rq.utils import now, utcformat

from api_client import keys
from api_client.enqueue import running_ttl_s

# A job that waited longer than this for a worker has its event stream's lifetime renewed as it
# starts, so the stream cannot expire under its run (and be written again without one).
STREAM_REFRESH_AFTER_S = 24 * 3600

# KEYS: started registry, job hash, finished registry, results stream, dependents set
# ARGV: execution entry, job id, ended at, result ttl (-1: keep), finished score, lease score,
#       execution id, then the result's stream fields
FINISH = """
if redis.call("ZREM", KEYS[1], ARGV[1]) == 0 then
    -- Written already, when a connection error made the client send this script again?
    local last = redis.call("XREVRANGE", KEYS[4], "+", "-", "COUNT", 1)[1]
    if last then
        for i = 1, #last[2], 2 do
            if last[2][i] == "execution_id" and last[2][i + 1] == ARGV[7] then
                return redis.call("SCARD", KEYS[5])
            end
        end
    end
    return -1
end
local written, failure = pcall(function()
    local ttl = tonumber(ARGV[4])
    redis.call("HSET", KEYS[2], "status", "finished", "ended_at", ARGV[3])
    redis.call("ZADD", KEYS[3], ARGV[5], ARGV[2])
    redis.call("XADD", KEYS[4], "MAXLEN", "10", "*", unpack(ARGV, 8))
    if ttl >= 0 then
        redis.call("EXPIRE", KEYS[2], ttl)
        redis.call("EXPIRE", KEYS[4], ttl)
    else
        redis.call("PERSIST", KEYS[2])
    end
end)
if not written then
    -- A key of the wrong type: the lease stays held, so the worker can move the key aside and
    -- send this again.
    redis.call("ZADD", KEYS[1], ARGV[6], ARGV[1])
    return redis.error_reply(type(failure) == "table" and failure.err or tostring(failure))
end
return redis.call("SCARD", KEYS[5])
"""


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


def start(
    pipe: Any, job: Job, queue: Queue, execution: Execution, worker: Any, ttl_s: float
) -> None:
    """Queue the start of job on pipe: the job hash says started (RQ's own fields) and lives
    through its run (its queued lifetime ends), the lease is taken, the job leaves RQ's
    intermediate list, and its stop key is read (the last reply).

    The job's event stream keeps the lifetime its submit gave it (QUEUED_TTL_S), which outlasts
    any run, unless the job waited over STREAM_REFRESH_AFTER_S for a worker."""
    job.prepare_for_execution(worker.name, pipeline=pipe)
    lifetime = running_ttl_s(job.timeout)
    pipe.expire(job.key, lifetime)
    waited = (now() - job.enqueued_at).total_seconds() if job.enqueued_at else 0.0
    if waited > STREAM_REFRESH_AFTER_S:
        pipe.expire(keys.events_key(job.id), lifetime)
    pipe.zadd(queue.started_job_registry.key, {execution.composite_key: lease_score(ttl_s)})
    if len(worker.queues) == 1:  # RQ pops through the intermediate list for one queue
        pipe.lrem(queue.intermediate_queue_key, 1, job.id)
    pipe.exists(keys.stop_key(job.id))


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
        worker: Any,
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
            worker_name=worker.name,
            serializer=job.serializer,
            execution_id=execution.id,
            execution_started_at=started_at,
            execution_ended_at=ended_at,
        )
        fields = [item for pair in result.serialize().items() for item in pair]
        answer = self.script(
            keys=[
                queue.started_job_registry.key,
                job.key,
                FinishedJobRegistry(queue.name, connection=job.connection).key,
                Result.get_key(job.id),
                job.dependents_key,
            ],
            args=[
                execution.composite_key,
                job.id,
                utcformat(ended_at),
                ttl,
                score,
                lease_score(lease_ttl_s),
                execution.id,
                *fields,
            ],
        )
        if int(answer) < 0:
            return None
        job._status = JobStatus.FINISHED
        return int(answer)
