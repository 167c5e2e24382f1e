"""A job's lease (its entry in the started registry, pushed every beat), with real `kiln worker`
processes on real Redis: a worker stalled past its lease stops that render and writes nothing
over the worker that took the job over; a Redis outage longer than a lease re-queues nothing.
The workers hold LEASE_S leases, half of KilnWorker's 10 s, so the drills' stall and outage are
halved too (KILN_HEARTBEAT_S, KILN_SWEEP_S); each job waits at a gate, mid-denoise, until the
drill is over."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from api_client import KilnClient, KilnJob
from tests.fixtures.gate import Gate
from tests.support.records import records
from tests.workers import (
    RedisServer,
    WorkerProcess,
    gated,
    slow_manifests,
    wait_until,
)

LEASE_S = 5


@pytest.fixture
def slow_dir(tmp_path: Path) -> Path:
    return slow_manifests(tmp_path / "manifests")


def worker_of(conn: Redis, job: KilnJob) -> str:
    name = conn.hget(f"rq:job:{job.id}", "worker_name")
    return name.decode() if isinstance(name, bytes) else ""


def step_of(job: KilnJob) -> int:
    progress = job.progress()
    return progress.step if progress is not None and progress.phase == "denoise" else 0


@pytest.mark.slow
def test_a_worker_stalled_past_its_lease_stops_and_writes_nothing(
    redis_conn: Redis, kiln_env: dict[str, str], slow_dir: Path, settings: Any, tmp_path: Path
) -> None:
    """The issue's drill at half its times: SIGSTOP the rendering worker for twice its lease
    while a second worker runs. The job is rendered to completion once, by the second worker;
    when the first wakes it stops that render, writes nothing, and says why in its record."""
    env = {**kiln_env, "KILN_MANIFESTS": str(slow_dir)}
    client = KilnClient(connection=redis_conn, manifests_dir=slow_dir)
    gate = Gate(tmp_path / "gate")  # both workers': the job waits at it on either
    workers = [
        WorkerProcess(
            env, tmp_path / f"w{i}.log", "--models", "tiny-sd15", options=gated(gate, LEASE_S)
        )
        for i in range(2)
    ]
    try:
        for proc in workers:
            proc.wait_ready(redis_conn)
        job = client.submit({"model": "tiny-sd15", "prompt": "stall", "steps": 30, "seed": 11})
        wait_until(lambda: gate.held() == [job.id] and step_of(job) >= 2, 90, "the job at its gate")
        first = next(p for p in workers if p.name == worker_of(redis_conn, job))
        second = next(p for p in workers if p is not first)
        first.signal(signal.SIGSTOP)
        try:
            wait_until(lambda: worker_of(redis_conn, job) == second.name, 40, "a takeover")
            time.sleep(LEASE_S)  # the drill's stall: twice the lease in all (not a sync)
            # The second worker holds it mid-denoise too (a longer stall, if it is slow to).
            wait_until(lambda: gate.held() == [job.id, job.id], 60, "the second at the gate")
        finally:
            first.signal(signal.SIGCONT)
        gate.open()  # both renders go on: the second's to its end, the first's to its stop
        done = job.wait(timeout=120)
        assert done.worker == second.name
        # The woken worker notices at its next beat or step; its record says so.
        wait_until(
            lambda: len([r for r in records(settings.timings_log) if r.job_id == job.id]) == 2,
            30,
            "the stalled worker's record",
        )
        by_worker = {r.worker: r for r in records(settings.timings_log) if r.job_id == job.id}
        assert set(by_worker) == {first.name, second.name}
        assert by_worker[second.name].status == "done"
        assert by_worker[first.name].status == "stopped"
        assert "lease lost" in (by_worker[first.name].error or "")
        # Nothing of the first worker's is written over the second's: Redis and result.json
        # name the second worker, and read again after the first woke they do not change.
        again = KilnJob(job.id, redis_conn).result()
        assert again is not None and (again.worker, again.finished_at) == (
            done.worker,
            done.finished_at,
        )
        stored = json.loads((settings.output_dir / job.id / "result.json").read_text())
        assert stored["worker"] == second.name
        assert KilnJob(job.id, redis_conn).status() == "finished"
        assert "lease lost" in first.output()
        # The stalled worker lives on and takes the next job.
        later = client.submit({"model": "tiny-sd15", "prompt": "after", "steps": 2, "seed": 1})
        assert later.wait(timeout=120).worker in {first.name, second.name}
        assert first.proc.poll() is None
    finally:
        for proc in workers:
            if proc.proc.poll() is None:
                proc.signal(signal.SIGCONT)
            proc.stop()


@pytest.mark.slow
def test_a_redis_outage_longer_than_a_lease_requeues_no_running_job(
    kiln_env: dict[str, str], slow_dir: Path, settings: Any, tmp_path: Path
) -> None:
    """Redis away for 1.5 leases while two workers each render a job: when it comes back no
    job is re-queued; each finishes once, on the worker that had it."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always")
    server.start()
    url = f"redis://127.0.0.1:{server.port}/0"
    conn = Redis.from_url(url)
    env = {**kiln_env, "KILN_MANIFESTS": str(slow_dir), "KILN_REDIS_URL": url}
    gate = Gate(tmp_path / "gate")  # each job waits at it, mid-denoise, through the outage
    workers = [
        WorkerProcess(
            env, tmp_path / f"w{i}.log", "--models", "tiny-sd15", options=gated(gate, LEASE_S)
        )
        for i in range(2)
    ]
    try:
        for proc in workers:
            proc.wait_ready(conn)
        client = KilnClient(connection=conn, manifests_dir=slow_dir)
        jobs = [
            client.submit({"model": "tiny-sd15", "prompt": f"p{i}", "steps": 40, "seed": i})
            for i in range(2)
        ]
        wait_until(
            lambda: (
                sorted(gate.held()) == sorted(j.id for j in jobs)
                and all(step_of(j) >= 2 for j in jobs)
            ),
            90,
            "both jobs at the gate",
        )
        owners = {j.id: worker_of(conn, j) for j in jobs}
        assert set(owners.values()) == {p.name for p in workers}
        server.kill()
        time.sleep(LEASE_S * 1.5)  # the outage under test
        server.start()
        gate.open()
        conn = Redis.from_url(url)
        for job in jobs:
            result = KilnJob(job.id, conn).wait(timeout=180)
            assert result.worker == owners[job.id]
            fields = conn.hmget(f"rq:job:{job.id}", ["number_of_retries", "retries_left"])
            assert fields[0] in (None, b"0"), "the job was re-queued as abandoned"
        # Each record is published after its end is committed (the client can be ahead of it).
        wait_until(
            lambda: (
                len([r for r in records(settings.timings_log) if r.job_id in owners]) >= len(owners)
            ),
            30,
            "every job's timing record",
        )
        done = [r for r in records(settings.timings_log) if r.job_id in owners]
        assert sorted((r.job_id, r.status, r.worker) for r in done) == sorted(
            (job_id, "done", worker) for job_id, worker in owners.items()
        )
    finally:
        for proc in workers:
            proc.stop()
        server.kill()
