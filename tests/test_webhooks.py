"""Webhooks against a live local receiver (http.server on 127.0.0.1): signed deliveries, a
receiver that is down for a while, a slow receiver, and targets that are not configured."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from redis import Redis

from api_client import RenderFailed, RequestRejected
from api_client.schema import JobEvent
from api_client.webhooks import WebhookInvalid, signature, verify_webhook
from tests.helpers import burst, client_for, enqueue_raw, make_renderer
from tests.hookserver import HookServer
from tests.workers import free_port
from worker.webhooks import Dispatcher, WebhooksInvalid, WebhookTarget, delivery_id, parse_targets

SECRET = "receiver-secret-0123456789"
REQUEST = {"model": "tiny-sd15", "prompt": "a kite", "steps": 2, "seed": 1}


def _event(job_id: str = "job-1") -> JobEvent:
    return JobEvent(kind="failed", job_id=job_id, model="tiny-sd15", at=time.time(), error="boom")


def _dispatcher(url: str, **options: Any) -> Dispatcher:
    return Dispatcher({"studio": WebhookTarget(url=url, secret=SECRET)}, **options)


def test_a_delivery_verifies_and_a_tampered_one_does_not() -> None:
    hooks = HookServer()
    hooks.start()
    dispatcher = _dispatcher(hooks.url)
    try:
        sent = dispatcher.send("studio", _event())
        [delivery] = hooks.wait_for(1)
    finally:
        dispatcher.close()
        hooks.stop()
    event = verify_webhook(SECRET, delivery.body, delivery.headers)
    assert (event.kind, event.job_id, event.error) == ("failed", "job-1", "boom")
    assert delivery.headers["Kiln-Delivery"] == sent == delivery_id(event)
    tampered = delivery.body.replace(b"boom", b"fine")
    with pytest.raises(WebhookInvalid, match="does not match"):
        verify_webhook(SECRET, tampered, delivery.headers)
    with pytest.raises(WebhookInvalid, match="does not match"):
        verify_webhook("another-secret-0123456789", delivery.body, delivery.headers)
    stale = {**delivery.headers, "Kiln-Timestamp": str(int(time.time()) - 3600)}
    stale["Kiln-Signature"] = signature(SECRET, stale["Kiln-Timestamp"], delivery.body)
    with pytest.raises(WebhookInvalid, match="off, over 300 s"):
        verify_webhook(SECRET, delivery.body, stale)


def test_a_receiver_down_for_a_while_still_gets_the_delivery_once() -> None:
    port = free_port()
    hooks = HookServer(port=port)
    dispatcher = _dispatcher(hooks.url, attempts=20, backoff_s=0.2)
    try:
        started = time.monotonic()
        sent = dispatcher.send("studio", _event("job-down"))
        assert time.monotonic() - started < 0.05  # queued, not sent inline
        time.sleep(1.0)  # several refused tries (0.2, 0.4 s backoff)
        assert hooks.received == [] and dispatcher.pending() == 1
        hooks.start()
        [delivery] = hooks.wait_for(1, timeout=15)
        time.sleep(0.5)
        assert len(hooks.received) == 1 and dispatcher.pending() == 0
    finally:
        dispatcher.close()
        hooks.stop()
    assert delivery.headers["Kiln-Delivery"] == sent
    assert verify_webhook(SECRET, delivery.body, delivery.headers).job_id == "job-down"


def test_a_slow_receiver_never_holds_up_the_next_job(redis_conn: Redis, make_settings: Any) -> None:
    hooks = HookServer()
    hooks.answering.clear()  # the receiver takes each request and sits on it
    hooks.start()
    settings = make_settings(webhooks=json.dumps({"studio": {"url": hooks.url, "secret": SECRET}}))
    client = client_for(redis_conn, settings)
    renderer = make_renderer(settings, ["tiny-sd15"])
    burst(redis_conn, renderer, ["tiny-sd15"])  # publishes the target name
    first = client.submit({**REQUEST, "webhook": "studio"})
    second = client.submit({**REQUEST, "webhook": "studio", "seed": 2})
    try:
        from worker.queue import make_worker

        worker = make_worker(redis_conn, renderer, ["tiny-sd15"])
        worker.webhooks.close = lambda timeout=0.0: None  # type: ignore[method-assign]
        worker.work(burst=True)
        # Both jobs ended while the receiver still sat on the first delivery.
        assert [client.job(j.id).status() for j in (first, second)] == ["finished"] * 2
        assert hooks.received == [] and worker.webhooks.pending() >= 1
        hooks.answering.set()
        deliveries = hooks.wait_for(2, timeout=30)
    finally:
        hooks.stop()
    assert sorted(verify_webhook(SECRET, d.body, d.headers).job_id for d in deliveries) == sorted(
        [first.id, second.id]
    )


def test_unknown_targets_are_rejected_at_submit_and_by_the_worker(
    redis_conn: Redis, make_settings: Any
) -> None:
    settings = make_settings(
        webhooks=json.dumps({"studio": {"url": "http://127.0.0.1:9/x", "secret": SECRET}})
    )
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
    short = json.dumps({"studio": {"url": "http://h/x", "secret": "tooshort"}})
    with pytest.raises(WebhooksInvalid, match=r"target 'studio': secret: .*16") as caught:
        parse_targets(short)
    assert "tooshort" not in str(caught.value)
    with pytest.raises(WebhooksInvalid, match=r"target 'ftp': url: .*http"):
        parse_targets(json.dumps({"ftp": {"url": "ftp://h/x", "secret": SECRET}}))
    with pytest.raises(WebhooksInvalid, match="not valid JSON"):
        parse_targets("{nope")
    with pytest.raises(WebhooksInvalid, match="cannot be read"):
        parse_targets("/no/such/webhooks.json")
