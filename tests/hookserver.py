"""A live webhook receiver for tests: http.server on 127.0.0.1 in a thread, keeping every POST
(headers, looked up in any case as HTTP has them, and body). It can be started late on a fixed
port, to play a receiver that was down, or answer a failing status (`status`, `answer`) to play
one that is deploying; `received` keeps every request, `delivered()` those answered 2xx."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.workers import free_port, wait_until


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


class HookServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        # A slow receiver: while this is clear, each request waits (up to 60 s) before answering.
        self.answering = threading.Event()
        self.answering.set()
        self.status = 204  # the answer to each request from now on
        self.answer = b""  # and its body
        self.received: list[Received] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/kiln-hook"

    def start(self) -> None:
        received = self.received
        answering = self.answering
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                answering.wait(60)
                status, answer = server.status, server.answer
                received.append(Received(self.path, Headers(self.headers.items()), body, status))
                self.send_response(status)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def wait_for(self, count: int, timeout: float = 30) -> list[Received]:
        """The first count requests (answered 2xx unless `status` says otherwise)."""
        wait_until(lambda: len(self.received) >= count, timeout, f"{count} webhook deliveries")
        return list(self.received)

    def delivered(self) -> list[Received]:
        return [r for r in self.received if 200 <= r.status < 300]
