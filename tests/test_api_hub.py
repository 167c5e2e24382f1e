"""The gateway's event hub on a real Redis, in-process: many watchers share one blocked reader,
a resume after any event id loses and repeats nothing while the stream is being written, a quiet
stream yields keepalives, and an unreadable entry is skipped, not fatal."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis import Redis

from api_client import events, keys
from api_client.connection import connect_async
from api_client.http.hub import EventHub
from api_client.schema import JobEvent


def add(conn: Redis, job_id: str, kind: str, step: int = 0) -> str:
    event = JobEvent(kind=kind, job_id=job_id, at=time.time(), step=step)  # type: ignore[arg-type]
    entry = conn.xadd(keys.events_key(job_id), {events.FIELD: event.model_dump_json()})
    return entry.decode() if isinstance(entry, bytes) else str(entry)


async def collect(hub: EventHub, job_id: str, after: str, keepalive_s: float = 30) -> list[Any]:
    return [e async for e in hub.watch(keys.events_key(job_id), after, keepalive_s)]


def run_hub(redis_url: str, body: Any) -> Any:
    async def main() -> Any:
        hub = EventHub(
            connect_async(redis_url, 4), connect_async(redis_url, 1, socket_timeout=None)
        )
        hub.start()
        try:
            return await body(hub)
        finally:
            await hub.stop()
            await hub.pool.aclose()
            await hub.reader.aclose()

    return asyncio.run(main())


def test_watchers_resuming_anywhere_get_the_rest_exactly_once(
    redis_url: str, redis_conn: Redis
) -> None:
    jobs = [f"hub-{n}" for n in range(20)]
    first = {job: add(redis_conn, job, "queued") for job in jobs}

    async def body(hub: EventHub) -> dict[str, list[list[str]]]:
        # Three watchers a job: from the start, after the queued event, and one that joins late.
        watchers = {
            job: [
                asyncio.create_task(collect(hub, job, "0")),
                asyncio.create_task(collect(hub, job, first[job])),
            ]
            for job in jobs
        }
        await asyncio.sleep(0.2)
        for step in range(1, 6):
            for job in jobs:
                await asyncio.to_thread(add, redis_conn, job, "progress", step)
            if step == 3:
                for job in jobs:
                    watchers[job].append(asyncio.create_task(collect(hub, job, "0")))
        for job in jobs:
            await asyncio.to_thread(add, redis_conn, job, "done", 6)
        seen = {}
        for job, tasks in watchers.items():
            done = await asyncio.wait_for(asyncio.gather(*tasks), 20)
            seen[job] = [[e.id for e in events_] for events_ in done]
        assert hub.watching == 0 and not hub.cursors  # every watcher left, the hub forgot them
        return seen

    seen = run_hub(redis_url, body)
    for job in jobs:
        stream = [entry_id.decode() for entry_id, _ in redis_conn.xrange(keys.events_key(job))]
        assert len(stream) == 7
        from_start, after_queued, late = seen[job]
        assert from_start == stream and late == stream, job
        assert after_queued == stream[1:], job


def test_many_watchers_share_a_few_connections(redis_url: str, redis_conn: Redis) -> None:
    def connections() -> int:
        return len(redis_conn.client_list())

    before = connections()

    async def body(hub: EventHub) -> tuple[int, int]:
        tasks = [asyncio.create_task(collect(hub, f"many-{n % 50}", "0")) for n in range(300)]
        await asyncio.sleep(1.0)
        during = await asyncio.to_thread(connections)
        for n in range(50):
            await asyncio.to_thread(add, redis_conn, f"many-{n}", "done")
        done = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        return during, sum(len(d) for d in done)

    during, delivered = run_hub(redis_url, body)
    assert delivered == 300  # each watcher its job's one event
    assert during - before <= 5, (before, during)  # the pool of 4 and the reader, not 300


def test_a_quiet_stream_keeps_alive_and_a_bad_entry_is_skipped(
    redis_url: str, redis_conn: Redis
) -> None:
    redis_conn.xadd(keys.events_key("quiet"), {events.FIELD: b"not json"})
    good = add(redis_conn, "quiet", "queued")

    async def body(hub: EventHub) -> list[Any]:
        got: list[Any] = []

        async def watch() -> None:
            async for event in hub.watch(keys.events_key("quiet"), "0", 0.2):
                got.append(event)
                if len(got) == 3:
                    await asyncio.to_thread(
                        redis_conn.xadd, keys.events_key("quiet"), {events.FIELD: b"{}"}
                    )
                    await asyncio.to_thread(add, redis_conn, "quiet", "failed")

        await asyncio.wait_for(watch(), 20)
        return got

    got = run_hub(redis_url, body)
    assert got[0].id == good and got[1] is None and got[2] is None, got
    assert got[-1].kind == "failed" and all(e is None or e.kind for e in got)
