"""Job records kiln cannot read, moved aside so that no record a client writes can stop a worker.

Anyone with the client ACL can write a job hash straight into Redis. rq raises while reading a
hash whose `status`, dates, numbers or JSON lists are garbage, and its work loop quits on that:
the id stays in the queue's intermediate list and kills the next worker in its start-up clean-up
too. kiln reads every record through `unreadable()` first. A record it cannot read is summarised
into the quarantine (every field cut to ECHO_LIMIT characters, the reason, the time, the queue),
its hash is deleted and its id taken off the worker's queue lists, so rq never sees it again.

Redis: QUARANTINE_KEY, a hash of job id -> entry JSON; QUARANTINE_ORDER_KEY, a sorted set of job id
-> time quarantined. At most QUARANTINE_MAX entries are kept; the oldest go first.
`kiln quarantine` lists the entries and `kiln quarantine --clear ID` drops one (or all).
"""

from __future__ import annotations

import json
import logging
import sys
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from redis import Redis
from redis.exceptions import ResponseError
from rq.exceptions import NoSuchJobError
from rq.job import JOB_ID_PATTERN, Job, JobStatus
from rq.queue import Queue
from rq.utils import str_to_date

from api_client import events, keys
from api_client.client import MAX_JOB_ID_CHARS
from api_client.errors import short
from api_client.schema import JobEvent
from api_client.webhooks import MAX_DATA_BYTES, job_webhook_target, queue_webhook

log = logging.getLogger(__name__)
QUARANTINE_MAX = 1000
KEY_ASIDE_PREFIX = "kiln:quarantine:key:"  # a key of the wrong type, renamed here
KEY_ASIDE_TTL_S = 7 * 24 * 3600
MAX_FIELDS = 40  # fields summarised per record; a hash of thousands of fields is cut here

_DATES = ("created_at", "enqueued_at", "started_at", "ended_at", "last_heartbeat")
_INTS = (
    "timeout",
    "result_ttl",
    "failure_ttl",
    "ttl",
    "number_of_retries",
    "retries_left",
    "repeats_left",
    "success_callback_timeout",
    "failure_callback_timeout",
    "stopped_callback_timeout",
)
_FLAGS = ("allow_dependency_failures", "enqueue_at_front", "enqueue_at_front_on_retry")
_TEXTS = (
    "origin",
    "description",
    "worker_name",
    "group_id",
    "dependency_id",
    "success_callback_name",
    "failure_callback_name",
    "stopped_callback_name",
)
_INTERVALS = ("retry_intervals", "repeat_intervals")


class UnreadableJob(NoSuchJobError):
    """A job record kiln could not read; it has been moved into the quarantine. A NoSuchJobError,
    so rq's own loops (dequeue, registry and intermediate clean-ups) skip it and go on."""


@dataclass(frozen=True)
class Entry:
    """One quarantined record: why, when, from which queue, and its fields cut short."""

    job_id: str
    reason: str
    at: float
    queue: str | None = None
    fields: dict[str, str] = field(default_factory=dict)


def unreadable(raw: dict[bytes, bytes], job_id: str | None = None) -> list[str]:
    """Every reason kiln cannot read this job hash, each naming its field; [] when it can.

    Checks what rq's Job.restore parses (and raises on) plus the shapes kiln relies on later:
    data a JSON [func, instance, args, kwargs], intervals lists of seconds. Not meta: rq's own
    tools rewrite it in their serializer (`rq requeue` writes pickle), and kiln keeps only a
    failure's reason there, so RenderJob drops an unreadable meta instead (unreadable_meta).
    """
    fields = {_text(k): v for k, v in raw.items()}
    problems = [_data_problem(fields.get("data"))]
    if job_id is not None and not valid_id(job_id):
        problems.append(f"id: longer than {MAX_JOB_ID_CHARS} characters ({len(job_id)})")
    checks: list[tuple[Iterable[str], Callable[[bytes], object]]] = [
        (("status",), lambda v: JobStatus(v.decode())),
        (_DATES, str_to_date),
        (_INTS, lambda v: int(v)),
        (_FLAGS, lambda v: bool(int(v))),
        (_TEXTS, lambda v: v.decode()),
        (("dependency_ids",), lambda v: _json_list(v, str)),
        (_INTERVALS, lambda v: _json_list(v, int)),
    ]
    for names, check in checks:
        for name in names:
            value = fields.get(name)
            if not value:  # rq reads a missing or empty field as its default
                continue
            try:
                check(value)
            except Exception as exc:
                problems.append(f"{name}={short(_shown(value))!r}: {short(_why(exc))}")
    return [p for p in problems if p]


def _data_problem(data: bytes | None) -> str:
    if data is None:
        return "data: missing"
    inflated = _inflate(data)
    if inflated is None:
        return (
            f"data: inflates past {MAX_DATA_BYTES // 2**20} MiB (MAX_DATA_BYTES), more than any"
            " request kiln takes"
        )
    try:
        payload = json.loads(inflated.decode("utf-8"))
    except RecursionError:
        limit = sys.getrecursionlimit()
        return f"data: JSON nested too deep to read (the reader's bound: under {limit} levels)"
    except Exception as exc:
        return f"data: not JSON ({short(_why(exc))})"
    if not (isinstance(payload, list) and len(payload) == 4):
        return f"data: must be a JSON list [func, instance, args, kwargs], got {_kind(payload)}"
    return ""


def _inflate(data: bytes) -> bytes | None:
    """data as rq reads it (zlib-compressed, or not), inflated at most to MAX_DATA_BYTES: None
    past it, before rq's own unbounded zlib.decompress would hold a bomb's whole output."""
    inflater = zlib.decompressobj()
    try:
        inflated = inflater.decompress(data, MAX_DATA_BYTES)
    except zlib.error:
        return data
    return None if inflater.unconsumed_tail else inflated


def _json_list(value: bytes, kind: type) -> list[Any]:
    items = json.loads(value.decode())
    if not isinstance(items, list) or not all(
        isinstance(i, kind) and not isinstance(i, bool) for i in items
    ):
        raise ValueError(f"must be a JSON list of {kind.__name__}")
    if kind is int and any(i < 0 for i in items):
        raise ValueError("must not be negative")
    return items


def unreadable_meta(raw: dict[bytes, bytes]) -> str | None:
    """Why the hash's meta is not a JSON object (never unpickled, never imported); None if it is
    one or there is none."""
    value = raw.get(b"meta")
    if not value:
        return None
    try:
        meta = json.loads(value.decode())
    except Exception as exc:
        return f"meta={short(_shown(value))!r}: {short(_why(exc))}"
    return None if isinstance(meta, dict) else f"meta: must be a JSON object, got {_kind(meta)}"


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _shown(value: bytes) -> str:
    return value.decode("utf-8", errors="replace")


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def valid_id(job_id: str) -> bool:
    """An id kiln can echo and name a directory with: rq's characters, MAX_JOB_ID_CHARS at most."""
    return len(job_id) <= MAX_JOB_ID_CHARS and _keyable(job_id)


def _keyable(job_id: str) -> bool:
    return bool(JOB_ID_PATTERN.fullmatch(job_id))


def move_aside(
    conn: Redis, job_id: str, reasons: list[str], queue_keys: Iterable[str] = ()
) -> Entry:
    """Summarise the record into the quarantine, delete its hash, take its id off these queues
    (and their intermediate lists) and trim the quarantine to QUARANTINE_MAX entries."""
    raw = cast(dict[bytes, bytes], conn.hgetall(Job.key_for(job_id)) if _keyable(job_id) else {})
    summary = {short(_text(k), 60): short(_shown(v)) for k, v in list(raw.items())[:MAX_FIELDS]}
    origin = _text(raw.get(b"origin", b""))
    if origin.startswith(keys.QUEUE_PREFIX):
        queue_keys = [*queue_keys, f"{Queue.redis_queue_namespace_prefix}{origin}"]
    entry = Entry(
        job_id=short(job_id),
        reason=short("; ".join(reasons), 1000),
        at=time.time(),
        queue=short(origin) or None,
        fields=summary,
    )
    with conn.pipeline() as pipe:
        pipe.hset(keys.QUARANTINE_KEY, entry.job_id, json.dumps(entry.__dict__))
        pipe.zadd(keys.QUARANTINE_ORDER_KEY, {entry.job_id: entry.at})
        if _keyable(job_id):
            pipe.delete(Job.key_for(job_id))
            # Its event stream gets its TTL when a job ends; this one ends here.
            pipe.expire(keys.events_key(job_id), events.EVENTS_TTL_S)
        for key in queue_keys:
            pipe.lrem(key, 0, job_id)
            pipe.lrem(f"{key}:intermediate", 0, job_id)
        if valid_id(job_id):  # its end goes to the webhook its request named, if any
            failed = JobEvent(
                kind="failed",
                job_id=job_id,
                model=keys.model_of(origin) or None,
                at=events.now(),
                error=short(f"quarantined: {entry.reason}", 1000),
            )
            queue_webhook(pipe, job_webhook_target(raw.get(b"data")), failed)
        pipe.execute()
    _trim(conn)
    log.error("job %s quarantined: %s", entry.job_id, entry.reason)
    return entry


def if_unreadable(conn: Redis, job_id: str, reason: str, queue_keys: Iterable[str] = ()) -> bool:
    """Move the record aside when it is no job id, or a hash kiln cannot read (each reason);
    reason: what is said of an id that is no job id. True when it was moved."""
    if not valid_id(job_id):
        move_aside(conn, job_id, [reason], queue_keys)
        return True
    raw = cast(dict[bytes, bytes], conn.hgetall(Job.key_for(job_id)))
    problems = unreadable(raw, job_id) if raw else []
    if problems:
        move_aside(conn, job_id, problems, queue_keys)
    return bool(problems)


def note_killer(conn: Redis, job_id: str, reason: str, queue: str | None) -> Entry:
    """An entry for a record kiln can read whose runs kept ending with their worker dead (an
    OOM kill, a segfault). The record stays where rq puts it (failed); only the entry is added."""
    entry = Entry(job_id=short(job_id), reason=short(reason, 1000), at=time.time(), queue=queue)
    with conn.pipeline() as pipe:
        pipe.hset(keys.QUARANTINE_KEY, entry.job_id, json.dumps(entry.__dict__))
        pipe.zadd(keys.QUARANTINE_ORDER_KEY, {entry.job_id: entry.at})
        pipe.execute()
    _trim(conn)
    log.error("job %s quarantined: %s", entry.job_id, entry.reason)
    return entry


def wrong_type(exc: BaseException) -> bool:
    """Redis refused a command because a key holds another type than the command's (a client
    with the kiln-client ACL may SET a queue or a job's event stream to a string)."""
    return isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc)


def repair_types(conn: Redis, expected: dict[str, str]) -> list[str]:
    """Move aside every one of these keys whose type is not the one kiln keeps there (a missing
    key is fine); the keys moved. One TYPE per key, in one round trip."""
    names = list(expected)
    with conn.pipeline(transaction=False) as pipe:
        for key in names:
            pipe.type(key)
        found = [_text(kind) for kind in pipe.execute()]
    moved = []
    for key, kind in zip(names, found, strict=True):
        if kind not in ("none", expected[key]):
            move_key_aside(conn, key, f"held a {kind}; kiln keeps a {expected[key]} there")
            moved.append(key)
    return moved


def move_key_aside(conn: Redis, key: str, reason: str) -> Entry:
    """Rename a key kiln cannot use to KEY_ASIDE_PREFIX + key (kept KEY_ASIDE_TTL_S for the
    operator to read) and note it in the quarantine as `key:<key>`, the way a bad job record
    is moved aside, so that no key a client writes can stop a worker."""
    aside = f"{KEY_ASIDE_PREFIX}{key}"
    entry = Entry(
        job_id=short(f"key:{key}"),
        reason=short(f"{reason}: moved to {aside}", 1000),
        at=time.time(),
        fields={"moved_to": short(aside)},
    )
    with conn.pipeline() as pipe:
        pipe.rename(key, aside)
        pipe.expire(aside, KEY_ASIDE_TTL_S)
        pipe.hset(keys.QUARANTINE_KEY, entry.job_id, json.dumps(entry.__dict__))
        pipe.zadd(keys.QUARANTINE_ORDER_KEY, {entry.job_id: entry.at})
        try:
            pipe.execute()
        except ResponseError as exc:  # gone, or moved by another worker, since its TYPE
            log.warning("could not move key %s aside: %s", short(key), exc)
            return entry
    _trim(conn)
    log.error("key %s quarantined: %s", short(key), entry.reason)
    return entry


def _trim(conn: Redis) -> None:
    excess = conn.zcard(keys.QUARANTINE_ORDER_KEY) - QUARANTINE_MAX
    if excess <= 0:
        return
    oldest = cast(list[bytes], conn.zrange(keys.QUARANTINE_ORDER_KEY, 0, excess - 1))
    with conn.pipeline() as pipe:
        pipe.hdel(keys.QUARANTINE_KEY, *oldest)
        pipe.zrem(keys.QUARANTINE_ORDER_KEY, *oldest)
        pipe.execute()


def entries(conn: Redis) -> list[Entry]:
    """Quarantined records, oldest first."""
    ids = cast(list[bytes], conn.zrange(keys.QUARANTINE_ORDER_KEY, 0, -1))
    raws = conn.hmget(keys.QUARANTINE_KEY, ids) if ids else []
    found = []
    for raw in raws:
        if raw:
            data = json.loads(raw)
            found.append(Entry(**data))
    return found


def clear(conn: Redis, job_id: str | None = None) -> int:
    """Drop one entry (or all, with None); how many were dropped."""
    if job_id is None:
        count = int(conn.zcard(keys.QUARANTINE_ORDER_KEY))
        conn.delete(keys.QUARANTINE_KEY, keys.QUARANTINE_ORDER_KEY)
        return count
    with conn.pipeline() as pipe:
        pipe.hdel(keys.QUARANTINE_KEY, job_id)
        pipe.zrem(keys.QUARANTINE_ORDER_KEY, job_id)
        dropped, _ = pipe.execute()
    return int(dropped)


def sweep(conn: Redis, queue_key: str, registry_key: str, now: float) -> None:
    """Ids rq's clean-ups would choke on before reading any record (not job ids at all): the
    intermediate list's and the started registry's expired entries, moved aside first."""
    for raw in cast(list[bytes], conn.lrange(f"{queue_key}:intermediate", 0, -1)):
        job_id = _text(raw)
        if not valid_id(job_id):
            move_aside(conn, job_id, ["id: not a job id (or too long)"], [queue_key])
    for raw in cast(list[bytes], conn.zrangebyscore(registry_key, 0, now)):
        member = _text(raw)
        if not valid_id(member.split(":")[0]):
            conn.zrem(registry_key, raw)
            move_aside(conn, member, ["id: not a job id (in the started registry)"])


def command(conn: Redis, clear_id: str | None, as_json: bool) -> int:
    """`kiln quarantine [--clear ID] [--json]`: list the entries, oldest first, or drop one."""
    if clear_id is not None:
        dropped = clear(conn, None if clear_id == "all" else clear_id)
        print(f"dropped {dropped} quarantine entr{'y' if dropped == 1 else 'ies'}")
        return 0 if dropped or clear_id == "all" else 1
    found = entries(conn)
    for entry in found:
        if as_json:
            print(json.dumps(entry.__dict__))
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry.at))
        print(f"{when}Z  {entry.job_id}  {entry.queue or '-'}  {entry.reason}")
    if not as_json:
        print(f"{len(found)} quarantined job record{'' if len(found) == 1 else 's'}")
    return 0
