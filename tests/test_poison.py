"""Poison jobs (#18 item 4): a job whose worker died twice while running it is failed and
quarantined with its cause, instead of being run until it kills a third. Real `kiln worker`
processes, SIGKILLed mid-denoise."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from redis import Redis

from api_client import KilnClient, RenderFailed
from tests.conftest import kiln
from tests.fixtures.gate import Gate
from tests.workers import SLOW_MODEL, WorkerProcess, gated, slow_manifests, wait_until
from worker.queue.job import poison_reason
from worker.queue.upkeep import quarantine

# A 5 s lease (heartbeat and sweep every 1.25 s): each death is found in seconds.
LEASE_S = 5


def test_the_cause_names_each_death() -> None:
    same = [{"worker": "A", "phase": "denoise"}, {"worker": "B", "phase": "denoise"}]
    assert poison_reason(same) == "killed in denoise on workers A and B"
    apart = [{"worker": "A", "phase": "load"}, {"worker": "B", "phase": "decode"}]
    assert poison_reason(apart) == "killed in load on A, then in decode on B"


@pytest.mark.slow
def test_a_job_that_killed_two_workers_is_quarantined_not_run_a_third_time(
    redis_conn: Redis, kiln_env: dict[str, str], tmp_path: Path
) -> None:
    manifests = slow_manifests(tmp_path / "manifests")
    env = {**kiln_env, "KILN_MANIFESTS": str(manifests)}
    client = KilnClient(connection=redis_conn, manifests_dir=manifests)
    # Every run of the job waits at this gate, mid-denoise, until its worker is killed there.
    gate = Gate(tmp_path / "gate")
    options = gated(gate, lease_s=LEASE_S)
    workers = {
        w.name: w
        for w in (
            WorkerProcess(env, tmp_path / f"w{i}.log", "--models", SLOW_MODEL, options=options)
            for i in range(3)
        )
    }
    try:
        for worker in workers.values():
            worker.wait_ready(redis_conn)
        job = client.submit({"model": SLOW_MODEL, "prompt": "poison", "steps": 50, "seed": 1})
        killed: list[str] = []
        for _ in range(2):

            def denoising_elsewhere() -> str | None:
                holder = redis_conn.hget(f"rq:job:{job.id}", "worker_name")
                progress = job.progress()
                name = holder.decode() if holder else None
                if name in killed or progress is None or progress.phase != "denoise":
                    return None
                return name if gate.held().count(job.id) == len(killed) + 1 else None

            holder = wait_until(denoising_elsewhere, 120, "a live worker holding the job")
            workers[holder].signal(signal.SIGKILL)
            workers[holder].wait(timeout=30)
            killed.append(holder)
        # The third worker's sweep finds the second lapsed lease and fails the job.
        wait_until(lambda: job.status() == "failed", 60, "the job to be failed")
        cause = f"killed in denoise on workers {killed[0]} and {killed[1]}"
        try:
            job.wait(timeout=5)
            raise AssertionError("a poison job returned a result")
        except RenderFailed as failed:
            assert cause in str(failed)
        [entry] = quarantine.entries(redis_conn)
        assert (entry.job_id, entry.reason) == (job.id, cause)
        listed = kiln("quarantine", "--json", env=env)
        assert listed.returncode == 0 and json.loads(listed.stdout)["reason"] == cause
        survivor = next(w for n, w in workers.items() if n not in killed)
        assert survivor.proc.poll() is None  # alive, and it never ran the job
        assert redis_conn.hget(f"rq:job:{job.id}", "worker_name").decode() == killed[1]  # type: ignore[union-attr]
    finally:
        for worker in workers.values():
            worker.stop()
