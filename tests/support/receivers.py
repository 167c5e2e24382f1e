"""Webhook receivers for tests, each at url on 127.0.0.1 (tests/support/servers.py):
HookServer keeps every POST (headers, found in any case as HTTP has them, and body) and can
answer slowly or with a failing status; SavingReceiver saves each delivery to files as
docs/curl.md expects; HungReceiver reads each request and never answers; MalformedReceiver
answers with a status line that is not HTTP. SECRET signs what they receive: targets() names
it in KILN_WEBHOOKS, published() makes a worker's publish it, sender() is a Dispatcher of that
one target, job_event() what it sends."""

from __future__ import annotations

import base64
import json
import os
import re
import socketserver
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from redis import Redis

from api_client import KilnClient
from api_client.schema import JobEvent
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.servers import LocalServer, QuietHandler
from tests.workers import wait_until
from worker.queue.upkeep.webhooks import Dispatcher
from worker.render.renderer import Renderer
from worker.settings import Settings, WebhookTarget

SECRET = "whsec_" + base64.b64encode(b"receiver-secret-0123456789abcdef").decode()


def targets(url: str, secret: str = SECRET) -> str:
    """KILN_WEBHOOKS naming one target, "studio", at url."""
    return json.dumps({"studio": {"url": url, "secret": secret}})


def published(conn: Redis, settings: Settings) -> tuple[KilnClient, Renderer]:
    """A client and a tiny-sd15 renderer of these settings, once an idle pass of it has published
    their webhook targets: a client accepts only a published target."""
    renderer = make_renderer(settings, ["tiny-sd15"])
    burst(conn, renderer, ["tiny-sd15"])
    return client_for(conn, settings), renderer


def sender(conn: Redis, url: str, **options: Any) -> Dispatcher:
    """A webhook sender of the one target "studio" at url, signing with SECRET."""
    return Dispatcher({"studio": WebhookTarget(url=url, secret=SECRET)}, conn, **options)


def job_event(job_id: str = "job-1", kind: Any = "failed") -> JobEvent:
    return JobEvent(kind=kind, job_id=job_id, model="tiny-sd15", at=time.time(), error="boom")


class Headers(dict[str, str]):
    """Header names stored lowercased and found in any case (`headers["Webhook-Id"]`)."""

    def __init__(self, items: Iterable[tuple[str, str]]) -> None:
        super().__init__((name.lower(), value) for name, value in items)

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())


@dataclass(frozen=True)
class Received:
    path: str
    headers: Headers
    body: bytes
    status: int = 204  # what this request was answered


class Receiver(LocalServer):
    @property
    def url(self) -> str:
        return f"{self.endpoint}/kiln-hook"


class HookServer(Receiver):
    """Started late on a fixed port it plays a receiver that was down; with `status` and
    `answer` one that is deploying. `received` keeps every request, `delivered()` those
    answered 2xx."""

    def __init__(self, port: int | None = None) -> None:
        super().__init__(port)
        # A slow receiver: while this is clear, each request waits (up to 60 s) before answering.
        self.answering = threading.Event()
        self.answering.set()
        self.status = 204  # the answer to each request from now on
        self.answer = b""  # and its body
        self.received: list[Received] = []

    def handler(self) -> type[socketserver.BaseRequestHandler]:
        server = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.answering.wait(60)
                status, answer = server.status, server.answer
                headers = Headers(self.headers.items())
                server.received.append(Received(self.path, headers, body, status))
                self.send_response(status)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        return Handler

    def wait_for(self, count: int, timeout: float = 30) -> list[Received]:
        """The first count requests (answered 2xx unless `status` says otherwise)."""
        wait_until(lambda: len(self.received) >= count, timeout, f"{count} webhook deliveries")
        return list(self.received)

    def delivered(self) -> list[Received]:
        return [r for r in self.received if 200 <= r.status < 300]


class SavingReceiver(Receiver):
    """A receiver as docs/curl.md expects one: each delivery's body byte for byte in
    <webhook-id>.body and its headers as `name: value` lines in <webhook-id>.headers, written
    last (and renamed into place), so a .headers file means the delivery is all there."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        self.count = 0

    def handler(self) -> type[socketserver.BaseRequestHandler]:
        receiver = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                name = re.sub(r"[^A-Za-z0-9_-]", "_", self.headers.get("webhook-id", "none"))
                base = receiver.directory / name
                base.with_suffix(".body").write_bytes(body)
                lines = "".join(f"{k}: {v}\n" for k, v in self.headers.items())
                partial = base.with_suffix(".partial")
                partial.write_text(lines, encoding="utf-8")
                os.replace(partial, base.with_suffix(".headers"))
                receiver.count += 1
                self.send_response(204)
                self.end_headers()

        return Handler


class _ReusableServer(socketserver.ThreadingTCPServer):
    # Reusable at once by the receiver that replaces this one on the same port.
    allow_reuse_address = True
    daemon_threads = True


class RawReceiver(Receiver):
    """A receiver below HTTP: it reads each request whole, counts it in `requests`, then
    answer() writes what goes back, if anything."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    def make_server(
        self, handler: type[socketserver.BaseRequestHandler]
    ) -> socketserver.BaseServer:
        return _ReusableServer(("127.0.0.1", self.port), handler)

    def handler(self) -> type[socketserver.BaseRequestHandler]:
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                length = 0
                while (line := self.rfile.readline()) not in (b"\r\n", b""):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.rfile.read(length)
                outer.requests += 1
                outer.answer(self.wfile)

        return Handler

    def answer(self, out: BinaryIO) -> None:
        raise NotImplementedError


class HungReceiver(RawReceiver):
    """Answers nothing until stop(): a sender's try against it lasts until its own timeout."""

    def __init__(self) -> None:
        super().__init__()
        self._release = threading.Event()

    def answer(self, out: BinaryIO) -> None:
        self._release.wait(120)

    def stop(self) -> None:
        self._release.set()
        super().stop()


class MalformedReceiver(RawReceiver):
    """Answers every request with a status line that is not HTTP, so the sender's http.client
    raises BadStatusLine (an http.client.HTTPException, not an OSError)."""

    ANSWER = b"HTTP/1.1 two-hundred OK\r\nContent-Length: 0\r\n\r\n"

    def answer(self, out: BinaryIO) -> None:
        out.write(self.ANSWER)
