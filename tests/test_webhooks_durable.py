"""Durable webhooks, at least once: a receiver down for "10 minutes" (the default schedule and the
outage both scaled 1000 times down, never the rule), dead letters listed and resent by
`kiln webhooks`, the per-target bound, a sender that stops leaving its deliveries in Redis, and a
job's end written with its delivery in one commit by a real worker. A sender that dies with a
delivery taken: tests/test_webhooks.py (crash@webhook, real worker processes)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from typing import Any

import pytest
from redis import Redis
from standardwebhooks import Webhook

from api_client.schema import JobEvent
from api_client.webhooks import (
    OUTBOX_MAX,
    REFUSED,
    OutboxEntry,
    outbox_key,
    queue_webhook,
    verify_webhook,
)
from tests.conftest import ROOT
from tests.support.inprocess import burst
from tests.support.receivers import SECRET, HookServer, job_event, published, sender, targets
from tests.support.records import enqueue_raw
from tests.workers import free_port, wait_until
from worker.queue.upkeep.webhooks import delivery_id
from worker.settings import Settings

REQUEST = {"model": "tiny-sd15", "prompt": "a heron", "steps": 2, "seed": 3}
SCALE = 1000  # seconds of the schedule and of the outage per second of this test


def _entry(conn: Redis, msg_id: str) -> OutboxEntry:
    return OutboxEntry.model_validate_json(
        conn.hget(outbox_key("studio", "entries"), msg_id) or b""
    )


def _kiln(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "webhooks", *args],
        env={"PATH": "/usr/bin:/bin", "KILN_REDIS_URL": redis_url},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_receiver_down_for_ten_minutes_then_up_gets_every_delivery(redis_conn: Redis) -> None:
    # The default schedule, 1000 times faster: tries at 0, 5, 65, 365 and 2165 s, so a receiver
    # that answers 503 for 600 s (a deploy) gets its 2xx try at 2165 s (2.2 s here).
    schedule = tuple(s / SCALE for s in Settings().webhook_retries)
    assert Settings().webhook_retries == (5, 60, 300, 1800, 7200, 21600)
    hooks = HookServer()
    hooks.status, hooks.answer = 503, b"deploying"
    hooks.start()
    dispatcher = sender(redis_conn, hooks.url, retries=schedule)
    jobs = [f"job-outage-{n}" for n in range(5)]
    try:
        for job in jobs:
            assert queue_webhook(redis_conn, "studio", job_event(job))
        dispatcher.start()
        down_until = time.monotonic() + 600 / SCALE
        wait_until(lambda: time.monotonic() >= down_until, 5, "the outage's 10 minutes")
        hooks.status = 204
        wait_until(lambda: len(hooks.delivered()) >= len(jobs), 30, "every delivery after it")
        wait_until(lambda: dispatcher.pending() == 0, 10, "every delivery settled")
    finally:
        dispatcher.close()
        hooks.stop()
    by_id: dict[str, list[int]] = {}
    for request in hooks.received:
        event = verify_webhook(SECRET, request.body, request.headers)  # every try is signed
        Webhook(SECRET).verify(request.body, request.headers)
        assert request.headers["webhook-id"] == delivery_id(event)  # the same id on every try
        by_id.setdefault(request.headers["webhook-id"], []).append(request.status)
    assert set(by_id) == {delivery_id(job_event(job)) for job in jobs}
    for statuses in by_id.values():
        # Refused while down (tries at 0, 5, 65 and 365 s), then delivered once.
        assert statuses[-1] == 204 and statuses.count(204) == 1, statuses
        assert len(statuses) >= 4, statuses
    assert redis_conn.keys("kiln:webhooks:studio:*") == []


def test_after_its_last_try_a_delivery_is_a_dead_letter_that_kiln_webhooks_lists_and_resends(
    redis_conn: Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="worker.queue.upkeep.webhooks")
    hooks = HookServer()
    hooks.status, hooks.answer = 503, b"upstream down for maintenance"
    hooks.start()
    dispatcher = sender(redis_conn, hooks.url, retries=(0.05, 0.05))
    retried, gone = job_event("job-retried"), job_event("job-gone", "stopped")
    retried_id, gone_id = delivery_id(retried), delivery_id(gone)
    try:
        queue_webhook(redis_conn, "studio", retried)
        dispatcher.start()
        dead = outbox_key("studio", "dead")
        wait_until(lambda: redis_conn.zscore(dead, retried_id), 10, "a dead letter")
        assert len(hooks.received) == 3  # one try, then the schedule's two retries
        hooks.status, hooks.answer = 410, b"no such hook"  # permanent: dead at once
        queue_webhook(redis_conn, "studio", gone)
        dispatcher.wake("studio")
        wait_until(lambda: redis_conn.zscore(dead, gone_id), 10, "a second dead letter")
        assert len(hooks.received) == 4
        assert _entry(redis_conn, retried_id).attempts == 3
        assert (
            _entry(redis_conn, retried_id).last_answer == "HTTP 503: upstream down for maintenance"
        )
        assert _entry(redis_conn, gone_id).last_answer == "HTTP 410: no such hook"
        assert any(f"--resend {retried_id}" in r.getMessage() for r in caplog.records)
        # A job waiting too, for the listing.
        queue_webhook(redis_conn, "elsewhere", job_event("job-waiting"))

        listed = _kiln(redis_url)
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        [retried_line] = [line for line in lines if retried_id in line]
        assert retried_line.startswith("dead") and "job job-retried  studio  failed" in retried_line
        assert "3 tries" in retried_line
        assert "last answer: HTTP 503: upstream down for maintenance" in retried_line
        [gone_line] = [line for line in lines if gone_id in line]
        assert "1 tries" in gone_line and "last answer: HTTP 410: no such hook" in gone_line
        [waiting] = [line for line in lines if "job-waiting" in line]
        assert waiting.startswith("waiting") and "elsewhere" in waiting
        assert lines[-1].startswith("1 due, 0 sending, 2 dead, 0 refused"), lines[-1]

        hooks.status = 204
        resent = _kiln(redis_url, "--resend", retried_id)
        assert resent.returncode == 0 and "tries reset" in resent.stdout, resent
        dispatcher.wake("studio")  # or within its next poll
        wait_until(lambda: hooks.delivered(), 10, "the dead letter delivered")
        wait_until(
            lambda: redis_conn.hget(outbox_key("studio", "entries"), retried_id) is None,
            5,
            "its ack",
        )
        missing = _kiln(redis_url, "--resend", retried_id)  # delivered: no longer a dead letter
        assert missing.returncode == 1 and "no dead letter" in missing.stdout
    finally:
        dispatcher.close()
        hooks.stop()
    [delivered] = hooks.delivered()
    assert delivered.headers["webhook-id"] == retried_id  # the same webhook-id as every try
    assert {r.headers["webhook-id"] for r in hooks.received[:3]} == {retried_id}
    assert verify_webhook(SECRET, delivered.body, delivered.headers).job_id == "job-retried"
    assert redis_conn.zscore(outbox_key("studio", "dead"), gone_id) is not None  # still listed


def test_each_target_holds_at_most_outbox_max_and_a_refusal_is_logged(
    redis_conn: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    assert OUTBOX_MAX == 10_000  # the stated bound (docs/results.md, Webhooks)
    with redis_conn.pipeline(transaction=False) as pipe:
        for n in range(OUTBOX_MAX):
            queue_webhook(pipe, "studio", job_event(f"job-{n}"))
        assert set(pipe.execute()) == {1}
    # Writing an end already there is no new delivery, and is not refused.
    assert queue_webhook(redis_conn, "studio", job_event("job-0"))
    assert not queue_webhook(redis_conn, "studio", job_event("job-over"))  # refused, logged here
    [said] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert "job-over" in said and "10000" in said and delivery_id(job_event("job-over")) in said
    with redis_conn.pipeline() as pipe:  # in a caller's commit: the answer is in its results
        queue_webhook(pipe, "studio", job_event("job-over-2"))
        assert pipe.execute() == [REFUSED]
    assert redis_conn.hlen(outbox_key("studio", "entries")) == OUTBOX_MAX
    assert redis_conn.hget(outbox_key("studio", "refused"), "count") == b"2"
    assert queue_webhook(redis_conn, "other", job_event("job-over"))  # the bound is per target
    # Every sender of the target says so too, whoever wrote (a MULTI's caller cannot see it).
    caplog.clear()
    hooks = HookServer()
    hooks.answering.clear()  # hold the first try: nothing is delivered meanwhile
    hooks.start()
    dispatcher = sender(redis_conn, hooks.url)
    try:
        dispatcher.start()
        wait_until(
            lambda: any("2 deliveries were refused" in r.getMessage() for r in caplog.records),
            10,
            "the sender's refusal line",
        )
    finally:
        hooks.answering.set()
        dispatcher.close()
        hooks.stop()


def test_a_sender_that_stops_leaves_its_undelivered_deliveries_in_redis(redis_conn: Redis) -> None:
    url = f"http://127.0.0.1:{free_port()}/kiln-hook"  # nothing listens: every try is refused
    dispatcher = sender(redis_conn, url, retries=(60,))
    event = job_event("job-left")
    queue_webhook(redis_conn, "studio", event)
    dispatcher.start()
    wait_until(lambda: _entry(redis_conn, delivery_id(event)).attempts == 1, 10, "a failed try")
    dispatcher.close()
    entry = _entry(redis_conn, delivery_id(event))
    assert entry.last_answer is not None and "Connection refused" in entry.last_answer
    due = redis_conn.zscore(outbox_key("studio", "due"), delivery_id(event))
    assert due is not None and due > time.time() + 30  # its next try, for any worker's sender


def test_a_jobs_end_and_its_delivery_are_one_commit_in_a_real_worker(
    redis_conn: Redis, make_settings: Any
) -> None:
    """Done (the FINISH script) and failed (rq's failure commit) write the delivery with the
    end: with the senders not running, both are in Redis the moment the jobs have ended; then a
    sender delivers them, the done one a JobEvent with the job's result."""
    hooks = HookServer()
    hooks.start()
    settings = make_settings(webhooks=targets(hooks.url))
    client, renderer = published(redis_conn, settings)
    done = client.submit({**REQUEST, "webhook": "studio"})
    failed = enqueue_raw(
        redis_conn, "tiny-sd15", {"request": {**REQUEST, "steps": 100_000, "webhook": "studio"}}
    )
    from tests.support.inprocess import make_worker

    worker = make_worker(redis_conn, renderer, ["tiny-sd15"])
    worker.webhooks.start = lambda: None  # type: ignore[method-assign]
    worker.webhooks.wake = lambda target=None: None  # type: ignore[method-assign]
    worker.work(burst=True)
    assert client.job(done.id).status() == "finished"
    assert client.job(failed).status() == "failed"
    done_id = delivery_id(JobEvent(kind="done", job_id=done.id, at=0))
    failed_id = delivery_id(JobEvent(kind="failed", job_id=failed, at=0))
    assert set(redis_conn.zrange(outbox_key("studio", "due"), 0, -1)) == {
        done_id.encode(),
        failed_id.encode(),
    }
    assert hooks.received == []
    dispatcher = sender(redis_conn, hooks.url)
    try:
        dispatcher.start()
        deliveries = hooks.wait_for(2)
    finally:
        dispatcher.close()
        hooks.stop()
    events = {
        d.headers["webhook-id"]: verify_webhook(SECRET, d.body, d.headers) for d in deliveries
    }
    assert set(events) == {done_id, failed_id}
    result = done.wait(timeout=1)
    done_result, error = events[done_id].result, events[failed_id].error
    assert done_result is not None and done_result.seed == result.seed
    assert events[done_id].model == "tiny-sd15"
    assert error is not None and "steps" in error


def test_an_outbox_key_a_client_retyped_fails_no_jobs_end(
    redis_conn: Redis, make_settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone with the client ACL can SET an outbox key to a string: the delivery is lost, said
    so in the log, and the job's end (done in FINISH, failed in RQ's MULTI) is still written."""
    caplog.set_level(logging.ERROR)
    settings = make_settings(webhooks=targets("http://127.0.0.1:9/x"))
    client, renderer = published(redis_conn, settings)
    redis_conn.set(outbox_key("studio", "entries"), "not a hash")
    assert not queue_webhook(redis_conn, "studio", job_event("job-x"))
    with redis_conn.pipeline() as pipe:
        pipe.set("kiln:test:beside", "1")
        queue_webhook(pipe, "studio", job_event("job-y"))
        assert pipe.execute() == [True, -2]  # the rest of the commit is applied
    done = client.submit({**REQUEST, "webhook": "studio"})
    failed = enqueue_raw(
        redis_conn, "tiny-sd15", {"request": {**REQUEST, "steps": 100_000, "webhook": "studio"}}
    )
    burst(redis_conn, renderer, ["tiny-sd15"])
    assert client.job(done.id).status() == "finished"
    assert client.job(failed).status() == "failed"
    said = [r.getMessage() for r in caplog.records]
    assert any(done.id in m and "could not be written" in m for m in said), said
    assert any("job-x" in m and "wrong type" in m for m in said), said
