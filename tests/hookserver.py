"""A live webhook receiver for tests: http.server on 127.0.0.1 in a thread, keeping every POST
(headers, looked up in any case as HTTP has them, and body). It can be started late on a fixed
port, to play a receiver that was down."""

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


class HookServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        # A slow receiver: while this is clear, each request waits (up to 60 s) before answering.
        self.answering = threading.Event()
        self.answering.set()
        self.received: list[Received] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/kiln-hook"

    def start(self) -> None:
        received = self.received
        answering = self.answering

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                answering.wait(60)
                received.append(Received(self.path, Headers(self.headers.items()), body))
                self.send_response(204)
                self.end_headers()

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
        wait_until(lambda: len(self.received) >= count, timeout, f"{count} webhook deliveries")
        return list(self.received)
