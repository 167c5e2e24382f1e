"""Real processes for queue tests: `kiln worker` subprocesses, private redis-server instances, and
a slow tiny model (the tiny sd15 weights at 256 px) so a job runs long enough to kill mid-way."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis import Redis

from tests.conftest import MANIFESTS, ROOT
from tests.fixtures.gate import Gate
from tests.fixtures.pacing import pacing

SLOW_MODEL = "tiny-slow"


LAUNCHER = "tests.fixtures.kiln_worker"  # the one launcher of a faked `kiln worker`


@dataclass(frozen=True)
class Options:
    """How a `kiln worker` under test differs from the real one: KILN_* settings (a short lease,
    quick backoffs) and test fakes (a gate, paced steps, a death), all as its environment. With
    a fake it runs through tests/fixtures/kiln_worker.py, which reads them; without, as
    `python -m worker.cli`."""

    env: dict[str, str] = field(default_factory=dict)

    def __or__(self, other: Options) -> Options:
        return Options({**self.env, **other.env})

    @property
    def module(self) -> str:
        return LAUNCHER if any(k.startswith("KILN_TEST_") for k in self.env) else "worker.cli"


def short_lease(lease_s: int) -> Options:
    """A lease of lease_s seconds in place of 10, heartbeat and sweep at a quarter of it: a test
    that waits for a lapsed lease waits seconds, not tens of them, on the same code."""
    beat = str(lease_s / 4)
    return Options({"KILN_LEASE_S": str(lease_s), "KILN_HEARTBEAT_S": beat, "KILN_SWEEP_S": beat})


def gated(gate: Gate, lease_s: int | None = None) -> Options:
    """A worker whose jobs wait at this gate (tests/fixtures/gate.py) until the test opens it;
    lease_s: its lease, in place of 10 s (short_lease)."""
    options = Options(dict(gate.env))
    return options if lease_s is None else options | short_lease(lease_s)


def paced(seconds: float) -> Options:
    """Denoise steps that each also sleep this long (tests/fixtures/pacing.py)."""
    return Options({"KILN_TEST_PACE_S": str(seconds)})


# SIGKILLed the instant a job's files are written, before it could tell Redis it finished.
DIES_AFTER_SAVE = Options({"KILN_TEST_DIES_AFTER": "save"})
# SIGKILLed the instant a job's result.json is written, before its timing record.
DIES_AFTER_RESULT = Options({"KILN_TEST_DIES_AFTER": "result"})
# A store outage's backoff 1 s twice instead of 10, 30 and 90 s.
QUICK_BACKOFF = Options({"KILN_STORE_BACKOFF_S": "1,1"})
# Webhook senders take a delivery under a 1 s lease instead of 60 s.
QUICK_WEBHOOK_LEASE = Options({"KILN_WEBHOOK_LEASE_S": "1"})


def pace_here(monkeypatch: Any, seconds: float) -> None:
    """Denoise steps that each take at least this long, for an in-process worker, undone when
    the test ends: a window of known length for a rate (test_budget), never a synchronisation
    (a test that acts mid-job holds it at a gate instead: gated(), gate.hold_here())."""
    from worker.queue.job import RQJobContext

    monkeypatch.setattr(RQJobContext, "progress", pacing(seconds))


STARTUP_S = 90.0  # torch + diffusers import, model load; generous on a shared 2-core machine


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.05) -> Any:
    """Poll until predicate() is truthy; its value, or AssertionError naming what never happened."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def slow_manifests(directory: Path) -> Path:
    """The repo's manifests plus tiny-slow: tiny sd15 weights, 256 px only (~16x a 128 px step)."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in MANIFESTS.glob("*.yaml"):
        shutil.copy(path, directory / path.name)
    text = (MANIFESTS / "tiny-sd15.yaml").read_text()
    text = text.replace("id: tiny-sd15", f"id: {SLOW_MODEL}")
    text = text.replace(
        "resolutions: [[128, 128], [192, 128], [128, 192]]", "resolutions: [[256, 256]]"
    )
    assert f"id: {SLOW_MODEL}" in text and "[[256, 256]]" in text, "tiny-sd15.yaml changed shape"
    (directory / f"{SLOW_MODEL}.yaml").write_text(text)
    return directory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class WorkerProcess:
    """`kiln worker` in its own process (with these options), output kept in a log file;
    errors: stderr in a file of its own (merged, a line of one could land inside the other)."""

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        *args: str,
        options: Options | None = None,
        errors: Path | None = None,
    ) -> None:
        self.log = log
        self.err = errors
        self.name = f"test-worker-{os.getpid()}-{time.monotonic_ns()}"
        options = options or Options()
        with open(log, "ab") as out, open(errors or os.devnull, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", options.module, "worker", "--name", self.name, *args],
                env={**env, **options.env},
                cwd=ROOT,
                stdout=out,
                stderr=err if errors else subprocess.STDOUT,
            )

    def wait_ready(self, conn: Redis, timeout: float = STARTUP_S) -> None:
        from api_client import keys

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.output()}")
            return bool(conn.exists(keys.worker_key(self.name)))

        wait_until(ready, timeout, f"worker {self.name} to publish its state", poll=0.2)

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        """The end of its output (stderr's too, when apart)."""
        errors = self.err.read_text(errors="replace") if self.err else ""
        return self.log.read_text(errors="replace")[-6000:] + errors[-6000:]

    def terminate(self, timeout: float = 60) -> tuple[int, str]:
        """SIGTERM (a warm shutdown: the job it holds finishes), then its exit status and its
        whole stdout."""
        if self.proc.poll() is None:
            self.proc.terminate()
        code = self.proc.wait(timeout=timeout)
        return code, self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


class RedisServer:
    """A private redis-server on a free port: restartable, with AOF, ACL users and TLS if asked."""

    def __init__(self, directory: Path, *extra: str, tls: Path | None = None) -> None:
        self.directory = directory
        self.port = free_port()
        self.extra = list(extra)
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        argv = ["redis-server", "--bind", "127.0.0.1", "--dir", str(self.directory), "--save", ""]
        if self.tls is not None:
            argv += ["--port", "0", "--tls-port", str(self.port)]
            argv += [
                "--tls-cert-file",
                str(self.tls / "server.crt"),
                "--tls-key-file",
                str(self.tls / "server.key"),
            ]
            argv += ["--tls-ca-cert-file", str(self.tls / "ca.crt"), "--tls-auth-clients", "no"]
        else:
            argv += ["--port", str(self.port)]
        return argv + self.extra

    def start(self) -> None:
        with open(self.directory / "redis.log", "ab") as out:
            self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT)
        wait_until(self._listening, 20, f"redis-server on port {self.port}")

    def _listening(self) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    def kill(self) -> None:
        """SIGKILL: no shutdown save; only what the AOF already holds survives."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=20)

    def restart(self) -> None:
        self.kill()
        self.start()


def make_tls_files(directory: Path) -> Path:
    """A throwaway CA and a server certificate for 127.0.0.1, made with openssl."""
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=kiln-test-ca",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    )
    (directory / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
    )
    return directory


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
