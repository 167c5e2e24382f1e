"""Every `kiln` verb that talks to Redis gets its connection from api_client.connection.connect:
a redis+sentinel:// URL, which redis-py's Redis.from_url refuses, works for each."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import kiln
from tests.support.sentinel import sentinel_for
from tests.workers import RedisServer

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
    try:
        with sentinel_for(directory, master.port) as url:
            yield url
    finally:
        master.kill()


def test_every_redis_verb_takes_a_sentinel_url(tmp_path: Path, kiln_env: dict[str, str]) -> None:
    with sentinel_url(tmp_path) as url:
        env = {**kiln_env, "KILN_REDIS_URL": url}
        for verb in VERBS:
            done = kiln(*verb, env=env)
            assert done.returncode == 0, (verb, done.stderr)
        listed = kiln("models", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        assert "tiny-sd15" in [m["id"] for m in json.loads(listed.stdout)]  # published above
