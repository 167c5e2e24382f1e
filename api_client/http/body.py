"""JSON bodies bounded before anything parses them: a plain ASGI layer (wired by guard.Guard, so
the body is already capped in size) reads a JSON body whole, refuses it in a bounded 400 or 422
problem+json, or replays the exact bytes to the app. Any other body passes through unbuffered.

The checks run in this order, each cheap because the one before bounds it: 1. strict UTF-8;
2. its structural marks counted by bytes.count (C, no objects made), so a body of 400,000 keys
never reaches a parser; 3. one json.loads whose hooks mark NaN, Infinity, 1e400 and overlong
numbers; 4. a walk of what it made for depth, width, lone surrogates and the hooks' marks."""

from __future__ import annotations

import email.message
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio

from api_client.errors import Problem, RequestRejected
from api_client.http.asgi import App, Message, Receive, Scope, Send, echo, header, refuse
from api_client.schema import MAX_PROMPT_CHARS

# A RenderRequest is under 100 keys and items; its two prompts may be made of these very bytes
# (A1111-style weights: "(red:1.2), [blue]"), so each mark may appear that often, and no more.
MAX_MARKS = 2 * MAX_PROMPT_CHARS + 1000
MARKS = {b":": "key", b",": "separator", b"[": "array", b"{": "object"}
MAX_DEPTH = 32  # a RenderRequest nests 3 deep (request, controls, a control)
MAX_ENTRIES = 256  # a RenderRequest has 25 fields, its longest list 4 entries
MAX_NUMBER_CHARS = 100  # a seed has 10 digits; float() and int() of a megabyte of digits do not
# Past this the checks run in a worker thread: json.loads holds the GIL, but the event loop
# takes it back between the hooks' calls and the walk's steps.
IN_THREAD_BYTES = 1024 * 1024
MAX_PROBLEMS = 20  # errors a refusal lists; detail says how many more there were


@dataclass(frozen=True)
class Refusal:
    """A body refused: the status and problem+json it is answered with."""

    status: int
    title: str
    detail: str
    problems: tuple[Problem, ...] = ()


@dataclass(frozen=True)
class _Unfit:
    """What a json.loads hook leaves in place of a number it refuses; the walk names its field."""

    text: str
    rule: str


class JsonBodies:
    """The layer: a JSON body checked whole before the app sees it, then replayed to it."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_json(header(scope, b"content-type")):
            await self.app(scope, receive, send)
            return
        body = await _read(receive)
        if body is None:
            return  # the client left mid-body: nobody to answer
        if len(body) > IN_THREAD_BYTES:
            refused = await anyio.to_thread.run_sync(check, body)
        else:
            refused = check(body)
        if refused is not None:
            await refuse(send, refused.status, refused.title, refused.detail, refused.problems)
            return
        await self.app(scope, _replay(body, receive), send)


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI will parse the body as JSON: its own test (fastapi/routing.py), word for
    word, so no Content-Type reaches its json.loads that this layer let by unchecked."""
    if not content_type:
        return False  # FastAPI's strict_content_type (the default) parses no untyped body
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def check(body: bytes) -> Refusal | None:
    """Why a JSON body is refused, or None when the app may parse it."""
    if not body:
        return None  # FastAPI reads no body at all: the route says what is missing
    # 1. Strict UTF-8 (RFC 8259), which also refuses an encoded surrogate (ED A0 80).
    try:
        document = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"byte 0x{body[exc.start]:02x} at position {exc.start}"
        return _unreadable(f"the body is not UTF-8: {where} ({exc.reason})", where)
    # 2. The marks, before any parser makes an object of them.
    for mark, name in MARKS.items():
        count = body.count(mark)
        if count > MAX_MARKS:
            shown = f"{count} {mark.decode()!r}"
            rule = (
                f"at most {MAX_MARKS} {mark.decode()!r} in a JSON body (a request's {name}s"
                f" need under 100, its two prompts at most {2 * MAX_PROMPT_CHARS})"
            )
            return _rejected([Problem("body", shown, rule)])
    # 3. Parsed once; the hooks mark what a float or JSON itself cannot hold.
    try:
        parsed = json.loads(document, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno} (char {exc.pos})"
        return _unreadable(f"the body is not JSON: {exc.msg} at {where}", where)
    except RecursionError:
        rule = f"at most {MAX_DEPTH} levels of arrays and objects"
        return _rejected([Problem("body", "nested past Python's recursion limit", rule)])
    # 4. The walk.
    problems = list(_problems(parsed))
    return _rejected(problems) if problems else None


def _constant(name: str) -> _Unfit:
    return _Unfit(name, "NaN, Infinity and -Infinity are not JSON numbers (RFC 8259)")


def _float(text: str) -> float | _Unfit:
    if len(text) > MAX_NUMBER_CHARS:
        return _Unfit(text, f"a number of at most {MAX_NUMBER_CHARS} characters")
    value = float(text)
    if math.isinf(value):
        return _Unfit(text, "a number a 64-bit float holds (at most about 1.8e308)")
    return value


def _int(text: str) -> int | _Unfit:
    if len(text) > MAX_NUMBER_CHARS:
        return _Unfit(text, f"a number of at most {MAX_NUMBER_CHARS} characters")
    return int(text)


def _problems(parsed: Any) -> Iterator[Problem]:
    """Each problem of a parsed body in document order: a container too deep or too wide, a lone
    surrogate (in a key or a value), a number a hook refused. Depth-first with a stack, so no
    recursion to exhaust; a container refused is not entered."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(parsed, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, _Unfit):
            yield Problem(_field(path), echo(value.text), value.rule)
        elif isinstance(value, str):
            yield from _unicode(path, value)
        elif isinstance(value, (dict, list)):
            refused = _container(value, path)
            if refused is not None:
                yield refused
            elif isinstance(value, dict):
                for key in value:
                    yield from _unicode((*path, key), key)
                stack.extend((item, (*path, key)) for key, item in reversed(value.items()))
            else:
                stack.extend(
                    (item, (*path, str(n))) for n, item in reversed(list(enumerate(value)))
                )


def _container(value: dict[str, Any] | list[Any], path: tuple[str, ...]) -> Problem | None:
    """Why an object or array is refused as a whole, or None. Each extra key past RenderRequest's
    own costs pydantic an error: 9,000 of them kept the event loop 130 ms."""
    kind = "an object" if isinstance(value, dict) else "an array"
    if len(path) >= MAX_DEPTH:
        rule = f"at most {MAX_DEPTH} levels of arrays and objects"
        return Problem(_field(path), f"{kind} at level {len(path) + 1}", rule)
    if len(value) > MAX_ENTRIES:
        rule = f"at most {MAX_ENTRIES} entries in an object or array"
        return Problem(_field(path), f"{kind} of {len(value)} entries", rule)
    return None


def _field(path: tuple[str, ...]) -> str:
    return ".".join(path) or "body"


def _unicode(path: tuple[str, ...], value: str) -> Iterator[Problem]:
    """A lone surrogate ("\\ud800") is valid JSON but no tokenizer, encoder or file takes it."""
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        rule = f"must be valid Unicode text: lone surrogate at position {exc.start}"
        yield Problem(_field(path), echo(value), rule)


def _unreadable(detail: str, where: str) -> Refusal:
    problem = Problem("body", where, "must be UTF-8 JSON (RFC 8259)")
    return Refusal(400, "Unreadable body", detail, (problem,))


def _rejected(problems: list[Problem]) -> Refusal:
    shown = problems[:MAX_PROBLEMS]
    detail = str(RequestRejected(shown))
    if len(problems) > len(shown):
        detail += f" (errors lists the first {len(shown)} of {len(problems)} problems)"
    return Refusal(422, "Request rejected", detail, tuple(shown))


async def _read(receive: Receive) -> bytes | None:
    """The whole body, or None when the client disconnects first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body read, then what the client sends next (the
    disconnect a response waits on)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
