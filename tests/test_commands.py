"""What reaches a worker over RQ's pub/sub channel, which any client with the documented ACL may
publish to: only a stop-job for the running job is taken, at the next step or phase boundary;
RQ's shutdown and kill-horse and anything malformed are ignored, and the listener lives on."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq.command import send_kill_horse_command, send_shutdown_command

from api_client import KilnClient, RenderFailed
from tests.fixtures.cancels_in_phase import cancel_in
from tests.fixtures.gate import Gate
from tests.support.inprocess import make_renderer, make_worker
from tests.support.records import records
from tests.workers import WorkerProcess, gated, slow_manifests, wait_until


def test_no_client_command_stops_a_worker(
    redis_conn: Redis, kiln_env: dict[str, str], tmp_path: Path
) -> None:
    manifests = slow_manifests(tmp_path / "manifests")
    env = {**kiln_env, "KILN_MANIFESTS": str(manifests)}
    client = KilnClient(connection=redis_conn, manifests_dir=manifests)
    gate = Gate(tmp_path / "gate")  # the job waits there, running, while the messages land
    worker = WorkerProcess(env, tmp_path / "w.log", "--models", "tiny-sd15", options=gated(gate))
    try:
        worker.wait_ready(redis_conn)
        running = client.submit({"model": "tiny-sd15", "prompt": "x", "steps": 40, "seed": 1})
        wait_until(lambda: gate.held() == [running.id], 60, "the job to start")
        channel = f"rq:pubsub:{worker.name}"
        send_shutdown_command(redis_conn, worker.name)
        send_kill_horse_command(redis_conn, worker.name)
        redis_conn.publish(channel, b"\xff\x00 not json")
        redis_conn.publish(channel, json.dumps(["not", "an", "object"]))
        redis_conn.publish(channel, json.dumps({"command": "stop-job", "job_id": "someone-else"}))
        wait_until(lambda: worker.output().count("ignored") >= 5, 30, "the five messages logged")
        assert worker.proc.poll() is None, worker.output()
        assert running.status() == "started"
        # The listener lives on: a real cancel still stops the running job within a second, at
        # its next step once the gate lets it take one (left alone, it would run to its end).
        cancelled_at = time.monotonic()
        running.cancel()
        taken = f"stop-job command for job {running.id}"
        wait_until(lambda: taken in worker.output(), 5, "the worker to take the stop-job")
        gate.open()
        wait_until(lambda: running.status() == "stopped", 30, "the cancel to stop the job")
        assert time.monotonic() - cancelled_at < 5
        assert worker.proc.poll() is None
    finally:
        worker.stop()


@pytest.mark.parametrize(
    ("phase", "where"),
    [("load", "after loading"), ("decode", "after decode"), ("save", "after saving its images")],
)
def test_a_cancel_during_a_phase_is_taken_at_the_next_boundary(
    redis_conn: Redis, settings: Any, monkeypatch: pytest.MonkeyPatch, phase: str, where: str
) -> None:
    client = KilnClient(connection=redis_conn, manifests_dir=settings.manifests)
    job = client.submit({"model": "tiny-sd15", "prompt": "x", "steps": 2, "seed": 3})
    worker = make_worker(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    cancel_in(monkeypatch, worker, phase)
    worker.work(burst=True)
    assert job.status() == "stopped"
    with pytest.raises(RenderFailed, match=f"stopped on request {where}"):
        job.wait(timeout=5)
    (record,) = [r for r in records(settings.timings_log) if r.job_id == job.id]
    assert record.status == "stopped" and where in (record.error or "")
    # A stopped job leaves no files behind, whatever phase it stopped after.
    job_dir = settings.output_dir / job.id
    assert not job_dir.exists() or not [p for p in job_dir.iterdir() if p.is_file()]


def test_a_worker_stops_listening_at_once_when_the_unsubscribe_answer_comes_first(
    redis_conn: Redis, settings: Any
) -> None:
    """rq unsubscribes, then stops the listener thread, which redis-py 8 joins. Here the thread
    has read the unsubscribe's answer and gone back to reading before the stop, the race that
    held burst workers in CI for rq's 60 s read: the stop now waits one short read at most."""
    worker = make_worker(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    worker.subscribe()
    worker.pubsub.unsubscribe()
    wait_until(lambda: not worker.pubsub.subscribed, 5, "the thread to read the answer")
    started = time.monotonic()
    worker.unsubscribe()
    assert time.monotonic() - started < 5
    assert not worker.pubsub_thread.is_alive()
