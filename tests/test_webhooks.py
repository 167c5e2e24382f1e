"""Webhooks against live local receivers (http.server on 127.0.0.1, and the fakes in
tests/fixtures): Standard Webhooks signatures checked by the `standardwebhooks` package itself, a
receiver that is down for a while, one that hangs, one that answers malformed HTTP, a slow one,
targets that are not configured, and the Redis outbox every delivery waits in (its write, and
several senders sharing it). Outages, crashes, dead letters and the bound:
tests/test_webhooks_durable.py."""

from __future__ import annotations

import base64
import json
import logging
import time
from datetime import datetime, timezone
from typing import Any

import pytest
from redis import Redis
from standardwebhooks import Webhook, WebhookVerificationError

from api_client import RenderFailed, RequestRejected
from api_client.schema import JobEvent
from api_client.webhooks import (
    OutboxEntry,
    WebhookInvalid,
    job_webhook_target,
    outbox_key,
    queue_webhook,
    signature,
    verify_webhook,
    webhook_target,
)
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.receivers import (
    SECRET,
    HookServer,
    HungReceiver,
    MalformedReceiver,
    job_event,
    published,
    sender,
    targets,
)
from tests.support.records import enqueue_raw
from tests.workers import free_port, wait_until
from worker.queue.upkeep.webhooks import TIMEOUT_S, Dispatcher, delivery_id
from worker.settings import WebhooksInvalid, WebhookTarget, parse_targets

OTHER_SECRET = "whsec_" + base64.b64encode(b"another-secret-0123456789abcdef!").decode()
REQUEST = {"model": "tiny-sd15", "prompt": "a kite", "steps": 2, "seed": 1}


def _send(conn: Redis, dispatcher: Dispatcher, event: JobEvent, target: str = "studio") -> str:
    """Write the event's delivery to the outbox, as a job's end does, and wake the sender."""
    assert queue_webhook(conn, target, event)
    dispatcher.wake(target)
    return delivery_id(event)


def _failed_tries(caplog: pytest.LogCaptureFixture, reason: str) -> int:
    return sum("failed (" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_a_delivery_verifies_with_standardwebhooks_and_kilns_helper(redis_conn: Redis) -> None:
    hooks = HookServer()
    hooks.start()
    dispatcher = sender(redis_conn, hooks.url)
    try:
        sent = _send(redis_conn, dispatcher, job_event())
        [delivery] = hooks.wait_for(1)
    finally:
        dispatcher.close()
        hooks.stop()
    # The stock library, given only the secret string, the body and the headers as received.
    assert Webhook(SECRET).verify(delivery.body, delivery.headers)["job_id"] == "job-1"
    event = verify_webhook(SECRET, delivery.body, delivery.headers)
    assert (event.kind, event.job_id, event.error) == ("failed", "job-1", "boom")
    assert delivery.headers["webhook-id"] == sent == delivery_id(event)
    assert delivery.headers["Kiln-Event"] == "failed"
    assert delivery.headers["webhook-signature"].startswith("v1,")

    tampered = delivery.body.replace(b"boom", b"fine")
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(tampered, delivery.headers)
    with pytest.raises(WebhookInvalid, match="no v1 signature matching"):
        verify_webhook(SECRET, tampered, delivery.headers)
    with pytest.raises(WebhookInvalid, match="no v1 signature matching"):
        verify_webhook(OTHER_SECRET, delivery.body, delivery.headers)
    replayed = {**delivery.headers, "webhook-id": "another-id"}
    with pytest.raises(WebhookInvalid, match="no v1 signature matching"):
        verify_webhook(SECRET, delivery.body, replayed)
    stale = {**delivery.headers, "webhook-timestamp": str(int(time.time()) - 3600)}
    stale["webhook-signature"] = signature(
        SECRET, stale["webhook-id"], stale["webhook-timestamp"], delivery.body
    )
    with pytest.raises(WebhookVerificationError, match="too old"):
        Webhook(SECRET).verify(delivery.body, stale)
    with pytest.raises(WebhookInvalid, match=r"3[56]\d\d s old, over the 300 s tolerance"):
        verify_webhook(SECRET, delivery.body, stale)
    with pytest.raises(WebhookInvalid, match=r"missing header\(s\): webhook-signature"):
        verify_webhook(SECRET, delivery.body, {**delivery.headers, "webhook-signature": ""})


def test_kilns_helper_accepts_what_the_stock_library_signs() -> None:
    # A signature list as a rotating sender makes it: an unknown version, then v1.
    body = job_event("job-lib").model_dump_json().encode()
    now = int(time.time())
    when = datetime.fromtimestamp(now, tz=timezone.utc)
    signed = Webhook(SECRET).sign("msg_1", when, body.decode())
    headers = {
        "Webhook-Id": "msg_1",
        "Webhook-Timestamp": str(now),
        "Webhook-Signature": f"v2,c29tZXRoaW5n {signed}",
    }
    assert verify_webhook(SECRET, body, headers).job_id == "job-lib"
    assert signature(SECRET, "msg_1", str(now), body) == signed


def test_a_receiver_down_for_a_while_still_gets_the_delivery_once(
    redis_conn: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="worker.queue.upkeep.webhooks")
    port = free_port()
    hooks = HookServer(port=port)
    dispatcher = sender(redis_conn, hooks.url, retries=(0.2,) * 20)
    try:
        started = time.monotonic()
        sent = _send(redis_conn, dispatcher, job_event("job-down"))
        assert time.monotonic() - started < 0.05  # written, not sent inline
        wait_until(lambda: _failed_tries(caplog, "refused") >= 2, 15, "two refused tries")
        assert hooks.received == [] and dispatcher.pending() == 1
        hooks.start()
        [delivery] = hooks.wait_for(1, timeout=15)
        wait_until(lambda: dispatcher.pending() == 0, 15, "the delivery to be settled")
        assert len(hooks.received) == 1  # nothing left that could send it again
    finally:
        dispatcher.close()
        hooks.stop()
    assert delivery.headers["webhook-id"] == sent
    assert verify_webhook(SECRET, delivery.body, delivery.headers).job_id == "job-down"


def test_a_hung_receiver_delays_only_its_own_target(redis_conn: Redis) -> None:
    hung, hooks = HungReceiver(), HookServer()
    hung.start()
    hooks.start()
    dispatcher = Dispatcher(
        {
            "stuck": WebhookTarget(url=hung.url, secret=SECRET),
            "studio": WebhookTarget(url=hooks.url, secret=SECRET),
        },
        redis_conn,
    )
    try:
        for n in range(3):
            _send(redis_conn, dispatcher, job_event(f"job-stuck-{n}"), "stuck")
        wait_until(lambda: hung.requests == 1, 10, "the hung receiver to hold a request")
        started = time.monotonic()
        _send(redis_conn, dispatcher, job_event("job-studio"))
        [delivery] = hooks.wait_for(1, timeout=TIMEOUT_S / 2)
        took = time.monotonic() - started
        # Still hanging: its first try has not timed out and the other two wait behind it.
        wait_until(lambda: dispatcher.pending() == 3, 5, "only the hung target's three pending")
        assert hung.requests == 1
        assert redis_conn.zcard(outbox_key("stuck", "taken")) == 1
    finally:
        hung.stop()  # its held try fails now, and the sender settles it before it stops
        dispatcher.close(timeout=TIMEOUT_S)
        hooks.stop()
    assert took < 3.0, f"the studio delivery took {took:.1f} s behind a hung receiver"
    assert verify_webhook(SECRET, delivery.body, delivery.headers).job_id == "job-studio"


def test_a_malformed_answer_is_retried_and_the_sender_lives_on(
    redis_conn: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="worker.queue.upkeep.webhooks")
    malformed = MalformedReceiver()
    malformed.start()
    hooks = HookServer(port=malformed.port)  # the receiver fixed later, at the same address
    dispatcher = sender(redis_conn, malformed.url, retries=(0.1,) * 50)
    try:
        _send(redis_conn, dispatcher, job_event("job-first"))
        wait_until(lambda: _failed_tries(caplog, "BadStatusLine") >= 2, 15, "two malformed answers")
        malformed.stop()
        hooks.start()
        hooks.wait_for(1, timeout=15)  # the same delivery, by the same sender thread
        _send(redis_conn, dispatcher, job_event("job-later"))
        deliveries = hooks.wait_for(2, timeout=15)
    finally:
        dispatcher.close()
        hooks.stop()
    jobs = [verify_webhook(SECRET, d.body, d.headers).job_id for d in deliveries]
    assert jobs == ["job-first", "job-later"] and malformed.requests >= 2


def test_a_slow_receiver_never_holds_up_the_next_job(redis_conn: Redis, make_settings: Any) -> None:
    hooks = HookServer()
    hooks.answering.clear()  # the receiver takes each request and sits on it
    hooks.start()
    settings = make_settings(webhooks=targets(hooks.url))
    client, renderer = published(redis_conn, settings)
    first = client.submit({**REQUEST, "webhook": "studio"})
    second = client.submit({**REQUEST, "webhook": "studio", "seed": 2})
    from tests.support.inprocess import make_worker

    worker = make_worker(redis_conn, renderer, ["tiny-sd15"])
    close = worker.webhooks.close
    try:
        worker.webhooks.close = lambda timeout=0.0: None  # type: ignore[method-assign]
        worker.work(burst=True)
        # Both jobs ended while the receiver still sat on the first delivery.
        assert [client.job(j.id).status() for j in (first, second)] == ["finished"] * 2
        assert hooks.received == [] and worker.webhooks.pending() == 2
        hooks.answering.set()
        deliveries = hooks.wait_for(2, timeout=30)
    finally:
        hooks.answering.set()
        close()
        hooks.stop()
    # A try that outlived its timeout is answered late too: the same delivery, twice at most.
    assert {verify_webhook(SECRET, d.body, d.headers).job_id for d in deliveries} == {
        first.id,
        second.id,
    }


def test_unknown_targets_are_rejected_at_submit_and_by_the_worker(
    redis_conn: Redis, make_settings: Any
) -> None:
    settings = make_settings(webhooks=targets("http://127.0.0.1:9/x"))
    client = client_for(redis_conn, settings)
    with pytest.raises(RequestRejected, match=r"webhook='studio': unknown webhook target; .* none"):
        client.submit({**REQUEST, "webhook": "studio"})  # no worker has published it yet
    renderer = make_renderer(settings, ["tiny-sd15"])
    burst(redis_conn, renderer, ["tiny-sd15"])
    assert client.webhook_targets() == {"studio"}
    with pytest.raises(RequestRejected, match=r"webhook='nope': unknown webhook target; .*studio"):
        client.submit({**REQUEST, "webhook": "nope"})
    with pytest.raises(RequestRejected, match=r"webhook=.*never carry a URL"):
        client.submit({**REQUEST, "webhook": "https://attacker.example/hook"})
    assert redis_conn.llen("rq:queue:kiln:tiny-sd15") == 0
    # A producer that skips the client: the worker refuses it too, naming the target.
    raw = enqueue_raw(redis_conn, "tiny-sd15", {"request": {**REQUEST, "webhook": "nope"}})
    burst(redis_conn, renderer, ["tiny-sd15"])
    with pytest.raises(RenderFailed, match="webhook='nope': unknown webhook target"):
        client.job(raw).wait(timeout=1)


def test_bad_webhook_configuration_is_named_without_its_secret() -> None:
    def refused(secret: str, rule: str) -> None:
        config = json.dumps({"studio": {"url": "http://h/x", "secret": secret}})
        with pytest.raises(WebhooksInvalid, match=rf"target 'studio': secret: .*{rule}") as caught:
            parse_targets(config)
        assert secret not in str(caught.value)
        assert "whsec_ followed by the base64 of 24-64 random bytes" in str(caught.value)

    refused("receiver-secret-0123456789", "must be whsec_")  # a pre-Standard-Webhooks secret
    refused("whsec_not*base64*at*all*0123456789", "not valid base64")
    refused("whsec_" + base64.b64encode(b"16 bytes, short.").decode(), "decodes to 16 bytes")
    refused("whsec_" + base64.b64encode(bytes(65)).decode(), "decodes to 65 bytes")
    unpadded = "whsec_" + base64.b64encode(bytes(range(25))).decode().rstrip("=")
    assert parse_targets(json.dumps({"s": {"url": "http://h/x", "secret": unpadded}}))
    with pytest.raises(WebhooksInvalid, match=r"target 'ftp': url: .*http"):
        parse_targets(json.dumps({"ftp": {"url": "ftp://h/x", "secret": SECRET}}))
    with pytest.raises(WebhooksInvalid, match="not valid JSON"):
        parse_targets("{nope")
    with pytest.raises(WebhooksInvalid, match="cannot be read"):
        parse_targets("/no/such/webhooks.json")


def test_an_outbox_entry_is_written_once_and_delivered_by_a_worker_that_knows_its_target(
    redis_conn: Redis,
) -> None:
    # The target, read from a job record as RQ stores it (what a cancel or a quarantine has).
    job_id = enqueue_raw(redis_conn, "tiny-sd15", {"request": {**REQUEST, "webhook": "studio"}})
    target = job_webhook_target(redis_conn.hget(f"rq:job:{job_id}", "data"))
    assert target == "studio"
    plain = enqueue_raw(redis_conn, "tiny-sd15", {"request": REQUEST})
    assert job_webhook_target(redis_conn.hget(f"rq:job:{plain}", "data")) is None
    for unreadable in (None, b"", b"\x78\x9c garbage", b"[1, 2]", b'["f", null, [], {"r": 1}]'):
        assert job_webhook_target(unreadable) is None
    assert webhook_target({"webhook": "https://x.example/"}) is None

    stopped = JobEvent(kind="stopped", job_id=job_id, model="tiny-sd15", at=time.time())
    assert not queue_webhook(redis_conn, None, stopped)  # no target named: nothing written
    assert redis_conn.keys("kiln:webhooks:*") == []
    with pytest.raises(ValueError, match="not a target name"):
        queue_webhook(redis_conn, "https://x.example/", stopped)
    with redis_conn.pipeline() as pipe:  # joins the caller's commit (MULTI)
        pipe.hset(f"rq:job:{job_id}", "status", "stopped")
        assert queue_webhook(pipe, target, stopped)
        assert redis_conn.hlen(outbox_key("studio", "entries")) == 0
        assert pipe.execute() == [0, 1]
    # The same end written again (a retried commit, a second writer) is the same one delivery.
    assert queue_webhook(redis_conn, target, stopped.model_copy(update={"at": time.time()}))
    assert redis_conn.hlen(outbox_key("studio", "entries")) == 1
    due: Any = redis_conn.zrange(outbox_key("studio", "due"), 0, -1, withscores=True)
    [(due_id, due_at)] = due
    assert due_id.decode() == delivery_id(stopped) and due_at <= time.time()
    entry = OutboxEntry.model_validate_json(
        redis_conn.hget(outbox_key("studio", "entries"), due_id) or b""
    )
    assert (entry.job_id, entry.kind, entry.attempts, entry.last_answer) == (
        job_id,
        "stopped",
        0,
        None,
    )
    hooks = HookServer()
    hooks.start()
    dispatcher = sender(redis_conn, hooks.url)
    try:
        dispatcher.start()
        [delivery] = hooks.wait_for(1)
        wait_until(lambda: dispatcher.pending() == 0, 10, "the delivery to be settled")
    finally:
        dispatcher.close()
        hooks.stop()
    assert Webhook(SECRET).verify(delivery.body, delivery.headers)["kind"] == "stopped"
    assert delivery.headers["webhook-id"] == delivery_id(stopped)
    assert redis_conn.keys("kiln:webhooks:studio:*") == []  # acked: deleted


def test_several_workers_share_each_targets_outbox_and_leave_other_targets(
    redis_conn: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    count = 60
    with redis_conn.pipeline(transaction=False) as pipe:
        for n in range(count):
            queue_webhook(pipe, "studio", job_event(f"job-{n}"))
        pipe.execute()
    queue_webhook(redis_conn, "elsewhere", job_event("job-elsewhere"))
    redis_conn.hset(outbox_key("studio", "entries"), "forged", b"not an entry")
    redis_conn.zadd(outbox_key("studio", "due"), {"forged": 0})
    hooks = HookServer()
    hooks.start()
    workers = [sender(redis_conn, hooks.url) for _ in range(3)]
    try:
        for worker in workers:
            worker.start()
        deliveries = hooks.wait_for(count)
        wait_until(lambda: workers[0].pending() == 0, 30, "every delivery settled")
    finally:
        for worker in workers:
            worker.close()
        hooks.stop()
    job_ids = [verify_webhook(SECRET, d.body, d.headers).job_id for d in deliveries]
    assert sorted(job_ids) == sorted(f"job-{n}" for n in range(count))  # each once: leased
    assert all(w.delivered for w in workers), [len(w.delivered) for w in workers]
    # The unreadable entry was dropped, logged; the unknown target's entry waits for its worker.
    assert any("unreadable entry dropped" in r.getMessage() for r in caplog.records)
    assert redis_conn.keys("kiln:webhooks:studio:*") == []
    assert redis_conn.zcard(outbox_key("elsewhere", "due")) == 1


@pytest.mark.slow  # a sender killed and restarted
def test_every_job_end_outside_a_render_lands_in_the_outbox_and_survives_its_sender(
    redis_conn: Redis, kiln_env: dict[str, str], tmp_path: Any
) -> None:
    """Cancelled while queued (by the client, which has no target URLs), abandoned by a dead
    worker with no retries left, and quarantined: each end's delivery is written in Redis. A
    worker that takes one and dies before it sends (crash@webhook) loses none: a second worker
    delivers all three, the taken one once its lease lapses, with the same webhook-id."""
    from api_client import KilnClient, keys
    from tests.workers import QUICK_WEBHOOK_LEASE, Options, WorkerProcess
    from worker.crashes import CRASH_STATUS

    hooks = HookServer()
    hooks.start()
    env = {
        **kiln_env,
        "KILN_WEBHOOKS": targets(hooks.url),
    }
    redis_conn.sadd(keys.WEBHOOK_TARGETS_KEY, "studio")
    client = KilnClient(connection=redis_conn)
    request = {**REQUEST, "model": "tiny-sd3", "webhook": "studio"}  # a queue no worker serves
    cancelled = client.submit(request)
    assert cancelled.cancel() == "queued"
    stopped = JobEvent(kind="stopped", job_id=cancelled.id, at=0)
    assert redis_conn.zscore(outbox_key("studio", "due"), delivery_id(stopped)) is not None
    # Abandoned: started by a worker that died, no retries left, its lease long lapsed.
    abandoned = enqueue_raw(redis_conn, "tiny-sd15", {"request": {**REQUEST, "webhook": "studio"}})
    redis_conn.lrem("rq:queue:kiln:tiny-sd15", 0, abandoned)
    redis_conn.hset(f"rq:job:{abandoned}", mapping={"status": "started", "retries_left": 0})
    redis_conn.zadd("rq:wip:kiln:tiny-sd15", {f"{abandoned}:dead": 1})
    # Quarantined: a record kiln cannot read, on the queue.
    broken = enqueue_raw(redis_conn, "tiny-sd15", {"request": {**REQUEST, "webhook": "studio"}})
    redis_conn.hset(f"rq:job:{broken}", "timeout", "soon")
    quick = QUICK_WEBHOOK_LEASE | Options({"KILN_FAULTS": "crash@webhook"})
    first = WorkerProcess(env, tmp_path / "first.log", "--models", "tiny-sd15", options=quick)
    second = None
    try:
        assert first.wait(timeout=90) == CRASH_STATUS, first.output()
        held: Any = redis_conn.zrange(outbox_key("studio", "taken"), 0, -1)
        [taken] = held
        assert hooks.received == []
        second = WorkerProcess(env, tmp_path / "second.log", "--models", "tiny-sd15")
        deliveries = hooks.wait_for(3, timeout=90)
        wait_until(lambda: not redis_conn.keys("kiln:webhooks:studio:*"), 10, "all acked")
    finally:
        first.stop()
        if second is not None:
            second.stop()
        hooks.stop()
    ends = {
        (e["job_id"], e["kind"])
        for e in (Webhook(SECRET).verify(d.body, d.headers) for d in deliveries)
    }
    assert ends == {(cancelled.id, "stopped"), (abandoned, "failed"), (broken, "failed")}
    assert taken.decode() in {d.headers["webhook-id"] for d in deliveries}
    assert len(deliveries) == 3
