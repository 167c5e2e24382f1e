"""One reader for every event stream a gateway serves: each SSE watcher registers the job
stream it follows, and a single task blocks in one XREAD over all of them on one connection and
hands each entry to that stream's watchers. A thousand watchers cost one blocked connection plus
the small pool their catch-up reads share (and, as they connect, the gateway's bounded pool of
synchronous connections for their token and ownership checks), not a thousand.

Nothing lost, nothing repeated: a watcher reads what its stream holds after its Last-Event-ID
(XRANGE, exclusive), registers, then reads once more, so an entry written between the first read
and the registration is in the second; every entry it is offered is passed on only if its id is
past the last one it sent. A new stream wakes the blocked XREAD with CLIENT UNBLOCK so its entries
need not wait out the block; where an ACL forbids that, the block's timeout picks it up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from api_client import events
from api_client.schema import JobEvent

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger("kiln.api")
BLOCK_MS = 1000  # how long the reader blocks before it looks at the watcher set again
RANGE_COUNT = 500  # entries per catch-up read (a job's stream is capped well below this)
QUEUE_MAX = 1000  # events buffered for one slow watcher before it is cut off


def stream_id(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq or 0)


def entry_id(position: tuple[int, int]) -> str:
    return f"{position[0]}-{position[1]}"


class Watcher:
    def __init__(self, after: str) -> None:
        self.last = stream_id(after)
        self.queue: asyncio.Queue[JobEvent | None] = asyncio.Queue(QUEUE_MAX)

    def offer(self, event: JobEvent) -> None:
        position = stream_id(event.id or "0")
        if position <= self.last:
            return
        self.last = position
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.queue = asyncio.Queue(1)  # drop its backlog; the watcher ends and reconnects
            self.queue.put_nowait(None)


class EventHub:
    def __init__(self, pool: Redis, reader: Redis) -> None:
        """pool: shared connections for catch-up reads; reader: one dedicated connection for the
        blocking XREAD."""
        self.pool, self.reader = pool, reader
        self.watchers: dict[str, set[Watcher]] = {}
        self.cursors: dict[str, str] = {}
        self.changed = asyncio.Event()
        self.reader_id: int | None = None
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._read_forever())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    @property
    def watching(self) -> int:
        return sum(len(w) for w in self.watchers.values())

    async def watch(
        self, key: str, after: str, keepalive_s: float
    ) -> AsyncIterator[JobEvent | None]:
        """The stream's events after `after`, ending after a terminal one; None every
        keepalive_s without one (the caller sends a comment then, and may check the job)."""
        watcher = Watcher(after)
        for event in await self._range(key, after):
            yield event
            watcher.last = stream_id(event.id or after)
            if event.terminal:
                return
        self._register(key, watcher)
        try:
            for event in await self._range(key, entry_id(watcher.last)):
                watcher.offer(event)
            while True:
                try:
                    offered: JobEvent | None = await asyncio.wait_for(
                        watcher.queue.get(), keepalive_s
                    )
                except asyncio.TimeoutError:
                    yield None
                    continue
                if offered is None:
                    return  # too slow to keep up: cut off, the client resumes by its last id
                yield offered
                if offered.terminal:
                    return
        finally:
            self._unregister(key, watcher)

    async def _range(self, key: str, after: str) -> list[JobEvent]:
        found: list[JobEvent] = []
        start = "-" if after == "0" else f"({after}"
        while True:
            entries: Any = await self.pool.xrange(key, min=start, count=RANGE_COUNT)
            for entry_id, fields in entries:
                event = _event(entry_id, fields)
                if event is not None:
                    found.append(event)
            if len(entries) < RANGE_COUNT:
                return found
            last = entries[-1][0]
            start = f"({last.decode() if isinstance(last, bytes) else last}"

    def _register(self, key: str, watcher: Watcher) -> None:
        new = key not in self.watchers
        self.watchers.setdefault(key, set()).add(watcher)
        if new:
            self.cursors[key] = entry_id(watcher.last)
            self.changed.set()
            asyncio.get_running_loop().create_task(self._wake())

    def _unregister(self, key: str, watcher: Watcher) -> None:
        watching = self.watchers.get(key)
        if watching is None:
            return
        watching.discard(watcher)
        if not watching:
            del self.watchers[key]
            self.cursors.pop(key, None)

    async def _wake(self) -> None:
        """Unblock the reader's XREAD so it reads again with the new stream in it."""
        if self.reader_id is None:
            return
        with contextlib.suppress(Exception):
            await self.pool.client_unblock(self.reader_id)

    async def _read_forever(self) -> None:
        while True:
            if not self.watchers:
                self.changed.clear()
                await self.changed.wait()
                continue
            streams: dict[Any, Any] = dict(self.cursors)
            try:
                if self.reader_id is None:
                    self.reader_id = int(await self.reader.client_id())
                answer: Any = await self.reader.xread(streams, count=100, block=BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the watchers wait, the reader retries
                log.warning("event reader: %s; retrying in 1 s", exc)
                self.reader_id = None
                await asyncio.sleep(1.0)
                continue
            for raw_key, entries in answer or []:
                key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
                for entry_id, fields in entries:
                    event = _event(entry_id, fields)
                    if key in self.cursors:
                        self.cursors[key] = _text(entry_id)
                    if event is None:
                        continue
                    for watcher in list(self.watchers.get(key, ())):
                        watcher.offer(event)


def _event(entry_id: Any, fields: Any) -> JobEvent | None:
    """The entry as a JobEvent; None for one that is not (anyone with write access to Redis may
    have put anything there, and one bad entry must not stop every watcher)."""
    try:
        event = JobEvent.model_validate_json(fields[events.FIELD])
    except (KeyError, ValueError):
        log.warning("skipping unreadable event %s", _text(entry_id))
        return None
    event.id = _text(entry_id)
    return event


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
