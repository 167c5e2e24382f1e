"""Webhooks: targets an operator names in KILN_WEBHOOKS, and background senders that POST each
job's end (done, failed, stopped) to the target its request named, signed, with retries.

KILN_WEBHOOKS is a JSON object, or the path of a file holding one:

    {"studio": {"url": "https://backend.example/kiln-hook", "secret": "whsec_<base64>"}}

A request names a target ("webhook": "studio"), never a URL, so a producer cannot make a worker
POST anywhere the operator did not list. The secret is a Standard Webhooks `whsec_` secret
(base64 of 24-64 random bytes); any other string is refused when the worker starts, naming the
target and the expected form, so a receiver's stock library never meets a key it would decode
differently. Headers and signing: api_client/webhooks.py.

Each target has its own sender thread and its own bounded queue (MAX_PENDING), earliest due
first: a receiver that hangs (TIMEOUT_S a try) or keeps failing delays only its own target.
Deliveries wait in memory; a worker that is killed loses the ones not yet delivered. Job ends
that happen outside a render (a client's cancel, an abandoned job, a quarantine) reach the
senders through the Redis outbox (drain_outbox).

Over 300 lines because the targets' grammar, the signing and the senders with their retries are
one delivery contract (Standard Webhooks), read together.
"""

from __future__ import annotations

import heapq
import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator
from redis import Redis

from api_client.errors import Problem, RequestRejected, short
from api_client.redact import redact
from api_client.schema import WEBHOOK_NAME, JobEvent, RenderRequest
from api_client.webhooks import OutboxEntry, outbox_key, secret_key, webhook_headers
from worker.settings import Settings

log = logging.getLogger(__name__)
MAX_PENDING = 1000  # per target: deliveries waiting or in flight
TIMEOUT_S = 10.0  # per socket operation of one try
BACKOFF_CAP_S = 60.0
MAX_RESPONSE_BYTES = 65536  # of a receiver's answer, read and dropped
DRAIN_BATCH = 100  # outbox entries taken per target per drain


class WebhooksInvalid(ValueError):
    """KILN_WEBHOOKS cannot be used; the message names the target and field, never a secret."""


class WebhookTarget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    secret: str

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https") or not rest.split("/")[0]:
            raise ValueError("must be an http:// or https:// URL with a host")
        return url

    @field_validator("secret")
    @classmethod
    def _whsec(cls, secret: str) -> str:
        secret_key(secret)  # its ValueError names the expected form, never the secret
        return secret


@lru_cache(maxsize=8)
def parse_targets(raw: str) -> dict[str, WebhookTarget]:
    """KILN_WEBHOOKS as targets by name; {} when unset."""
    text = raw.strip()
    if not text:
        return {}
    if not text.startswith("{"):
        try:
            text = Path(text).read_text()
        except OSError as exc:
            raise WebhooksInvalid(f"KILN_WEBHOOKS file {raw!r} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WebhooksInvalid(f"KILN_WEBHOOKS is not valid JSON: {exc.msg} at {exc.pos}") from None
    if not isinstance(data, dict):
        raise WebhooksInvalid('KILN_WEBHOOKS must be an object {"name": {"url", "secret"}}')
    targets: dict[str, WebhookTarget] = {}
    for name, spec in data.items():
        if not WEBHOOK_NAME.fullmatch(name):
            raise WebhooksInvalid(f"KILN_WEBHOOKS target name {name!r}: 1-64 of [A-Za-z0-9_.-]")
        try:
            targets[name] = WebhookTarget.model_validate(spec)
        except ValidationError as exc:
            # Each error names the field and rule; the input (maybe the secret) is left out.
            rules = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'target'}: {e['msg']}"
                for e in exc.errors()
            )
            raise WebhooksInvalid(f"KILN_WEBHOOKS target {name!r}: {rules}") from None
    return targets


def check_target(request: RenderRequest, settings: Settings) -> None:
    """The worker's own check: a request may only name a target this worker knows."""
    if request.webhook is None:
        return
    targets = parse_targets(settings.webhooks)
    if request.webhook not in targets:
        known = ", ".join(sorted(targets)) or "none"
        rule = f"unknown webhook target; this worker is configured with: {known}"
        raise RequestRejected([Problem("webhook", request.webhook, rule)], model=request.model)


def delivery_id(event: JobEvent) -> str:
    """Stable for a job's outcome: a retry, or the same job answered again, repeats it."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"kiln:{event.job_id}:{event.kind}"))


@dataclass(order=True)
class Delivery:
    due: float
    id: str = field(compare=False)
    target: str = field(compare=False)
    kind: str = field(compare=False)
    body: bytes = field(compare=False)
    attempts: int = field(default=0, compare=False)


class Lane:
    """One target's deliveries, earliest due first, and the one thread that sends them.

    Bounded: at most MAX_PENDING waiting or in flight. The thread starts with the first
    delivery and lives until stop(); `attempt` (one try: the delivery to retry, or None when
    done or given up) is expected to catch what a try raises, and anything it lets through is
    logged here and ends only that delivery, never the thread.
    """

    def __init__(self, name: str, attempt: Callable[[Delivery], Delivery | None]) -> None:
        self.name = name
        self._attempt = attempt
        self._heap: list[Delivery] = []
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def put(self, delivery: Delivery) -> bool:
        """Queue the delivery; False when MAX_PENDING are already pending."""
        with self._cond:
            if len(self._heap) + self._in_flight >= MAX_PENDING:
                return False
            heapq.heappush(self._heap, delivery)
            self._closing = False  # a send after close() sends again
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"kiln-webhooks-{self.name}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        return True

    def pending(self) -> int:
        with self._cond:
            return len(self._heap) + self._in_flight

    def room(self) -> int:
        return MAX_PENDING - self.pending()

    def settle(self, deadline: float) -> None:
        """Wait until nothing is pending or the deadline (monotonic) passes."""
        with self._cond:
            while self._heap or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(min(left, 0.1))

    def stop(self) -> list[str]:
        """Stop the thread after its current try; the ids left undelivered."""
        with self._cond:
            self._closing = True
            left = [d.id for d in self._heap]
            self._heap.clear()
            self._cond.notify_all()
        return left

    def join(self, deadline: float) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and (
                    not self._heap or self._heap[0].due > time.monotonic()
                ):
                    self._cond.wait(self._heap[0].due - time.monotonic() if self._heap else None)
                if self._closing:
                    self._thread = None  # under the lock: a put() from now on starts another
                    return
                delivery = heapq.heappop(self._heap)
                self._in_flight += 1
            try:
                retry = self._attempt(delivery)
            except Exception:
                log.exception("webhook %s to %s: unexpected error; dropped", delivery.id, self.name)
                retry = None
            with self._cond:
                self._in_flight -= 1
                if retry is not None and self._closing:
                    log.error("webhook %s to %s undelivered at shutdown", retry.id, self.name)
                elif retry is not None:
                    heapq.heappush(self._heap, retry)
                self._cond.notify_all()


class Dispatcher:
    """Sends each target's deliveries from that target's Lane, so a slow, hung or failing
    receiver delays only its own deliveries, never another target's or the next job."""

    def __init__(
        self,
        targets: dict[str, WebhookTarget],
        attempts: int = 10,
        backoff_s: float = 1.0,
        secrets: list[str] | None = None,
    ) -> None:
        self.targets = targets
        self.attempts = attempts
        self.backoff_s = backoff_s
        self._secrets = [*(secrets or []), *(t.secret for t in targets.values())]
        self._lanes = {name: Lane(name, self._attempt) for name in targets}
        self._delivered_lock = threading.Lock()
        self.delivered: list[str] = []  # ids, newest last (bounded), for logs and tests

    @classmethod
    def from_settings(cls, settings: Settings) -> Dispatcher:
        return cls(
            parse_targets(settings.webhooks),
            settings.webhook_attempts,
            settings.webhook_backoff_s,
            settings.secrets(),
        )

    def send(self, target: str, event: JobEvent) -> str | None:
        """Queue the event for the target; returns the delivery id (None if it was dropped)."""
        lane = self._lanes.get(target)
        if lane is None:
            log.warning("webhook: job %s names unknown target %r; not sent", event.job_id, target)
            return None
        body = event.model_dump_json(exclude={"id"}, exclude_none=True).encode()
        delivery = Delivery(time.monotonic(), delivery_id(event), target, event.kind, body)
        if not lane.put(delivery):
            log.error(
                "webhook: %d deliveries pending to %s; dropping %s",
                MAX_PENDING,
                target,
                delivery.id,
            )
            return None
        return delivery.id

    def drain_outbox(self, conn: Redis) -> int:
        """Take the outbox entries of this worker's targets (as many as their lanes have room
        for, up to DRAIN_BATCH each, in one round trip) and send them; how many were queued.

        RPOP hands each entry to one worker; entries for targets this worker does not know are
        left for a worker that does (or expire with their list). Redis errors reach the caller.
        """
        wanted = {n: min(lane.room(), DRAIN_BATCH) for n, lane in self._lanes.items()}
        wanted = {name: count for name, count in wanted.items() if count > 0}
        if not wanted:
            return 0
        with conn.pipeline(transaction=False) as pipe:
            for name, count in wanted.items():
                pipe.rpop(outbox_key(name), count)
            popped: list[Any] = pipe.execute()
        queued = 0
        for name, entries in zip(wanted, popped, strict=True):
            for raw in entries or []:
                try:
                    event = OutboxEntry.model_validate_json(raw).event
                except ValidationError as exc:
                    log.error("webhook outbox %s: unreadable entry dropped: %s", name, short(exc))
                    continue
                queued += self.send(name, event) is not None
        return queued

    def pending(self) -> int:
        """Deliveries waiting or in flight, over all targets."""
        return sum(lane.pending() for lane in self._lanes.values())

    def close(self, timeout: float = 10.0) -> None:
        """Keep sending for up to timeout seconds, then stop; what is left is logged, lost."""
        deadline = time.monotonic() + timeout
        for lane in self._lanes.values():
            lane.settle(deadline)
        left = [d for lane in self._lanes.values() for d in lane.stop()]
        if left:
            log.error("webhook: %d deliveries undelivered at shutdown: %s", len(left), left)
        # A thread inside a try ends when that try times out; it is a daemon, so never waited
        # on for longer than one try.
        joined_by = time.monotonic() + TIMEOUT_S + 1
        for lane in self._lanes.values():
            lane.join(joined_by)

    def _attempt(self, delivery: Delivery) -> Delivery | None:
        """POST once; the delivery to retry later, or None when done or given up."""
        target = self.targets[delivery.target]
        delivery.attempts += 1
        failure = self._post(target, delivery)
        if failure is None:
            with self._delivered_lock:
                self.delivered = [*self.delivered[-99:], delivery.id]
            return None
        reason, permanent = failure
        where = redact(f"{delivery.target} ({target.url})", self._secrets)
        if permanent or delivery.attempts >= self.attempts:
            log.error(
                "webhook %s to %s given up after %d tries: %s",
                delivery.id,
                where,
                delivery.attempts,
                reason,
            )
            return None
        delay = min(self.backoff_s * 2 ** (delivery.attempts - 1), BACKOFF_CAP_S)
        log.warning(
            "webhook %s to %s failed (%s); try %d of %d in %.1f s",
            delivery.id,
            where,
            reason,
            delivery.attempts + 1,
            self.attempts,
            delay,
        )
        delivery.due = time.monotonic() + delay
        return delivery

    def _post(self, target: WebhookTarget, delivery: Delivery) -> tuple[str, bool] | None:
        """One signed POST: None when a 2xx came back, else (reason, permanent). Whatever the
        try raises (a refused or reset connection, a timeout, TLS, a malformed answer that
        http.client rejects) is a failed try; only a 4xx other than 408, 425 and 429 is
        permanent."""
        headers = webhook_headers(target.secret, delivery.id, delivery.kind, delivery.body)
        request = urllib.request.Request(
            target.url,
            data=delivery.body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                "User-Agent": "kiln-webhooks/2",
                **headers,
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                response.read(MAX_RESPONSE_BYTES)
            return None
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}", 400 <= exc.code < 500 and exc.code not in (408, 425, 429)
        except Exception as exc:
            return short(" ".join(f"{type(exc).__name__}: {exc}".split())), False
