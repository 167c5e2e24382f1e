"""A server of a test's own: 127.0.0.1 on a free port, or a fixed one to play a server that was
down and comes back, serving from a daemon thread until stop(). A subclass says how it answers
(handler()) and, below HTTP, what server it runs (make_server())."""

from __future__ import annotations

import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.workers import free_port


class QuietHandler(BaseHTTPRequestHandler):
    """An HTTP handler that logs nothing: the test says what went wrong."""

    def log_message(self, *args: object) -> None:
        return None


class LocalServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._server: socketserver.BaseServer | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def handler(self) -> type[socketserver.BaseRequestHandler]:
        """The handler class, made per start so that it can reach this server by closure."""
        raise NotImplementedError

    def make_server(
        self, handler: type[socketserver.BaseRequestHandler]
    ) -> socketserver.BaseServer:
        return ThreadingHTTPServer(("127.0.0.1", self.port), handler)

    def start(self) -> None:
        self._server = self.make_server(self.handler())
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
