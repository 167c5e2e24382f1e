"""A TCP forwarder in front of a server, as a load balancer or a container's published port
stands in front of Redis: it takes every connection, and when the server behind it is down it
closes what it took instead of refusing it."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading


class Forwarder:
    """127.0.0.1:port -> 127.0.0.1:target, each direction of a connection on its own thread."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])

    def _handler(self) -> type[socketserver.BaseRequestHandler]:
        target = self.target

        class Pump(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    backend = socket.create_connection(("127.0.0.1", target), timeout=2)
                except OSError:
                    return  # accepted, then closed: the server behind is down
                backend.settimeout(None)
                back = threading.Thread(target=_pump, args=(backend, self.request), daemon=True)
                back.start()
                _pump(self.request, backend)
                back.join(timeout=5)

        return Pump

    def start(self) -> None:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy until either side closes, then close both (the other pump ends with them)."""
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
