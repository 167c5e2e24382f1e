"""Webhook signatures, shared by the worker that signs and the backend that verifies.

A delivery is an HTTP POST whose body is one JobEvent (done, failed or stopped) as JSON, with:

    Kiln-Delivery:   a stable id per job and outcome; retries repeat it, receivers deduplicate on it
    Kiln-Event:      done | failed | stopped
    Kiln-Timestamp:  unix seconds when this attempt was signed
    Kiln-Signature:  v1=<hex HMAC-SHA256(secret, "<timestamp>." + body)>

The timestamp is inside the MAC, so a receiver that rejects old timestamps rejects replays.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping

from api_client.errors import KilnError
from api_client.schema import JobEvent

DELIVERY_HEADER = "Kiln-Delivery"
EVENT_HEADER = "Kiln-Event"
TIMESTAMP_HEADER = "Kiln-Timestamp"
SIGNATURE_HEADER = "Kiln-Signature"
SCHEME = "v1"
TOLERANCE_S = 300


class WebhookInvalid(KilnError):
    """A delivery whose signature, timestamp or body does not check out: do not act on it."""


def signature(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return f"{SCHEME}={mac.hexdigest()}"


def verify_webhook(
    secret: str,
    body: bytes,
    headers: Mapping[str, str],
    tolerance_s: float = TOLERANCE_S,
    now: float | None = None,
) -> JobEvent:
    """The delivered JobEvent, or WebhookInvalid saying which check failed.

    headers: any mapping of the request's headers (names are matched case-insensitively).
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    timestamp = lowered.get(TIMESTAMP_HEADER.lower())
    given = lowered.get(SIGNATURE_HEADER.lower())
    if not timestamp or not given:
        raise WebhookInvalid(f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header")
    try:
        sent = float(timestamp)
    except ValueError:
        raise WebhookInvalid(f"{TIMESTAMP_HEADER} {timestamp!r} is not unix seconds") from None
    age = (time.time() if now is None else now) - sent
    if abs(age) > tolerance_s:
        raise WebhookInvalid(f"{TIMESTAMP_HEADER} is {age:.0f} s off, over {tolerance_s:.0f} s")
    expected = signature(secret, timestamp, body)
    # A header may list several signatures (during a secret rotation): any one may match.
    if not any(hmac.compare_digest(expected, part.strip()) for part in given.split(",")):
        raise WebhookInvalid(f"{SIGNATURE_HEADER} does not match the body and timestamp")
    try:
        return JobEvent.model_validate_json(body)
    except ValueError as exc:
        raise WebhookInvalid(f"signed body is not a kiln JobEvent: {exc}") from None
