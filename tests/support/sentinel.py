"""A real redis-sentinel for a test: it monitors a redis-server the test started, as the service
`kiln`, and hands back the redis+sentinel:// URL kiln's client and worker take."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from api_client.connection import connect
from tests.workers import free_port, wait_until


@contextmanager
def sentinel_for(directory: Path, master_port: int, *lines: str) -> Iterator[str]:
    """A redis-sentinel (its config, log and state under directory) monitoring the redis-server
    at master_port as `kiln`, with lines of its own config (`sentinel down-after-milliseconds
    kiln 1000`): its URL, once it knows the master; stopped on the way out."""
    port = free_port()
    conf = directory / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
        f"sentinel monitor kiln 127.0.0.1 {master_port} 1\n" + "".join(f"{x}\n" for x in lines)
    )
    with open(directory / "sentinel.log", "ab") as out:
        sentinel = subprocess.Popen(
            ["redis-server", str(conf), "--sentinel"], stdout=out, stderr=subprocess.STDOUT
        )
    url = f"redis+sentinel://127.0.0.1:{port}/kiln/0"
    try:
        wait_until(lambda: _answers(url), 20, "the sentinel to know the master")
        yield url
    finally:
        sentinel.terminate()
        sentinel.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        return bool(connect(url).ping())
    except Exception:
        return False
