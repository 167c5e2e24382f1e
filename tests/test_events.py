"""Job events: a capped Redis stream per job and per model queue, followed with XREAD BLOCK."""

from __future__ import annotations

import threading
import time
from typing import Any

from redis import Redis

from api_client import keys
from api_client.events import EVENTS_TTL_S
from tests.fixtures.gate import hold_here
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import enqueue_raw
from tests.workers import wait_until
from worker.queue.events import PROGRESS_INTERVAL_S

REQUEST = {"model": "tiny-sd15", "prompt": "a heron", "steps": 8, "seed": 2}


def test_events_tell_a_jobs_life_resume_from_an_id_and_follow_the_queue(
    redis_conn: Redis, settings: Any, monkeypatch: Any
) -> None:
    client = client_for(redis_conn, settings)
    job = client.submit({**REQUEST, "previews": True})
    other = client.submit({**REQUEST, "seed": 3})
    # The first job waits at its step 2 until that progress is in its stream.
    hold_here(monkeypatch, lambda step: job.progress() is not None)
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])

    seen = list(job.events(timeout=5))
    kinds = [e.kind for e in seen]
    assert kinds[:2] == ["queued", "started"] and kinds[-1] == "done", kinds
    assert kinds.count("preview") == 3 and "progress" in kinds
    assert all(e.job_id == job.id and e.model == "tiny-sd15" and e.id for e in seen)
    preview = next(e.preview for e in seen if e.preview is not None)
    assert preview.uri.startswith("file://") and (preview.jpeg() or b"")[:2] == b"\xff\xd8"
    assert seen[-1].result == job.wait(timeout=1)
    # Resumable: from an event's id, the events after it, nothing twice.
    assert [e.id for e in job.events(after=seen[2].id or "", timeout=5)] == [e.id for e in seen[3:]]
    assert 0 < redis_conn.ttl(keys.events_key(job.id)) <= EVENTS_TTL_S

    # One place for a whole queue: both jobs' events, interleaved in the order they happened.
    queue = list(client.queue_events("tiny-sd15", after="0", timeout=0.5))
    assert {e.job_id for e in queue} == {job.id, other.id}
    assert [e.id for e in queue if e.job_id == job.id] != []
    assert [e.kind for e in queue if e.job_id == other.id][-1] == "done"


def test_wait_wakes_on_the_done_event_not_on_a_poll(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    renderer = make_renderer(settings, ["tiny-sd15"])
    job = client.submit(REQUEST)
    returned: list[float] = []
    # poll=30: a loop that slept between status reads would not return for 30 s.
    waiter = threading.Thread(
        target=lambda: (job.wait(timeout=60, poll=30), returned.append(time.monotonic()))
    )
    waiter.start()
    wait_until(lambda: blocked_in_xread(redis_conn), 10, "the waiter to block in XREAD")
    burst(redis_conn, renderer, ["tiny-sd15"])
    ended = time.monotonic()
    waiter.join(timeout=40)
    assert returned and returned[0] - ended < 1.0, returned


def blocked_in_xread(conn: Redis) -> bool:
    """Some connection is blocked in XREAD (CLIENT LIST: cmd=xread, flag b)."""
    clients: list[dict[str, Any]] = conn.client_list()
    return any(c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in clients)


def test_refused_and_canceled_jobs_end_with_an_event(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    refused = enqueue_raw(redis_conn, "tiny-sd15", {"request": {"model": "tiny-sd15"}})
    canceled = client.submit(REQUEST)
    canceled.cancel()
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])

    [*_, failed] = client.job(refused).events(timeout=5)
    assert failed.kind == "failed" and failed.error and "prompt" in failed.error
    [queued, stopped] = canceled.events(timeout=5)
    assert (queued.kind, stopped.kind, stopped.error) == ("queued", "stopped", "canceled")


def test_events_cost_a_few_commands_not_one_per_step(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    renderer = make_renderer(settings, ["tiny-sd15"])
    client.submit({**REQUEST, "steps": 2})  # load outside the measurement
    burst(redis_conn, renderer, ["tiny-sd15"])
    redis_conn.config_resetstat()
    job = client.submit({**REQUEST, "steps": 20})
    burst(redis_conn, renderer, ["tiny-sd15"])
    stats = redis_conn.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): s["calls"] for name, s in stats.items()}
    events = list(job.events(timeout=5))
    lifecycle = [e for e in events if e.kind in ("queued", "started", "done")]
    progress = [e for e in events if e.kind == "progress"]
    # Each event once, lifecycle events twice (the queue's stream), and RQ's results stream once.
    assert calls["xadd"] == len(events) + len(lifecycle) + 1
    seconds = job.wait(timeout=1).timings.total
    assert len(progress) <= seconds / PROGRESS_INTERVAL_S + 3, (len(progress), seconds)
    print(
        f"\n20-step job in {seconds:.1f} s: {len(events)} events ({len(progress)} progress), "
        f"{calls['xadd']} XADD; {sum(calls.values())} Redis commands in all (RQ, kiln, client)"
    )
