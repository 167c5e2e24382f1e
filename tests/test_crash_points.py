"""Exactly once at every crash point (#28): for each KILN_FAULTS `crash@POINT`, a job is taken by
a worker that ends itself there (os._exit: no clean-up, as a SIGKILL or a power cut), while a
second worker runs. Each job ends once: one finished result in Redis, one done event, one set
of files in the store with nothing partial left, one timing record of its render, and its
webhook's one webhook-id delivered (at least once, never zero times).

One crashing worker per point, each serving its own copy of tiny-sd15 (tiny-crash-<point>), so
each job is taken by the worker that crashes on it; the second worker serves all of them and is
started once every job is taken. Leases of 4 s (KILN_LEASE_S, tests/workers.py short_lease)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq.results import Result
from rq.serializers import JSONSerializer

from api_client import KilnClient, keys, verify_webhook
from tests.support.receivers import SECRET, HookServer, targets
from tests.workers import MANIFESTS, WorkerProcess, short_lease, wait_until
from worker.crashes import CRASH_POINTS, CRASH_STATUS
from worker.queue.upkeep.webhooks import delivery_id

LEASE_S = 4
SHORT_LEASE = short_lease(LEASE_S)


def crash_manifests(directory: Path) -> Path:
    """The shipped manifests plus tiny-crash-<point>: tiny-sd15 under another id, per point."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in MANIFESTS.glob("*.yaml"):
        shutil.copy(path, directory / path.name)
    text = (MANIFESTS / "tiny-sd15.yaml").read_text()
    assert "id: tiny-sd15" in text, "tiny-sd15.yaml changed shape"
    for point in CRASH_POINTS:
        model = f"tiny-crash-{point}"
        (directory / f"{model}.yaml").write_text(text.replace("id: tiny-sd15", f"id: {model}"))
    return directory


def done_records(timings: Path, job_id: str) -> list[dict[str, Any]]:
    lines = timings.read_text().splitlines() if timings.exists() else []
    records = [json.loads(line) for line in lines]
    return [r for r in records if r["job_id"] == job_id and r["status"] == "done"]


@pytest.mark.slow
def test_every_crash_point_ends_its_job_exactly_once(
    redis_conn: Redis, kiln_env: dict[str, str], tmp_path: Path
) -> None:
    manifests = crash_manifests(tmp_path / "manifests")
    hooks = HookServer()
    hooks.start()
    out = Path(kiln_env["KILN_OUTPUT_DIR"])
    timings = tmp_path / "timings.jsonl"
    env = {
        **kiln_env,
        "KILN_MANIFESTS": str(manifests),
        "KILN_TIMINGS_LOG": str(timings),
        "KILN_WEBHOOKS": targets(hooks.url),
    }
    crashing = {
        point: WorkerProcess(
            {**env, "KILN_FAULTS": f"crash@{point}"},
            tmp_path / f"crash-{point}.log",
            "--models",
            f"tiny-crash-{point}",
            options=SHORT_LEASE,
        )
        for point in CRASH_POINTS
    }
    second: WorkerProcess | None = None
    try:
        for worker in crashing.values():
            worker.wait_ready(redis_conn)
        client = KilnClient(connection=redis_conn, manifests_dir=manifests)
        jobs = {
            point: client.submit(
                {"model": f"tiny-crash-{point}", "prompt": point, "steps": 2, "webhook": "studio"}
            )
            for point in CRASH_POINTS
        }
        for point, job in jobs.items():  # each taken by the worker that crashes on it
            wait_until(
                lambda job=job: redis_conn.hget(f"rq:job:{job.id}", "status") != b"queued",
                60,
                f"job {job.id} (crash@{point}) to be claimed",
            )
        every_model = ",".join(f"tiny-crash-{point}" for point in CRASH_POINTS)
        second = WorkerProcess(
            env, tmp_path / "second.log", "--models", every_model, options=SHORT_LEASE
        )
        for point, worker in crashing.items():
            status = worker.wait(timeout=120)
            assert status == CRASH_STATUS, (point, status, worker.output())
            assert f"crash@{point}" in worker.output()
        for point, job in jobs.items():
            result = job.wait(timeout=120)
            assert result.model == f"tiny-crash-{point}"
        # The last deliveries may come from the second worker's sender once the dead one's
        # claim on them lapses.
        wanted = {point: delivery_id_of(redis_conn, job.id) for point, job in jobs.items()}
        wait_until(
            lambda: set(wanted.values()) <= {r.headers["webhook-id"] for r in hooks.delivered()},
            60,
            "every job's webhook to be delivered",
        )
        for point, job in jobs.items():
            where = f"crash@{point}, job {job.id}"
            assert redis_conn.hget(f"rq:job:{job.id}", "status") == b"finished", where
            results = [
                r
                for r in Result.all(_rq_job(redis_conn, job.id), serializer=JSONSerializer)
                if r.type == Result.Type.SUCCESSFUL
            ]
            assert len(results) == 1, (where, results)
            ends = [e for e in _events(redis_conn, job.id) if e["kind"] in ("done", "failed")]
            assert [e["kind"] for e in ends] == ["done"], (where, ends)
            files = sorted(p.name for p in (out / job.id).iterdir())
            assert files == ["0.png", "result.json"], (where, files)
            records = done_records(timings, job.id)
            assert len(records) == 1, (where, records)
            ids = {
                r.headers["webhook-id"]
                for r in hooks.delivered()
                if verify_webhook(SECRET, r.body, r.headers).job_id == job.id
            }
            assert ids == {wanted[point]}, (where, ids)
    finally:
        for worker in [*crashing.values(), *([second] if second else [])]:
            worker.stop()
        hooks.stop()


def _rq_job(conn: Redis, job_id: str) -> Any:
    from rq.job import Job

    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)


def _events(conn: Redis, job_id: str) -> list[dict[str, Any]]:
    return [json.loads(fields[b"event"]) for _, fields in conn.xrange(keys.events_key(job_id))]


def delivery_id_of(conn: Redis, job_id: str) -> str:
    """The webhook-id of the job's done event (delivery_id is stable per job and outcome)."""
    from api_client.schema import JobEvent

    done = [e for e in _events(conn, job_id) if e["kind"] == "done"]
    assert done, f"job {job_id} has no done event"
    return delivery_id(JobEvent.model_validate(done[0]))
