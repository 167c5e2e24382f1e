"""Worker deaths and shutdowns, with real `kiln worker` processes on real Redis: SIGKILL mid-job
(recovered promptly by another worker, image written once), warm SIGTERM, and a second SIGTERM."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq.registry import StartedJobRegistry

from api_client import KilnClient, KilnJob, keys
from tests.fixtures.gate import Gate
from tests.support.jobs import denoising
from tests.support.records import records
from tests.workers import (
    DIES_AFTER_SAVE,
    SLOW_MODEL,
    WorkerProcess,
    gated,
    slow_manifests,
    wait_until,
)


@pytest.fixture
def slow_dir(tmp_path: Path) -> Path:
    return slow_manifests(tmp_path / "manifests")


@pytest.fixture
def env(kiln_env: dict[str, str], slow_dir: Path) -> dict[str, str]:
    return {**kiln_env, "KILN_MANIFESTS": str(slow_dir)}


@pytest.fixture
def client(redis_conn: Redis, slow_dir: Path) -> KilnClient:
    return KilnClient(connection=redis_conn, manifests_dir=slow_dir)


def held(gate: Gate, job: KilnJob) -> bool:
    """The job waits at this worker's gate, mid-denoise, and its progress says so."""
    return job.id in gate.held() and denoising(job, gate.at)


@pytest.mark.slow
def test_sigkilled_workers_jobs_are_recovered_promptly_and_written_once(
    redis_conn: Redis, client: KilnClient, env: dict[str, str], settings: Any, tmp_path: Path
) -> None:
    # The long job waits at mid's gate (never opened) until mid is killed.
    gate = Gate(tmp_path / "mid-gate")
    mid = WorkerProcess(env, tmp_path / "mid.log", "--models", SLOW_MODEL, options=gated(gate))
    saver = WorkerProcess(
        env, tmp_path / "saver.log", "--models", "tiny-sd15", options=DIES_AFTER_SAVE
    )
    reborn: WorkerProcess | None = None
    try:
        mid.wait_ready(redis_conn)
        saver.wait_ready(redis_conn)
        # 1. One worker dies after writing the files; one is SIGKILLed in the middle of denoising.
        saved = client.submit({"model": "tiny-sd15", "prompt": "saved", "steps": 2, "seed": 5})
        long = client.submit({"model": SLOW_MODEL, "prompt": "killed", "steps": 12, "seed": 3})
        assert saver.wait(timeout=120) == -signal.SIGKILL
        image = settings.output_dir / saved.id / "0.png"
        first_write = image.stat().st_mtime_ns
        assert saved.status() == "started"  # Redis never heard back
        wait_until(lambda: held(gate, long), 120, "the long job to wait at its gate, denoising")
        # 2. The next worker comes up while the long job is still running, then its worker dies.
        reborn = WorkerProcess(env, tmp_path / "reborn.log", "--models", f"{SLOW_MODEL},tiny-sd15")
        reborn.wait_ready(redis_conn)
        progress = long.progress()
        assert progress is not None and progress.step < 12, "the long job ended before the kill"
        mid.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        mid.wait(timeout=30)

        # 3. Its heartbeat lapses within seconds and the live worker takes the job over.
        def taken_over() -> bool:
            fetched = redis_conn.hget(f"rq:job:{long.id}", "worker_name")
            return long.status() == "started" and fetched == reborn.name.encode()  # type: ignore[union-attr]

        wait_until(taken_over, 60, "the live worker to take over the killed job")
        recovered_s = time.monotonic() - killed_at
        print(f"\nSIGKILL -> job re-started by another worker: {recovered_s:.1f} s")
        assert recovered_s < 20  # lease 10 s + sweep every 5 s; RQ's default for a 600 s job: 660 s
        result = long.wait(timeout=240)
        assert result.worker == reborn.name and len(result.images) == 1
        assert Path(result.images[0].path).is_file()
        # 4. The job written before the crash is answered from disk, not rendered again.
        again = saved.wait(timeout=60)
        assert image.stat().st_mtime_ns == first_write
        assert again.images[0].sha256 == KilnJob(saved.id, redis_conn).result().images[0].sha256  # type: ignore[union-attr]
        # A record is published after its job's end is committed, so a client's wait() can
        # return before the record is in the log: wait for both jobs' records, then count.
        wait_until(
            lambda: {saved.id, long.id} <= {r.job_id for r in records(settings.timings_log)},
            30,
            "both jobs' timing records",
        )
        by_job = [r for r in records(settings.timings_log) if r.job_id == saved.id]
        # Its worker died before committing the job's end, so it published no record: the one
        # record is the answering worker's, with the render's phases and who rendered it.
        assert [(r.status, r.answered_from) for r in by_job] == [("done", "store")]
        assert (by_job[0].worker, by_job[0].rendered_by) == (reborn.name, saver.name)
        assert by_job[0].timings.denoise > 0
        long_records = [r for r in records(settings.timings_log) if r.job_id == long.id]
        assert [r.status for r in long_records] == ["done"]  # the killed run left no record
        assert (
            StartedJobRegistry(keys.queue_name(SLOW_MODEL), connection=redis_conn).get_job_ids()
            == []
        )
    finally:
        for proc in (mid, saver, reborn):
            if proc is not None:
                proc.stop()


@pytest.mark.slow  # a signal drill on a worker process (24 s): make test keeps under 12 minutes
def test_second_sigterm_requeues_and_first_sigterm_finishes_the_job(
    redis_conn: Redis, client: KilnClient, env: dict[str, str], tmp_path: Path
) -> None:
    job = client.submit({"model": SLOW_MODEL, "prompt": "interrupted", "steps": 12, "seed": 9})
    # Each worker holds the job at its gate, mid-denoise, until the signals have landed.
    hurried_gate, patient_gate = Gate(tmp_path / "hurried-gate"), Gate(tmp_path / "patient-gate")
    hurried = WorkerProcess(
        env, tmp_path / "hurried.log", "--models", SLOW_MODEL, options=gated(hurried_gate)
    )
    patient: WorkerProcess | None = None
    try:
        # 1. Two signals: the job stops at its next step and goes back to the front of its queue.
        wait_until(lambda: held(hurried_gate, job), STARTUP_S_AND_LOAD, "the job at its gate")
        hurried.signal(signal.SIGTERM)
        # Signals sent back to back can merge into one; send the second once the first landed.
        wait_until(lambda: "warm shutdown requested" in hurried.output(), 30, "the first SIGTERM")
        hurried.signal(signal.SIGTERM)
        hurried_gate.open()
        assert hurried.wait(timeout=60) == 0, hurried.output()
        assert job.status() == "queued", hurried.output()
        assert job.progress() is None, redis_conn.hget(f"rq:job:{job.id}", "meta")
        assert redis_conn.lrange(f"rq:queue:{keys.queue_name(SLOW_MODEL)}", 0, -1) == [
            job.id.encode()
        ]
        assert redis_conn.hget(f"rq:job:{job.id}", "meta") is None or b"error" not in (
            redis_conn.hget(f"rq:job:{job.id}", "meta") or b""
        )
        # 2. One signal: the next worker finishes the re-queued job, then exits 0.
        later = client.submit({"model": SLOW_MODEL, "prompt": "not taken", "steps": 2})
        patient = WorkerProcess(
            env, tmp_path / "patient.log", "--models", SLOW_MODEL, options=gated(patient_gate)
        )
        wait_until(
            lambda: held(patient_gate, job), STARTUP_S_AND_LOAD, "the re-queued job at its gate"
        )
        assert redis_conn.hget(f"rq:job:{job.id}", "worker_name") == patient.name.encode()
        patient.signal(signal.SIGTERM)
        wait_until(lambda: "warm shutdown requested" in patient.output(), 30, "the SIGTERM")
        patient_gate.open()
        assert patient.wait(timeout=120) == 0, patient.output()
        result = job.wait(timeout=1)
        assert result.steps == 12 and Path(result.images[0].path).is_file()
        assert later.status() == "queued"  # a stopping worker takes no new job
    finally:
        for proc in (hurried, patient):
            if proc is not None:
                proc.stop()


STARTUP_S_AND_LOAD = 120.0
