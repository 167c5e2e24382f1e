"""The local webhook receiver (`kiln webhooks listen`, api_client/listen.py) over real HTTP: a
delivery signed with its secret is verified, printed and saved whole; one signed with another
secret is saved, printed with the reason and answered 401 so its sender retries."""

from __future__ import annotations

import base64
import io
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_client.listen import Receiver, listen
from api_client.schema import JobEvent
from api_client.webhooks import webhook_headers

SECRET = "whsec_" + base64.b64encode(b"listen-secret-0123456789abcdef!!").decode()
OTHER = "whsec_" + base64.b64encode(b"another-secret-0123456789abcdef!").decode()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[Receiver, io.StringIO]]:
    out = io.StringIO()
    server = listen(0, SECRET, tmp_path / "hooks", out=out)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, out
    server.shutdown()
    server.server_close()


def deliver(server: Receiver, path: str, secret: str, msg_id: str) -> int:
    event = JobEvent(kind="done", job_id="job-1", model="tiny-sd15", at=1.0)
    body = event.model_dump_json().encode()
    headers = {
        **webhook_headers(secret, msg_id, event.kind, body),
        "content-type": "application/json",
    }
    port = server.server_address[1]
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_signed_delivery_is_verified_printed_and_saved(
    receiver: tuple[Receiver, io.StringIO], tmp_path: Path
) -> None:
    server, out = receiver
    assert deliver(server, "/any/path", SECRET, "msg_one") == 204
    [line] = out.getvalue().splitlines()
    assert line.startswith("/any/path msg_one: verified (done of job job-1)")
    saved = tmp_path / "hooks"
    assert JobEvent.model_validate_json((saved / "msg_one.body").read_bytes()).job_id == "job-1"
    headers = (saved / "msg_one.headers").read_text()
    assert "webhook-id: msg_one" in headers and "webhook-signature: v1," in headers
    assert not [p for p in saved.iterdir() if p.name.startswith(".incoming-")]


def test_a_delivery_with_another_secret_is_refused_and_says_why(
    receiver: tuple[Receiver, io.StringIO], tmp_path: Path
) -> None:
    server, out = receiver
    assert deliver(server, "/", OTHER, "msg_two") == 401
    assert "msg_two: NOT verified: webhook-signature has no v1 signature" in out.getvalue()
    assert (tmp_path / "hooks" / "msg_two.body").is_file()


def test_a_secret_that_is_not_one_is_refused_before_listening(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="whsec_"):
        listen(0, "not-a-secret", tmp_path)


def test_kiln_webhooks_listen_receives_on_the_base_install(tmp_path: Path) -> None:
    """The verb itself, as a process: it prints where it listens and a line per delivery."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "worker.cli", "webhooks", "listen", "--port", str(port)]
    command += ["--secret", SECRET, "--dir", str(tmp_path / "got")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
                time.sleep(0.05)

        class Bound:
            server_address = ("127.0.0.1", port)

        assert deliver(Bound(), "/hook", SECRET, "msg_cli") == 204  # type: ignore[arg-type]
        assert (tmp_path / "got" / "msg_cli.headers").is_file()
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    assert "msg_cli: verified" in out and f"http://127.0.0.1:{port}/" in err
