"""Putting one job on its model's queue: RQ's job hash (what an RQ worker reads), the queue entry
and the job's "queued" event, written by one script in one round trip, only if the id is new and
the queue has room.

RQ's own unique enqueue takes three round trips for the same (register the queue in rq:queues,
the script, then our event); workers register their queues when they start instead.

Lifetimes: a queued job's hash and event stream expire QUEUED_TTL_S after it is queued (RQ's own
`ttl` field, "discard if not started in time"; RQ sets it again on every re-queue). A worker that
takes the job sets the hash's to running_ttl_s(timeout) (the stream's too, for a job that waited
over a day); its end sets the result or failure TTL on the hash. No key a job writes is left
without a lifetime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from api_client import events, keys
from api_client.errors import Problem, RequestRejected
from api_client.schema import JobEvent

if TYPE_CHECKING:
    from redis.commands.core import Script
    from rq.job import Job

RESULT_TTL_S = 7 * 24 * 3600  # an ended job's record: result, failure or cancel
QUEUED_TTL_S = 7 * 24 * 3600  # a job no worker takes within a week is dropped, events and all
# The most jobs one model's queue holds: a day of work at a few seconds a job. Past it, submit()
# refuses rather than let a runaway producer grow Redis without bound.
MAX_QUEUED = 10_000

ENQUEUE = """
-- KEYS: job hash, queue list, job events, queue events
-- ARGV: job id, "L" or "R", event body, job stream cap, queue stream MINID, queued TTL,
--       most jobs queued, field, value, ...
-- Returns the queued event's id; false when the id exists; the queue's length when it is full.
if redis.call("EXISTS", KEYS[1]) == 1 then
    return false
end
-- The push answers the queue's length: past the cap, take the id back out (no LLEN per job).
local push, pop = "RPUSH", "RPOP"
if ARGV[2] == "L" then
    push, pop = "LPUSH", "LPOP"
end
local length = redis.call(push, KEYS[2], ARGV[1])
if length > tonumber(ARGV[7]) then
    redis.call(pop, KEYS[2])
    return length - 1
end
redis.call("HSET", KEYS[1], unpack(ARGV, 8))
redis.call("EXPIRE", KEYS[1], ARGV[6])
local id = redis.call("XADD", KEYS[3], "MAXLEN", "~", ARGV[4], "*", "event", ARGV[3])
redis.call("EXPIRE", KEYS[3], ARGV[6])
redis.call("XADD", KEYS[4], "MINID", "~", ARGV[5], "*", "event", ARGV[3])
return id
"""


def running_ttl_s(timeout_s: float | None) -> int:
    """The lifetime a worker gives a job's hash and event stream when it takes the job: its run
    (at most its timeout) plus a queued lifetime, for a job whose worker dies under it and that
    waits to be recovered. Its end replaces it with the result TTL."""
    return int(timeout_s or 0) + QUEUED_TTL_S


def enqueue_new(
    script: Script,
    queue_key: str,
    job: Job,
    queued: JobEvent,
    at_front: bool,
    retention_s: float = events.EVENTS_RETENTION_S,
) -> str | None:
    """Save job (made by rq's Queue.create_job, with its `ttl` set) and push it on queue_key unless
    its id exists, with script (a connection's register_script(ENQUEUE)); the stream id of its
    queued event, or None when a job with that id was already there. RequestRejected, naming the
    model, when its queue holds MAX_QUEUED jobs already: nothing is written then."""
    fields: list[Any] = []
    for name, value in job.to_dict().items():
        if value is not None:  # as rq's own unique enqueue writes the hash
            fields += [name, value if isinstance(value, bytes | str) else str(value)]
    body = queued.model_dump_json(exclude={"id"}, exclude_none=True)
    streams = [keys.events_key(job.id), keys.queue_events_key(queued.model or "")]
    answer = script(
        keys=[job.key, queue_key, *streams],
        args=[
            job.id,
            "L" if at_front else "R",
            body,
            events.JOB_STREAM_MAXLEN,
            events.queue_minid(retention_s),
            job.ttl or QUEUED_TTL_S,
            MAX_QUEUED,
            *fields,
        ],
    )
    if answer is None:
        return None
    if isinstance(answer, int):
        rule = f"queue full: {answer} jobs waiting (at most {MAX_QUEUED}); submit again later"
        raise RequestRejected([Problem("model", queued.model, rule)], model=queued.model)
    return answer.decode() if isinstance(answer, bytes) else str(answer)
