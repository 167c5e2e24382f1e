"""Every `kiln` verb that talks to Redis gets its connection from api_client.connection.connect:
a redis+sentinel:// URL, which redis-py's Redis.from_url refuses, works for each."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from api_client.connection import connect
from tests.conftest import kiln
from tests.workers import RedisServer, free_port, wait_until

VERBS = [
    ("quarantine",),
    ("webhooks",),
    ("top", "--once"),
    ("jobs",),
    ("api", "token", "list"),
    ("manifests", "publish"),
]


@contextmanager
def sentinel_url(directory: Path) -> Iterator[str]:
    """A redis-server and a redis-sentinel monitoring it as `kiln`: the sentinel URL."""
    master = RedisServer(directory)
    master.start()
    port = free_port()
    conf = directory / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
        f"sentinel monitor kiln 127.0.0.1 {master.port} 1\n"
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
        master.kill()


def _answers(url: str) -> bool:
    try:
        return bool(connect(url).ping())
    except Exception:
        return False


def test_every_redis_verb_takes_a_sentinel_url(tmp_path: Path, kiln_env: dict[str, str]) -> None:
    with sentinel_url(tmp_path) as url:
        env = {**kiln_env, "KILN_REDIS_URL": url}
        for verb in VERBS:
            done = kiln(*verb, env=env)
            assert done.returncode == 0, (verb, done.stderr)
        listed = kiln("models", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        assert "tiny-sd15" in [m["id"] for m in json.loads(listed.stdout)]  # published above
