"""A lost device is fatal to the worker, not just to the job: drilled with KILN_FAULTS=lost@...,
the job in hand fails naming the reason, the worker exits 1 for its supervisor to restart it,
and the jobs behind it stay queued for the next worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis import Redis

from api_client import KilnClient, RenderFailed
from tests.support.records import records
from tests.workers import WorkerProcess


@pytest.mark.slow  # a worker process drill (31 s): make test keeps under 12 minutes; CI runs it
def test_a_lost_device_fails_the_job_and_ends_the_worker(
    redis_conn: Redis, kiln_env: dict[str, str], tmp_path: Path
) -> None:
    client = KilnClient(connection=redis_conn, manifests_dir=kiln_env["KILN_MANIFESTS"])
    doomed = client.submit({"model": "tiny-sd15", "prompt": "lost", "steps": 2})
    waiting = client.submit({"model": "tiny-sd15", "prompt": "next", "steps": 2})
    env = {**kiln_env, "KILN_FAULTS": "lost@denoise:*"}
    lost = WorkerProcess(env, tmp_path / "lost.log", "--models", "tiny-sd15")
    try:
        assert lost.wait(timeout=120) == 1, lost.output()
    finally:
        lost.stop()
    with pytest.raises(RenderFailed, match=r"device was lost during job .*illegal memory access"):
        doomed.wait(timeout=1)
    assert "worker_fatal" in lost.output()
    assert waiting.status() == "queued"  # not taken, not lost: a fresh worker will run it
    [record] = records(Path(kiln_env["KILN_TIMINGS_LOG"]))
    assert record.job_id == doomed.id and "FatalWorkerError" in (record.error or "")

    fresh = WorkerProcess(kiln_env, tmp_path / "fresh.log", "--models", "tiny-sd15", "--burst")
    try:
        assert fresh.wait(timeout=120) == 0, fresh.output()
    finally:
        fresh.stop()
    assert waiting.wait(timeout=1).model == "tiny-sd15"
