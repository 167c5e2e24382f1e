"""Keys a client overwrote with another type (anyone with the kiln-client ACL can SET a queue or
a job's event stream to a string): a real worker moves each aside into the quarantine, with a
reason, and goes on; it neither crashes nor fails to start."""

from __future__ import annotations

import json
from pathlib import Path

from redis import Redis

from api_client import KilnClient, keys
from tests.conftest import kiln
from tests.fixtures.gate import Gate
from tests.workers import WorkerProcess, gated, wait_until
from worker.queue.upkeep.quarantine import KEY_ASIDE_PREFIX

MODEL = "tiny-sd15"
QUEUE_KEY = f"rq:queue:{keys.queue_name(MODEL)}"


def quarantined_keys(env: dict[str, str]) -> dict[str, str]:
    done = kiln("quarantine", "--json", env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in done.stdout.splitlines()]
    return {e["job_id"]: e["reason"] for e in entries if e["job_id"].startswith("key:")}


def test_retyped_keys_are_moved_aside_and_the_worker_goes_on(
    redis_conn: Redis, kiln_env: dict[str, str], settings: object, tmp_path: Path
) -> None:
    # Before it starts: its queue, the published manifests and the timing fits are strings.
    for key in (QUEUE_KEY, keys.MANIFESTS_KEY, keys.FITS_KEY):
        redis_conn.set(key, "not what kiln keeps here")
    gate = Gate(tmp_path / "gate")  # a job of more than 2 steps waits there, running
    worker = WorkerProcess(kiln_env, tmp_path / "w.log", "--models", MODEL, options=gated(gate))
    try:
        worker.wait_ready(redis_conn)
        moved = quarantined_keys(kiln_env)
        for key in (QUEUE_KEY, keys.MANIFESTS_KEY, keys.FITS_KEY):
            assert "held a string; kiln keeps a" in moved[f"key:{key}"], moved
            assert redis_conn.get(f"{KEY_ASIDE_PREFIX}{key}") == b"not what kiln keeps here"
            assert 0 < redis_conn.ttl(f"{KEY_ASIDE_PREFIX}{key}") <= 7 * 24 * 3600
        client = KilnClient(connection=redis_conn)
        assert client.submit({"model": MODEL, "prompt": "a", "steps": 2}).wait(timeout=120)

        # While it waits for work: its queue becomes a string again.
        redis_conn.delete(f"{KEY_ASIDE_PREFIX}{QUEUE_KEY}")
        redis_conn.set(QUEUE_KEY, "again")
        wait_until(
            lambda: redis_conn.exists(f"{KEY_ASIDE_PREFIX}{QUEUE_KEY}"), 60, "the queue moved aside"
        )
        assert worker.proc.poll() is None, worker.output()

        # While a job runs: its event stream becomes a string. The job still finishes.
        job = client.submit({"model": MODEL, "prompt": "b", "steps": 12, "seed": 2})
        wait_until(lambda: gate.held() == [job.id], 60, "the job to start")
        redis_conn.delete(keys.events_key(job.id))
        redis_conn.set(keys.events_key(job.id), "not a stream")
        gate.open()
        wait_until(lambda: job.status() == "finished", 120, "the job to finish")
        entry = f"key:{keys.events_key(job.id)}"
        wait_until(
            lambda: redis_conn.hexists(keys.QUARANTINE_KEY, entry), 30, "the stream moved aside"
        )
        assert worker.proc.poll() is None, worker.output()
        assert "kiln keeps a stream there" in quarantined_keys(kiln_env)[entry]
        assert client.submit({"model": MODEL, "prompt": "c", "steps": 2}).wait(timeout=120)
    finally:
        worker.stop()
