"""Redis Sentinel URLs: client and worker find the master through a real redis-sentinel, and
keep working after the sentinel fails over to the replica."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from api_client import KilnClient
from api_client.connection import parse_sentinel_url
from tests.support.inprocess import make_renderer, make_worker
from tests.support.sentinel import sentinel_for
from tests.workers import RedisServer, wait_until
from worker.queue.lease import worker_connection

REQUEST = {"model": "tiny-sd15", "prompt": "a gull", "steps": 2, "seed": 4}


def test_sentinel_urls_parse_hosts_service_db_and_auth() -> None:
    service, db, hosts, auth, sentinel_auth = parse_sentinel_url(
        "redis+sentinel://kiln:pw@s1:26379,s2/kiln-main/2?sentinel_password=sp"
    )
    assert (service, db, hosts) == ("kiln-main", 2, [("s1", 26379), ("s2", 26379)])
    assert auth == {"username": "kiln", "password": "pw"} and sentinel_auth == {"password": "sp"}
    with pytest.raises(ValueError, match="needs the service name"):
        parse_sentinel_url("redis+sentinel://s1:26379")


def test_client_and_worker_ride_a_sentinel_failover(tmp_path: Path, make_settings: Any) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    master = RedisServer(tmp_path / "a")
    master.start()
    replica = RedisServer(tmp_path / "b", "--replicaof", "127.0.0.1", str(master.port))
    replica.start()
    try:
        with sentinel_for(
            tmp_path,
            master.port,
            "sentinel down-after-milliseconds kiln 1000",
            "sentinel failover-timeout kiln 5000",
        ) as url:
            settings = make_settings(redis_url=url)
            client = KilnClient(url, manifests_dir=settings.manifests)
            renderer = make_renderer(settings, ["tiny-sd15"])
            first = client.submit(REQUEST)
            make_worker(worker_connection(url), renderer, ["tiny-sd15"]).work(burst=True)
            assert first.wait(timeout=5).steps == 2

            wait_until(lambda: _replica_synced(replica.port), 20, "the replica to catch up")
            master.kill()
            started = time.monotonic()
            second = client.submit({**REQUEST, "seed": 5})  # retried until the new master answers
            make_worker(worker_connection(url), renderer, ["tiny-sd15"]).work(burst=True)
            assert second.wait(timeout=5).seed == 5
            assert client.job(first.id).result() is not None  # the replica had it
            elapsed = time.monotonic() - started
            print(f"\nfailover: second job done {elapsed:.1f} s after the kill")
    finally:
        master.kill()
        replica.kill()


def _replica_synced(port: int) -> bool:
    from redis import Redis

    info = Redis(port=port).info("replication")
    return bool(info.get("master_link_status") == "up")
