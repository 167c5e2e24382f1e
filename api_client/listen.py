"""`kiln webhooks listen`: a local webhook receiver on any path, for trying webhooks out (and for
docs/curl.md). Each delivery is checked against the Standard Webhooks signature when a secret is
given, printed as one line ("verified" or why not), and saved: its body as <webhook-id>.body and
its headers as <webhook-id>.headers (`name: value` lines), each file written whole and then
renamed into the directory, the headers last, so a reader that sees the headers file sees both.

Standard library only (http.server): the base install runs it. A verified delivery answers 204;
one whose signature fails answers 401, so the sender keeps it and retries (and its dead letter
says why)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO

from api_client.webhooks import ID_HEADER, MAX_DATA_BYTES, WebhookInvalid, verify_webhook

SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MAX_BODY = MAX_DATA_BYTES + 64 * 1024  # a JobEvent carries its data base64 and a little more


class Receiver(ThreadingHTTPServer):
    """The server: where deliveries are saved, the secret they are checked with (None: saved
    unchecked), and where each delivery's line goes."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], directory: Path, secret: str | None, out: IO[str]
    ) -> None:
        super().__init__(address, Delivery)
        self.directory, self.secret, self.out = directory, secret, out


class Delivery(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        length = self.headers.get("content-length", "")
        if not length.isdigit() or int(length) > MAX_BODY:
            self._answer(413 if length.isdigit() else 411, f"refused: content-length {length!r}")
            return
        body = self.rfile.read(int(length))
        headers = {name.lower(): value for name, value in self.headers.items()}
        verdict, status = self._verdict(body, headers)
        name = headers.get(ID_HEADER, "")
        if not SAFE_ID.fullmatch(name):
            name = f"unnamed-{os.getpid()}-{id(body)}"
        saved = _save(self.server.directory, name, body, headers)
        self._answer(status, f"{self.path} {headers.get(ID_HEADER, '-')}: {verdict} -> {saved}")

    def _verdict(self, body: bytes, headers: dict[str, str]) -> tuple[str, int]:
        if self.server.secret is None:
            return "saved, not verified (no --secret)", 204
        try:
            event = verify_webhook(self.server.secret, body, headers)
        except WebhookInvalid as exc:
            return f"NOT verified: {exc}", 401
        return f"verified ({event.kind} of job {event.job_id})", 204

    def _answer(self, status: int, line: str) -> None:
        print(line, file=self.server.out, flush=True)
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return  # one line a delivery, printed by _answer


def _save(directory: Path, name: str, body: bytes, headers: dict[str, str]) -> Path:
    lines = "".join(f"{key}: {value}\n" for key, value in sorted(headers.items()))
    _write_whole(directory / f"{name}.body", body)
    _write_whole(directory / f"{name}.headers", lines.encode())
    return directory / f"{name}.body"


def _write_whole(path: Path, data: bytes) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".incoming-")
    with os.fdopen(handle, "wb") as out:
        out.write(data)
    os.replace(temporary, path)


def listen(
    port: int,
    secret: str | None,
    directory: Path,
    host: str = "127.0.0.1",
    out: IO[str] = sys.stdout,
) -> Receiver:
    """A receiver bound on host:port (0: any free port), not yet serving: call serve_forever()."""
    directory.mkdir(parents=True, exist_ok=True)
    if secret is not None:
        from api_client.webhooks import secret_key

        secret_key(secret)  # ValueError naming the form a secret takes
    return Receiver((host, port), directory, secret, out)
