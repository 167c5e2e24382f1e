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

The outbox, in Redis, is where every delivery waits until a receiver answers 2xx, so a worker
killed before (or while) it sends loses none. Per target: a hash of OutboxEntry JSON by delivery
id (`kiln:webhooks:<target>:entries`), and the id in one of three sorted sets: `due` (scored by
when its next try is due), `taken` (a sender's lease, scored by when it lapses) or `dead`
(scored by when its last try failed). A job's end writes its delivery in the same commit as the
end itself: the FINISH script inlines OUTBOX_WRITE (worker/queue/execution.py), a failed or
stopped job's end and a client's cancel call queue_webhook on the pipeline that commits the end.
The write is idempotent (the delivery id is the same for the same end) and bounded: a target
holding OUTBOX_MAX entries refuses more, counted in `kiln:webhooks:<target>:refused`; the
caller that sees the refusal logs it, and every sender of that target logs the count rising.
Any worker configured with the target sends it (worker/queue/upkeep/webhooks.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import time
import uuid
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
    "Standard Webhooks has it (docs/results.md, Webhooks: how to make one)"
)

OUTBOX_PREFIX = "kiln:webhooks:"  # kiln:webhooks:<target>:<part>, parts in OUTBOX_PARTS
OUTBOX_PARTS = ("entries", "due", "taken", "dead", "refused")
OUTBOX_MAX = 10_000  # entries per target (waiting, in flight and dead); past it a write is refused
# A job record's data inflated further is unreadable (a zlib bomb stops here), for its webhook
# target and for the worker (worker/queue/upkeep/quarantine.py). The largest request kiln takes
# is five inline images (image, mask, two controls, a reference) of 2 MB each, 2.7 MB as base64,
# with two 4000-character prompts: under 14 MB. 16 MiB holds it.
MAX_DATA_BYTES = 16 * 2**20
# The write, as a Lua function for scripts that commit a job's end (FINISH inlines it), called
# as kiln_outbox_write(entries, due, refused, id, entry JSON, due at, bound): 1 written, 0 there
# already (the same end written twice is one delivery), REFUSED past the bound.
OUTBOX_WRITE = """
local function kiln_outbox_write(entries, due, refused, id, entry, at, bound)
    if redis.call("HEXISTS", entries, id) == 1 then
        return 0
    end
    if redis.call("HLEN", entries) >= tonumber(bound) then
        redis.call("HINCRBY", refused, "count", 1)
        redis.call("HSET", refused, "last", id, "at", at)
        return -1
    end
    redis.call("HSET", entries, id, entry)
    redis.call("ZADD", due, "NX", at, id)
    return 1
end
"""
REFUSED = -1
FAILED = -2  # the write raised (a key of the wrong type): nothing written
# KEYS: entries, due, refused. ARGV: id, entry JSON, due at (unix s), bound. An error is an
# answer, not a raise, so that it never fails the caller's commit (RQ's failure MULTI).
_QUEUE_WEBHOOK = (
    OUTBOX_WRITE
    + """
local ok, answer = pcall(
    kiln_outbox_write, KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4]
)
if ok then
    return answer
end
return -2
"""
)
log = logging.getLogger(__name__)


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


def delivery_id(event: JobEvent) -> str:
    """Stable for a job's outcome (the webhook-id): a retry, or the same end written again,
    repeats it."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"kiln:{event.job_id}:{event.kind}"))


class OutboxEntry(BaseModel):
    """One delivery in a target's outbox: what is sent (body, a JobEvent's JSON, the same
    bytes every try) and how its tries went."""

    id: str  # delivery_id(event): the webhook-id of every try
    target: str
    kind: str
    job_id: str
    body: str
    created: float  # unix s
    attempts: int = 0
    last_answer: str | None = None  # the receiver's (or the connection's) answer to the last try

    @classmethod
    def of(cls, target: str, event: JobEvent, now: float | None = None) -> OutboxEntry:
        return cls(
            id=delivery_id(event),
            target=target,
            kind=event.kind,
            job_id=event.job_id,
            body=event.model_dump_json(exclude={"id"}, exclude_none=True),
            created=time.time() if now is None else now,
        )


def outbox_key(target: str, part: str) -> str:
    """A target's outbox key: part is one of OUTBOX_PARTS."""
    return f"{OUTBOX_PREFIX}{target}:{part}"


def outbox_write(target: str, event: JobEvent) -> tuple[list[str], list[str | float | int]]:
    """KEYS and ARGV of kiln_outbox_write (OUTBOX_WRITE) for the event's delivery to target,
    due now; ValueError for a target that is not a target name."""
    if not WEBHOOK_NAME.fullmatch(target):
        raise ValueError(f"webhook target {short(target)!r} is not a target name")
    entry = OutboxEntry.of(target, event)
    return (
        [outbox_key(target, "entries"), outbox_key(target, "due"), outbox_key(target, "refused")],
        [entry.id, entry.model_dump_json(), entry.created, OUTBOX_MAX],
    )


def log_refused(target: str, event: JobEvent) -> None:
    """What a writer that saw its write refused says (never silent)."""
    log.error(
        "webhook %s of job %s to %s refused: its outbox holds %d deliveries (OUTBOX_MAX); "
        "see `kiln webhooks`",
        delivery_id(event),
        event.job_id,
        target,
        OUTBOX_MAX,
    )


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
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the reader's stack
        return None
    if not (isinstance(payload, list) and len(payload) == 4 and isinstance(payload[3], dict)):
        return None
    return webhook_target(payload[3].get("request"))


def queue_webhook(redis: Redis | Pipeline, target: str | None, event: JobEvent) -> bool:
    """Write a job's end event's delivery into the target's outbox (one script, idempotent,
    bounded: OUTBOX_WRITE); False, and nothing written, when there is no target (None: the
    job's request named none), or when a write of its own was refused or failed (logged here).

    Given a pipeline (MULTI or not), the script joins it, so the delivery commits with whatever
    the caller commits there (its answer, REFUSED past the bound or FAILED, is in the pipeline's
    results, never raised; a refusal is counted in Redis, where every sender of the target logs
    it). Given a connection, it is one round trip of its own. Client-side: needs no target URLs
    or secrets.
    """
    if target is None:
        return False
    keys, args = outbox_write(target, event)
    script = redis.register_script(_QUEUE_WEBHOOK)
    from redis.client import Pipeline

    if isinstance(redis, Pipeline):
        script(keys=keys, args=args)
        return True
    answer = int(script(keys=keys, args=args))
    if answer == REFUSED:
        log_refused(target, event)
    elif answer == FAILED:
        log.error(
            "webhook of job %s to %s not written: a key of the wrong type", event.job_id, target
        )
    return answer >= 0
