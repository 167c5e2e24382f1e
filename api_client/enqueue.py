"""Putting one job on its model's queue: RQ's job hash (what an RQ worker reads), the queue entry
and the job's "queued" event, written by one script in one round trip, only if the id is new.

RQ's own unique enqueue takes three round trips for the same (register the queue in rq:queues,
the script, then our event); workers register their queues when they start instead.
"""

from __future__ import annotations

from typing import Any

from redis.commands.core import Script
from rq.job import Job

from api_client import events, keys
from api_client.schema import JobEvent

ENQUEUE = """
-- KEYS: job hash, queue list, job events, queue events
-- ARGV: job id, "L" or "R", event body, job stream cap, queue stream cap, field, value, ...
if redis.call("EXISTS", KEYS[1]) == 1 then
    return false
end
redis.call("HSET", KEYS[1], unpack(ARGV, 6))
if ARGV[2] == "L" then
    redis.call("LPUSH", KEYS[2], ARGV[1])
else
    redis.call("RPUSH", KEYS[2], ARGV[1])
end
local id = redis.call("XADD", KEYS[3], "MAXLEN", "~", ARGV[4], "*", "event", ARGV[3])
redis.call("XADD", KEYS[4], "MAXLEN", "~", ARGV[5], "*", "event", ARGV[3])
return id
"""


def enqueue_new(
    script: Script, queue_key: str, job: Job, queued: JobEvent, at_front: bool
) -> str | None:
    """Save job (made by rq's Queue.create_job) and push it on queue_key unless its id exists,
    with script (a connection's register_script(ENQUEUE)); the stream id of its queued event,
    or None when a job with that id was already there."""
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
            events.QUEUE_STREAM_MAXLEN,
            *fields,
        ],
    )
    if answer is None:
        return None
    return answer.decode() if isinstance(answer, bytes) else str(answer)
