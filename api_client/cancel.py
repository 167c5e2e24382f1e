"""Taking a queued job off its queue: one script that re-reads its status and, while it is still
queued, does what RQ's Job.cancel does (status canceled, out of its queue and registries, into
RQ's canceled registry) and ends its event stream, giving every key it touches a lifetime.

RQ 2.12 scores canceled-registry entries "now" and never cleans that registry (its clean-up
skips it), so rq:canceled:<queue> would only grow. Here an entry is scored by its expiry, as RQ's
other registries are: when the job hash expires. Each cancel drops the entries already past it,
and the registry itself expires with its newest entry.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from api_client import events, keys
from api_client.enqueue import RESULT_TTL_S
from api_client.schema import JobEvent

if TYPE_CHECKING:
    from redis import Redis

CANCELED_TTL_S = RESULT_TTL_S  # a canceled job's record is kept as long as a failed one's
CANCELABLE = ("queued", "deferred", "scheduled")

CANCEL = """
-- KEYS: job hash, queue list, canceled registry, deferred registry, scheduled registry,
--       job events, queue events
-- ARGV: job id, record TTL, now, expiry, event body, job stream cap, queue stream MINID,
--       events TTL
-- Returns the status the job had (false if it has no hash); only a queued one is canceled.
local status = redis.call("HGET", KEYS[1], "status")
if status ~= "queued" and status ~= "deferred" and status ~= "scheduled" then
    return status
end
redis.call("LREM", KEYS[2], 0, ARGV[1])
redis.call("ZREM", KEYS[4], ARGV[1])
redis.call("ZREM", KEYS[5], ARGV[1])
redis.call("HSET", KEYS[1], "status", "canceled")
redis.call("EXPIRE", KEYS[1], ARGV[2])
redis.call("ZREMRANGEBYSCORE", KEYS[3], "-inf", ARGV[3])
redis.call("ZADD", KEYS[3], ARGV[4], ARGV[1])
redis.call("EXPIRE", KEYS[3], ARGV[2])
redis.call("XADD", KEYS[6], "MAXLEN", "~", ARGV[6], "*", "event", ARGV[5])
redis.call("EXPIRE", KEYS[6], ARGV[8])
redis.call("XADD", KEYS[7], "MINID", "~", ARGV[7], "*", "event", ARGV[5])
return status
"""


def cancel_queued(
    connection: Redis,
    job_id: str,
    queue: str,
    retention_s: float = events.EVENTS_RETENTION_S,
) -> str | None:
    """Cancel job_id if it is still queued on queue (its origin, kiln:<model id>[:batch]), in one
    round trip; the status it had then (None if it no longer exists). Any other status is left as
    it is: a worker that took the job meanwhile finds its stop key."""
    model = keys.model_of(queue)
    stopped = JobEvent(
        kind="stopped", job_id=job_id, model=model, at=events.now(), error="canceled"
    )
    now = time.time()
    script = connection.register_script(CANCEL)
    answer = script(
        keys=[
            keys.rq_job_key(job_id),
            keys.rq_queue_key(queue),
            keys.RQ_CANCELED_PREFIX + queue,
            keys.RQ_DEFERRED_PREFIX + queue,
            keys.RQ_SCHEDULED_PREFIX + queue,
            keys.events_key(job_id),
            keys.queue_events_key(model),
        ],
        args=[
            job_id,
            CANCELED_TTL_S,
            now,
            now + CANCELED_TTL_S,
            stopped.model_dump_json(exclude={"id"}, exclude_none=True),
            events.JOB_STREAM_MAXLEN,
            events.queue_minid(retention_s),
            events.EVENTS_TTL_S,
        ],
    )
    if answer is None:
        return None
    return answer.decode() if isinstance(answer, bytes) else str(answer)
