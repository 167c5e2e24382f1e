"""Job events in Redis Streams: one capped stream per job (with a TTL) and one stream per model
queue trimmed by age, written by client (queued, canceled) and worker (the rest), read with XREAD
BLOCK.

The queue stream carries each job's lifecycle (queued, started, done, failed, stopped), not its
progress or previews: following a whole queue stays cheap, and a job costs fewer commands. Each
write to it trims it with XADD MINID ~ (now - retention), by the writer's clock (a skew of seconds
is noise against a day). `~` lets Redis drop whole stream nodes only, so the events of the one node
that straddles the cut (stream-node-max-entries 100 / max-bytes 4096 by default) outlive it a while:
a queue stream holds its retention's events and at most one node more, however busy the queue."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from api_client import keys
from api_client.schema import JobEvent, Progress

if TYPE_CHECKING:
    from redis import Redis

JOB_STREAM_MAXLEN = 200  # a job writes a few dozen events at most (progress is throttled)
EVENTS_RETENTION_S = 24 * 3600  # the queue streams' default (KILN_EVENTS_RETENTION_S)
EVENTS_TTL_S = 7 * 24 * 3600  # from the job's end, as long as its result is kept
BLOCK_SLICE_S = 2.0  # a blocking read wakes at least this often to check the job's status
FIELD = b"event"
QUEUE_KINDS = ("queued", "started", "done", "failed", "stopped")


def queue_minid(retention_s: float) -> str:
    """The oldest stream id a queue stream keeps: events older than retention_s are trimmed."""
    return str(max(int((time.time() - retention_s) * 1000), 0))


def add_events(
    pipe: Any,
    events: list[JobEvent],
    expire: bool = True,
    retention_s: float = EVENTS_RETENTION_S,
) -> None:
    """Queue XADDs for each event (job stream, and its model's stream for lifecycle events, that
    one trimmed to retention_s) and, with expire, set the job stream's TTL, on a pipeline the
    caller executes: one round trip. A stream lives as long as its job: it gets EVENTS_TTL_S when
    the job ends (worker, cancel, quarantine), as RQ sets the job hash's."""
    minid = queue_minid(retention_s)
    for event in events:
        body = event.model_dump_json(exclude={"id"}, exclude_none=True)
        pipe.xadd(keys.events_key(event.job_id), {FIELD: body}, maxlen=JOB_STREAM_MAXLEN)
        if event.model and event.kind in QUEUE_KINDS:
            pipe.xadd(
                keys.queue_events_key(event.model), {FIELD: body}, minid=minid, approximate=True
            )
    for job_id in {event.job_id for event in events} if expire else ():
        pipe.expire(keys.events_key(job_id), EVENTS_TTL_S)


def publish(conn: Redis, events: list[JobEvent], retention_s: float = EVENTS_RETENTION_S) -> None:
    """Write ended jobs' events in one round trip (see add_events)."""
    with conn.pipeline(transaction=False) as pipe:
        add_events(pipe, events, retention_s=retention_s)
        pipe.execute()


def now() -> float:
    return time.time()


def read(conn: Redis, key: str, after: str, block_s: float | None) -> list[JobEvent]:
    """Events after the stream id `after` ("0" for all); blocks up to block_s when none."""
    block = None if block_s is None else max(int(block_s * 1000), 1)
    answer: Any = conn.xread({key: after}, count=100, block=block)
    events: list[JobEvent] = []
    for _stream, entries in answer or []:
        for entry_id, fields in entries:
            event = JobEvent.model_validate_json(fields[FIELD])
            event.id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            events.append(event)
    return events


def latest_progress(conn: Redis, key: str, scan: int = 50) -> Progress | None:
    """The job's newest progress (with its newest preview's uri) since it last started or was
    queued again, from the tail of its stream; None when there is none. A done job is at the
    end of its decode (the worker writes no last progress event before `done`)."""
    found: JobEvent | None = None
    done: JobEvent | None = None
    preview: str | None = None
    answer: Any = conn.xrevrange(key, count=scan)
    for _entry_id, fields in answer or []:
        event = JobEvent.model_validate_json(fields[FIELD])
        if event.kind in ("queued", "started"):
            break
        if event.kind == "done" and found is None:
            done = event
        if event.kind == "preview" and preview is None and event.preview is not None:
            preview = event.preview.uri
        if event.kind == "progress" and found is None and done is None:
            found = event
    if done is not None and done.result is not None:
        steps = done.result.steps
        return Progress(phase="decode", step=steps, steps=steps, preview=preview)
    if found is None or found.phase is None:
        return None
    return Progress(
        phase=found.phase, step=found.step or 0, steps=found.steps or 0, preview=preview
    )


def follow(
    conn: Redis,
    key: str,
    after: str = "0",
    timeout: float | None = None,
    until_terminal: bool = True,
) -> Iterator[JobEvent]:
    """Yield events as they arrive; stop after a terminal one (until_terminal) or when timeout
    seconds pass without the stream ending. Resume later from the last event's id."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        remaining = BLOCK_SLICE_S if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            return
        for event in read(conn, key, after, min(remaining, BLOCK_SLICE_S)):
            after = event.id or after
            yield event
            if until_terminal and event.terminal:
                return
