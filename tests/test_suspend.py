"""A drain that holds (#28 item 6): `rq suspend`, RQ's own command, stops a live, idle kiln worker
from taking a job at once (the claim script reads the key), the worker says `suspended` in its
state and in `kiln top`, and `rq resume` lets it take the job within seconds. A job running when
the suspend arrives finishes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis import Redis

from api_client import KilnClient, keys
from api_client.schema import WorkerState
from tests.conftest import MANIFESTS, kiln
from tests.fixtures.gate import Gate
from tests.support.records import enqueue_raw
from tests.workers import WorkerProcess, gated, wait_until
from worker.queue.claim import Claimer

RQ = str(Path(sys.executable).parent / "rq")
REQUEST = {"model": "tiny-sd15", "prompt": "drain", "steps": 4}


def rq(command: str, url: str) -> None:
    subprocess.run([RQ, command, "--url", url], check=True, capture_output=True, timeout=60)


def state_of(conn: Redis, worker: WorkerProcess) -> str:
    raw = conn.get(keys.worker_key(worker.name))
    return WorkerState.model_validate_json(raw).state if raw else ""


def test_every_claim_reads_the_suspension_key(redis_conn: Redis) -> None:
    """`rq suspend` holds from the moment it returns: the claim script reads the key on every
    claim. (It read it at most once a second, so a job submitted right after a suspend could
    start; a claimer that found it suspended still took a job woken by its event within that
    second: it failed CI, `finished` where `queued` was asserted.)"""
    from rq import Queue
    from rq.serializers import JSONSerializer

    queues = [
        Queue(name, connection=redis_conn, serializer=JSONSerializer)
        for name in keys.lane_queues("tiny-sd15")
    ]
    claimer = Claimer(redis_conn, "w1", lease_ttl_s=60)
    assert claimer.claim(queues, "e0", time.monotonic()) is None  # nothing queued, not suspended
    assert not claimer.suspended
    redis_conn.set("rq:suspended", 1)
    assert claimer.claim(queues, "e1", time.monotonic()) is None
    assert claimer.suspended
    job_id = enqueue_raw(redis_conn, "tiny-sd15", {"request": REQUEST})
    for n in range(3):  # at once, as a worker woken by the job's event claims
        assert claimer.claim(queues, f"e{n + 2}", time.monotonic()) is None
    assert redis_conn.hget(f"rq:job:{job_id}", "status") == b"queued"
    redis_conn.delete("rq:suspended")
    claimed = claimer.claim(queues, "e9", time.monotonic())
    assert claimed is not None and claimed.job_id == job_id
    assert not claimer.suspended


@pytest.mark.slow  # a live worker process held and let go (~20 s): make test-slow, which CI runs
def test_rq_suspend_holds_a_live_worker_and_rq_resume_lets_it_go_on(
    redis_conn: Redis, kiln_env: dict[str, str], tmp_path: Path
) -> None:
    url = kiln_env["KILN_REDIS_URL"]
    gate = Gate(tmp_path / "gate")  # the first job waits mid-denoise while the suspend arrives
    worker = WorkerProcess(
        kiln_env, tmp_path / "worker.log", "--models", "tiny-sd15", options=gated(gate)
    )
    client = KilnClient(connection=redis_conn, manifests_dir=MANIFESTS)
    try:
        worker.wait_ready(redis_conn)
        running = client.submit(REQUEST)
        wait_until(lambda: (gate.directory / "held").exists(), 90, "the first job at its gate")
        rq("suspend", url)
        gate.open()
        assert running.wait(timeout=60).steps == 4  # the job it held finishes
        queued = client.submit({**REQUEST, "seed": 7})
        wait_until(lambda: state_of(redis_conn, worker) == "suspended", 15, "state: suspended")
        top = kiln("top", "--once", env=kiln_env)
        assert "suspended" in top.stdout, top.stdout
        # Idle and woken by the new job's event, it claims nothing while suspended.
        time.sleep(2)  # not a gate: a window in which a worker that ignored the key would start
        assert redis_conn.hget(f"rq:job:{queued.id}", "status") == b"queued"
        rq("resume", url)
        resumed_at = time.monotonic()
        wait_until(
            lambda: redis_conn.hget(f"rq:job:{queued.id}", "status") != b"queued",
            5,
            "the job to be claimed after rq resume",
        )
        assert time.monotonic() - resumed_at < 3
        assert queued.wait(timeout=60).steps == 4
        wait_until(lambda: state_of(redis_conn, worker) != "suspended", 15, "state: resumed")
    finally:
        worker.stop()
