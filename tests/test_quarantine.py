"""The quarantine itself, on real Redis without a worker: records kiln and rq write are readable
(a false alarm would throw good jobs away), and what the quarantine keeps stays bounded."""

from __future__ import annotations

import json
from typing import Any

import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import now

from api_client import keys
from tests.support.inprocess import client_for
from worker.queue.upkeep import quarantine

REQUEST: dict[str, Any] = {"model": "tiny-sd15", "prompt": "ok", "steps": 2, "seed": 1}


def raw(conn: Redis, job_id: str) -> dict[bytes, bytes]:
    return conn.hgetall(f"rq:job:{job_id}")  # type: ignore[return-value]


def test_records_kiln_and_rq_write_are_readable(redis_conn: Redis, settings: Any) -> None:
    job = client_for(redis_conn, settings).submit(REQUEST)
    assert quarantine.unreadable(raw(redis_conn, job.id)) == []
    # As a worker leaves it: started, heartbeating, progress in meta, then failed with a result.
    fetched = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    fetched.started_at = fetched.last_heartbeat = fetched.ended_at = now()
    fetched.meta["progress"] = {"phase": "denoise", "step": 1, "steps": 2, "preview": None}
    fetched.worker_name = "w"
    fetched.save()
    fetched.set_status("failed")
    assert quarantine.unreadable(raw(redis_conn, job.id)) == []


def test_every_reason_names_its_field(redis_conn: Redis, settings: Any) -> None:
    job = client_for(redis_conn, settings).submit(REQUEST)
    garbage = {
        "status": b"x",
        "enqueued_at": b"x",
        "ttl": b"x",
        "enqueue_at_front": b"x",
        "origin": b"\xff",
        "repeat_intervals": b"[-1]",
        "data": b'["only", "three", "items"]',
    }
    redis_conn.hset(f"rq:job:{job.id}", mapping={**garbage, "meta": b"[]"})  # type: ignore[arg-type]
    reasons = quarantine.unreadable(raw(redis_conn, job.id))
    named = {reason.split("=")[0].split(":")[0] for reason in reasons}
    assert named == set(garbage), reasons
    # A meta kiln cannot read is dropped by RenderJob (rq's tools rewrite it), never a reason.
    assert quarantine.unreadable_meta(raw(redis_conn, job.id)) == (
        "meta: must be a JSON object, got list"
    )


def test_the_quarantine_is_bounded(redis_conn: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quarantine, "QUARANTINE_MAX", 5)
    ids = []
    for i in range(8):
        job_id = f"bad-{i}"
        # A hostile record as big as it gets: 500 fields, one of them 1 MB.
        fields = {f"f{n}": "x" for n in range(500)} | {"data": "d" * (1024 * 1024)}
        redis_conn.hset(f"rq:job:{job_id}", mapping=fields)
        quarantine.move_aside(redis_conn, job_id, ["data: not JSON"])
        ids.append(job_id)
    kept = quarantine.entries(redis_conn)
    assert [e.job_id for e in kept] == ids[-5:]  # oldest dropped first
    assert redis_conn.hlen(keys.QUARANTINE_KEY) == 5
    stored = redis_conn.hget(keys.QUARANTINE_KEY, ids[-1]) or b""
    assert len(stored) < 16 * 1024, len(stored)
    assert len(json.loads(stored)["fields"]) == quarantine.MAX_FIELDS
    assert not redis_conn.exists(f"rq:job:{ids[-1]}")
    assert quarantine.clear(redis_conn, ids[-1]) == 1
    assert quarantine.clear(redis_conn) == 4 and quarantine.entries(redis_conn) == []


def test_a_job_whose_workers_kept_dying_is_noted_as_a_killer(
    redis_conn: Redis, settings: Any
) -> None:
    """After its last abandoned retry, rq fails the job; the quarantine says why."""
    from tests.support.inprocess import make_renderer, make_worker

    job = client_for(redis_conn, settings).submit(REQUEST)
    queue = keys.queue_name("tiny-sd15")
    # As after its third re-run: taken, no retries left, and its worker gone quiet.
    redis_conn.lrem(f"rq:queue:{queue}", 0, job.id)
    fields = {"status": "started", "retries_left": 0, "number_of_retries": 3, "worker_name": "w3"}
    redis_conn.hset(f"rq:job:{job.id}", mapping=fields)  # type: ignore[arg-type]
    redis_conn.zadd(f"rq:wip:{queue}", {f"{job.id}:dead-execution": 1})
    make_worker(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"]).sweeper.sweep()
    assert job.status() == "failed"
    (entry,) = quarantine.entries(redis_conn)
    assert entry.job_id == job.id and entry.queue == queue
    assert entry.reason == "abandoned 4 time(s): its worker died running it (last: w3)"


def test_a_quarantined_job_says_so_in_its_status(redis_conn: Redis, settings: Any) -> None:
    """job.status() is `quarantined` for a record moved aside (GET /v1/jobs/{id}'s status is
    job.status()); its result and wait() still raise RenderFailed with the reason."""
    from api_client import RenderFailed

    client = client_for(redis_conn, settings)
    job = client.submit(REQUEST)
    assert not job.ended()
    quarantine.move_aside(redis_conn, job.id, ["status: garbage"])
    assert job.status() == "quarantined"
    assert job.ended()
    with pytest.raises(RenderFailed, match="quarantined: status: garbage") as caught:
        job.result()
    assert caught.value.status == "quarantined"
