"""Soak: 300 tiny jobs through one real `kiln worker` process, its RSS sampled as they go. Growth
over the second half (after pipelines, allocator pools and caches have settled) must stay small."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from redis import Redis

from api_client import KilnClient
from tests.workers import WorkerProcess, rss_bytes, wait_until

JOBS = 300
MB = 1024 * 1024


@pytest.mark.slow
def test_300_jobs_through_one_worker_without_leaking(
    redis_conn: Redis, settings: object, kiln_env: dict[str, str], tmp_path: Path
) -> None:
    client = KilnClient(connection=redis_conn, manifests_dir=kiln_env["KILN_MANIFESTS"])
    worker = WorkerProcess(kiln_env, tmp_path / "soak.log", "--models", "tiny-sd15")
    try:
        worker.wait_ready(redis_conn)
        started = time.monotonic()
        jobs = [
            client.submit({"model": "tiny-sd15", "prompt": f"soak {i}", "steps": 2, "seed": i})
            for i in range(JOBS)
        ]
        samples: list[tuple[int, int]] = []  # (jobs finished, rss)

        def all_done() -> bool:
            done = JOBS - redis_conn.llen("rq:queue:kiln:tiny-sd15")
            if not samples or done - samples[-1][0] >= 10:
                samples.append((done, rss_bytes(worker.proc.pid)))
            return (
                redis_conn.llen("rq:queue:kiln:tiny-sd15") == 0 and jobs[-1].status() == "finished"
            )

        wait_until(all_done, 900, f"{JOBS} jobs to finish", poll=0.2)
        elapsed = time.monotonic() - started
        samples.append((JOBS, rss_bytes(worker.proc.pid)))
        assert all(job.status() == "finished" for job in jobs)
        first = next(rss for done, rss in samples if done >= 20)
        middle = next(rss for done, rss in samples if done >= JOBS // 2)
        last = samples[-1][1]
        print(
            f"\nsoak: {JOBS} jobs in {elapsed:.0f} s ({JOBS / elapsed:.2f} jobs/s); RSS after 20 "
            f"jobs {first / MB:.0f} MB, after {JOBS // 2} {middle / MB:.0f} MB, after {JOBS} "
            f"{last / MB:.0f} MB; growth over the second half {(last - middle) / MB:+.1f} MB"
        )
        assert last - middle < 40 * MB, samples
        assert last <= 1.05 * first, samples  # issue 10: within 5 % of the RSS after 20 jobs
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
    finally:
        worker.stop()
