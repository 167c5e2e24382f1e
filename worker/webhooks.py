"""Webhooks: targets an operator names in KILN_WEBHOOKS, and a background sender that POSTs each
job's end (done, failed, stopped) to the target its request named, signed, with retries.

KILN_WEBHOOKS is a JSON object, or the path of a file holding one:

    {"studio": {"url": "https://backend.example/kiln-hook", "secret": "at least 16 characters"}}

A request names a target ("webhook": "studio"), never a URL, so a producer cannot make a worker
POST anywhere the operator did not list. Signing and header names: api_client/webhooks.py.
Deliveries wait in memory (bounded); a worker that is killed loses the ones not yet delivered.
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
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from api_client.errors import Problem, RequestRejected
from api_client.redact import redact
from api_client.schema import WEBHOOK_NAME, JobEvent, RenderRequest
from api_client.webhooks import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    signature,
)
from worker.settings import Settings

log = logging.getLogger(__name__)
MAX_PENDING = 1000
TIMEOUT_S = 10.0
BACKOFF_CAP_S = 60.0


class WebhooksInvalid(ValueError):
    """KILN_WEBHOOKS cannot be used; the message names the target and field, never a secret."""


class WebhookTarget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    secret: str = Field(min_length=16)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https") or not rest.split("/")[0]:
            raise ValueError("must be an http:// or https:// URL with a host")
        return url


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


class Dispatcher:
    """Sends deliveries from one background thread, earliest due first, so a slow or dead
    receiver delays only its own retries and never the next job."""

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
        self._heap: list[Delivery] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
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
        if target not in self.targets:
            log.warning("webhook: job %s names unknown target %r; not sent", event.job_id, target)
            return None
        body = event.model_dump_json(exclude={"id"}, exclude_none=True).encode()
        delivery = Delivery(time.monotonic(), delivery_id(event), target, event.kind, body)
        with self._cond:
            if len(self._heap) >= MAX_PENDING:
                log.error("webhook: %d deliveries pending; dropping %s", MAX_PENDING, delivery.id)
                return None
            heapq.heappush(self._heap, delivery)
            self._start()
            self._cond.notify()
        return delivery.id

    def pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def close(self, timeout: float = 10.0) -> None:
        """Keep sending for up to timeout seconds, then stop; what is left is logged, lost."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._heap and time.monotonic() < deadline:
                self._cond.wait(min(0.1, max(deadline - time.monotonic(), 0.0)))
            self._closing = True
            left = [d.id for d in self._heap]
            self._cond.notify_all()
        if left:
            log.error("webhook: %d deliveries undelivered at shutdown: %s", len(left), left)
        if self._thread is not None:
            self._thread.join(timeout=TIMEOUT_S + 1)

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._closing = False
            self._thread = threading.Thread(target=self._run, name="kiln-webhooks", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and (
                    not self._heap or self._heap[0].due > time.monotonic()
                ):
                    wait = self._heap[0].due - time.monotonic() if self._heap else None
                    self._cond.wait(wait)
                if self._closing:
                    return
                delivery = heapq.heappop(self._heap)
            retry = self._attempt(delivery)
            with self._cond:
                if retry is not None:
                    heapq.heappush(self._heap, retry)
                self._cond.notify_all()

    def _attempt(self, delivery: Delivery) -> Delivery | None:
        """POST once; the delivery to retry later, or None when done or given up."""
        target = self.targets[delivery.target]
        delivery.attempts += 1
        timestamp = str(int(time.time()))
        request = urllib.request.Request(
            target.url,
            data=delivery.body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                "User-Agent": "kiln-webhooks/1",
                DELIVERY_HEADER: delivery.id,
                EVENT_HEADER: delivery.kind,
                TIMESTAMP_HEADER: timestamp,
                SIGNATURE_HEADER: signature(target.secret, timestamp, delivery.body),
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                response.read()
            self.delivered = [*self.delivered[-99:], delivery.id]
            return None
        except urllib.error.HTTPError as exc:
            reason = f"HTTP {exc.code}"
            permanent = 400 <= exc.code < 500 and exc.code not in (408, 425, 429)
        except (OSError, urllib.error.URLError) as exc:
            reason, permanent = str(exc), False
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
