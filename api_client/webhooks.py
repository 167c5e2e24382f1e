"""Webhook deliveries as the Standard Webhooks specification (standardwebhooks.com) has them,
shared by the worker that signs, the backend that verifies, and whoever ends a job outside a
worker's render (the outbox).

A delivery is an HTTP POST whose body is one JobEvent (done, failed or stopped) as JSON, with:

    webhook-id:         a stable id per job and outcome; retries repeat it, receivers dedupe on it
    webhook-timestamp:  unix seconds (an integer) when this attempt was signed
    webhook-signature:  v1,<base64 HMAC-SHA256(key, "<id>.<timestamp>.<body>")>; several
                        space-separated signatures may be given, any one may match
    Kiln-Event:         done | failed | stopped (also the body's `kind`)

The secret is `whsec_` + base64 of 24 to 64 random bytes; the key is those bytes. Any other
form is refused (secret_key), so the same string works in every Standard Webhooks library
(`standardwebhooks.Webhook(secret).verify(body, headers)`, svix, ...). The timestamp is inside
the MAC, so a receiver that rejects old timestamps (5 minutes, as those libraries do) rejects
replays.

The outbox: a job that ends where no worker's sender is at hand (cancelled while queued by a
client, failed as abandoned in a worker's clean-up, quarantined) has its end event pushed with
queue_webhook, to the target its request names (webhook_target, job_webhook_target), onto
`kiln:webhook-outbox:<target>`: a list capped at OUTBOX_MAX, expiring OUTBOX_TTL_S after its last
push. Workers configured with that target pop it (RPOP: each entry goes to one worker) and
deliver it as their own; an entry for a target no worker knows stays until the list expires.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from api_client.errors import KilnError, short
from api_client.schema import WEBHOOK_NAME, JobEvent

if TYPE_CHECKING:  # `import api_client` loads no redis (tests/test_client_import.py)
    from redis import Redis
    from redis.client import Pipeline

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
EVENT_HEADER = "Kiln-Event"
_SIGNED_HEADERS = (ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER)
SECRET_PREFIX = "whsec_"
KEY_BYTES = (24, 64)  # the spec's range for a secret's random bytes
TOLERANCE_S = 300  # what the Standard Webhooks libraries accept either side of now
SECRET_FORM = (
    f"whsec_ followed by the base64 of {KEY_BYTES[0]}-{KEY_BYTES[1]} random bytes, as "
    "Standard Webhooks has it (README, Webhooks: how to make one)"
)

OUTBOX_PREFIX = "kiln:webhook-outbox:"  # list per target, newest first: OutboxEntry JSON
OUTBOX_MAX = 1000  # entries kept per target; the oldest go first
OUTBOX_TTL_S = 86400  # the list expires this long after its last push
MAX_DATA_BYTES = 64 * 2**20  # a job record's data inflated further is not read for its target


class WebhookInvalid(KilnError):
    """A delivery whose headers, signature, timestamp or body do not check out: do not act on
    it. The message says which check failed."""


def secret_key(secret: str) -> bytes:
    """The HMAC key in a `whsec_<base64>` secret; ValueError naming the expected form (never
    the secret) for anything else. Decodes as the Standard Webhooks libraries do (padding may
    be left off), but strictly: a character outside base64 is refused, not skipped."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"must be {SECRET_FORM}")
    encoded = secret[len(SECRET_PREFIX) :]
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except binascii.Error:
        raise ValueError(f"is not valid base64 after whsec_; expected {SECRET_FORM}") from None
    if not KEY_BYTES[0] <= len(key) <= KEY_BYTES[1]:
        raise ValueError(f"decodes to {len(key)} bytes; expected {SECRET_FORM}")
    return key


def signature(secret: str, msg_id: str, timestamp: str, body: bytes) -> str:
    """`v1,<base64>`: HMAC-SHA256 with the secret's key over `<id>.<timestamp>.<body>`."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    mac = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return f"v1,{base64.b64encode(mac).decode()}"


def webhook_headers(
    secret: str, msg_id: str, kind: str, body: bytes, now: float | None = None
) -> dict[str, str]:
    """The headers of one delivery attempt, signed now."""
    timestamp = str(int(time.time() if now is None else now))
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: signature(secret, msg_id, timestamp, body),
        EVENT_HEADER: kind,
    }


def verify_webhook(
    secret: str,
    body: bytes,
    headers: Mapping[str, str],
    tolerance_s: float = TOLERANCE_S,
    now: float | None = None,
) -> JobEvent:
    """The delivered JobEvent, or WebhookInvalid saying which check failed.

    secret: the target's `whsec_...` secret (ValueError if it is not one). headers: any mapping
    of the request's headers; names are matched case-insensitively.
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    values = [lowered.get(name, "") for name in _SIGNED_HEADERS]
    missing = [name for name, value in zip(_SIGNED_HEADERS, values, strict=True) if not value]
    if missing:
        raise WebhookInvalid(f"missing header(s): {', '.join(missing)}")
    msg_id, timestamp, given = values
    if not timestamp.isdigit():
        raise WebhookInvalid(f"{TIMESTAMP_HEADER} {short(timestamp, 40)!r} is not unix seconds")
    age = (time.time() if now is None else now) - int(timestamp)
    if abs(age) > tolerance_s:
        when = "old" if age > 0 else "in the future"
        raise WebhookInvalid(
            f"{TIMESTAMP_HEADER} is {abs(age):.0f} s {when}, over the {tolerance_s:.0f} s tolerance"
        )
    expected = signature(secret, msg_id, timestamp, body)
    # Several signatures during a secret rotation; versions other than v1 are skipped.
    if not any(hmac.compare_digest(expected, part) for part in given.split()):
        raise WebhookInvalid(
            f"{SIGNATURE_HEADER} has no v1 signature matching the id, timestamp and body "
            "(another secret, or a changed body)"
        )
    try:
        return JobEvent.model_validate_json(body)
    except ValidationError as exc:
        raise WebhookInvalid(f"signed body is not a kiln JobEvent: {exc}") from None


class OutboxEntry(BaseModel):
    """One delivery waiting in the outbox for a worker that knows its target."""

    target: str
    event: JobEvent


def outbox_key(target: str) -> str:
    return f"{OUTBOX_PREFIX}{target}"


def webhook_target(request: Any) -> str | None:
    """The target a request payload (as enqueued) names, when it names one that could exist."""
    target = request.get("webhook") if isinstance(request, dict) else None
    return target if isinstance(target, str) and WEBHOOK_NAME.fullmatch(target) else None


def job_webhook_target(data: bytes | None) -> str | None:
    """The target named by the request in a job hash's `data` field: RQ's JSON [func, instance,
    args, kwargs], zlib-compressed as RQ writes it (or not). None when it names none or cannot be
    read; a record that inflates past MAX_DATA_BYTES counts as unreadable."""
    if not data:
        return None
    try:
        inflater = zlib.decompressobj()
        text = inflater.decompress(data, MAX_DATA_BYTES)
        if inflater.unconsumed_tail:
            return None
    except zlib.error:
        text = data
    try:
        payload = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(payload, list) and len(payload) == 4 and isinstance(payload[3], dict)):
        return None
    return webhook_target(payload[3].get("request"))


def queue_webhook(redis: Redis | Pipeline, target: str | None, event: JobEvent) -> bool:
    """Put a job's end event in the target's outbox; False, and nothing written, when there is
    no target (None: the job's request named none).

    Given a pipeline, the commands join it (the caller executes it); given a connection, they
    go in one round trip of their own. Client-side: needs no target URLs or secrets.
    """
    if target is None:
        return False
    if not WEBHOOK_NAME.fullmatch(target):
        raise ValueError(f"webhook target {short(target)!r} is not a target name")
    entry = OutboxEntry(target=target, event=event).model_dump_json(exclude_none=True)
    from redis.client import Pipeline

    pipe = redis if isinstance(redis, Pipeline) else redis.pipeline(transaction=False)
    key = outbox_key(target)
    pipe.lpush(key, entry)
    pipe.ltrim(key, 0, OUTBOX_MAX - 1)
    pipe.expire(key, OUTBOX_TTL_S)
    if pipe is not redis:
        pipe.execute()
    return True
