"""A store outage that heals puts the job back for later, with backoff, a bounded number of
times, then fails it naming the cause: a real worker, a real S3 server behind a proxy that
answers 503 while the test says so (tests/fixtures/flaky_s3.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from api_client import KilnClient, RenderFailed
from tests.fixtures.flaky_s3 import FlakyS3
from tests.s3server import MotoServer
from tests.support.records import records
from tests.workers import QUICK_BACKOFF, WorkerProcess, wait_until

REQUEST = {"model": "tiny-sd15", "prompt": "outage", "steps": 2, "seed": 9}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[MotoServer, FlakyS3]]:
    server = MotoServer(tmp_path / "moto.log")
    server.start()
    server.setup()
    proxy = FlakyS3(server.endpoint)
    proxy.start()
    yield server, proxy
    proxy.stop()
    server.stop()


@pytest.fixture
def running(
    redis_conn: Redis,
    kiln_env: dict[str, str],
    settings: Any,
    store: tuple[MotoServer, FlakyS3],
    tmp_path: Path,
) -> Iterator[Any]:
    """A real worker whose store goes through the proxy, with a 1 s backoff; its settings."""
    server, proxy = store
    s3 = server.store_settings(prefix="outage")
    env = {
        **kiln_env,
        "KILN_OUTPUT_URL": s3["output_url"],
        "AWS_ENDPOINT_URL": proxy.endpoint,
        "AWS_REGION": s3["aws_region"],
        "AWS_ACCESS_KEY_ID": s3["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": s3["aws_secret_access_key"],
    }
    worker = WorkerProcess(env, tmp_path / "w.log", "--models", "tiny-sd15", options=QUICK_BACKOFF)
    try:
        worker.wait_ready(redis_conn)
        yield settings
    finally:
        worker.stop()


def test_a_store_outage_that_heals_puts_the_job_back_and_it_finishes(
    redis_conn: Redis, store: tuple[MotoServer, FlakyS3], running: Any
) -> None:
    server, proxy = store
    settings = running
    proxy.fail("PUT", "*/outage/*", 503, "SlowDown")
    job = KilnClient(connection=redis_conn).submit(REQUEST)
    wait_until(lambda: job.status() == "scheduled", 60, "the job to be put back for later")
    assert server.keys_under(f"outage/{job.id}/") == []
    proxy.rules.clear()  # the store is back
    result = job.wait(timeout=60)
    assert len(result.images) == 1
    assert redis_conn.hget(f"rq:job:{job.id}", "status") == b"finished"

    # The done record is written just after the end round trip that wakes the client.
    def mine() -> list[Any]:
        return [r for r in records(settings.timings_log) if r.job_id == job.id]

    wait_until(lambda: len(mine()) == 2, 30, "the job's done record")
    assert [r.status for r in mine()] == ["failed", "done"]
    assert "StoreUnavailable" in (mine()[0].error or "")


def test_a_store_that_stays_down_fails_the_job_naming_the_cause(
    redis_conn: Redis, store: tuple[MotoServer, FlakyS3], running: Any
) -> None:
    server, proxy = store
    proxy.fail("PUT", "*/outage/*", 503, "SlowDown")
    job = KilnClient(connection=redis_conn).submit(REQUEST)
    with pytest.raises(RenderFailed, match=r"stayed unavailable through 2 retries: .*SlowDown"):
        job.wait(timeout=90)
    assert job.status() == "failed"
    assert server.keys_under(f"outage/{job.id}/") == []
