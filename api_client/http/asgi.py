"""What the gateway's plain ASGI layers (guard.py, body.py) share: the callables' types, and a
problem+json refusal sent before any route runs, echoing only values made fit to send (echo)."""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from api_client.errors import ECHO_LIMIT, Problem
from api_client.http.views import PROBLEM_JSON

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_INT_BITS = 256  # past this an integer is echoed by its size: str() of 4300+ digits raises
_REPR = reprlib.Repr()  # a container's repr, bounded however large it is
_REPR.maxstring = _REPR.maxother = 80


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header, as Starlette's request.headers.get reads it (a
    layer that judged the last one would judge another header than the route then reads)."""
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def echo(value: Any) -> Any:
    """A client's value fit to send back in a refusal: at most ECHO_LIMIT characters, a lone
    surrogate as its escape, NaN and infinities by name, a container by a bounded repr. A
    JSONResponse fails on a lone surrogate (UTF-8 encode) and on NaN (allow_nan=False): a 500."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        bits = value.bit_length()
        return value if bits <= MAX_INT_BITS else f"<an integer of {bits} bits>"
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if not isinstance(value, str):
        value = _REPR.repr(value)
    escaped = text(value[: ECHO_LIMIT + 1])
    if len(value) <= ECHO_LIMIT and len(escaped) <= ECHO_LIMIT:
        return escaped
    # Cut to ECHO_LIMIT with its note, so errors.short, which app.py's `problem` applies
    # again, leaves it as it is.
    note = f"... ({len(value)} chars)"
    return escaped[: ECHO_LIMIT - len(note)] + note


def text(value: str) -> str:
    """value, encodable as UTF-8: a lone surrogate becomes its escape (\\ud800)."""
    if value.isascii():
        return value
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


async def refuse(
    send: Send, status: int, title: str, detail: str, problems: Sequence[Problem] = ()
) -> None:
    """A problem+json answer, shaped as app.py's `problem` shapes it."""
    errors = [
        {"field": echo(p.field), "value": echo(p.value), "rule": text(p.rule)} for p in problems
    ]
    shape = {"type": "about:blank", "title": title, "status": status, "detail": text(detail)}
    body = json.dumps({**shape, "errors": errors}, allow_nan=False, separators=(",", ":"))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", PROBLEM_JSON.encode()),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body.encode()})
