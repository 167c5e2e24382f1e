"""An idle worker and a Redis that goes away, as an operator meets them: a real `kiln worker`
talking to a real redis-server through a TCP forwarder (a load balancer, a container's port),
which takes connections even while Redis is down. One outage leaves one `redis_lost` and one
`redis_regained`, the latter only once Redis answers again (a TCP connect is not an answer);
the first SIGTERM stops an idle worker within seconds, whether Redis is up or down, with no
minute of retries and no line every 2 s from RQ's pub/sub thread."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.support.tcp import Forwarder
from tests.workers import Options, RedisServer, WorkerProcess, wait_until

STOP_S = 5.0  # SIGTERM to exit, idle: measured 0.8 s with Redis up, 1.5 s down (2 cores)
JSON_LOGS = Options({"KILN_LOG_FORMAT": "json"})


class Watched(WorkerProcess):
    """A worker whose JSON log lines can be read back by event."""

    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    found.append(json.loads(line))
                except ValueError:
                    continue
        return found

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("event") == name]

    def said(self, words: str) -> list[str]:
        return [str(e["event"]) for e in self.events() if words in str(e.get("event"))]


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.kill()


def test_one_outage_is_one_lost_and_one_regained_and_sigterm_stops_an_idle_worker_at_once(
    kiln_env: dict[str, str], tmp_path: Path, redis: RedisServer
) -> None:
    forwarder = Forwarder(redis.port)
    forwarder.start()
    env = {**kiln_env, "KILN_REDIS_URL": f"redis://127.0.0.1:{forwarder.port}/0"}
    worker = Watched(env, tmp_path / "worker.log", "--models", "tiny-sd15", options=JSON_LOGS)
    try:
        worker.wait_ready(Redis(port=redis.port))
        # 1. Redis goes away; the forwarder goes on taking the worker's connects and closing them.
        redis.kill()
        wait_until(lambda: worker.named("redis_lost"), 30, "the worker to log redis_lost")
        time.sleep(4.0)  # connects taken and closed, retried: none is Redis answering
        assert worker.named("redis_regained") == [], worker.output()
        back_at = time.monotonic()
        redis.start()  # the same port, empty
        regained = wait_until(lambda: worker.named("redis_regained"), 30, "redis_regained")
        assert time.monotonic() - back_at < 5.0  # noticed at the next retry (backoff <= 2 s)
        assert len(worker.named("redis_lost")) == 1 and len(regained) == 1, worker.output()
        # 2. A second outage, and SIGTERM while the worker retries: it stops within seconds.
        redis.kill()
        wait_until(lambda: len(worker.named("redis_lost")) == 2, 30, "the second redis_lost")
        time.sleep(1.0)
        sent = time.monotonic()
        worker.signal(signal.SIGTERM)
        code = worker.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        worker.stop()
        forwarder.stop()
    assert code == 0, worker.output()
    assert took < STOP_S, (took, worker.output())
    assert worker.said("warm shutdown") == [
        "warm shutdown requested (signal 15): no job running, stopping"
    ]
    assert len(worker.named("redis_lost")) == 2 and len(worker.named("redis_regained")) == 1
    assert worker.said("could not connect") == [], worker.output()  # RQ's pub/sub, every 2 s
    assert worker.said("could not reach Redis") == [], worker.output()
