"""Nothing a client writes to a queue or a started registry doubles or poisons a job (#28 item 7,
the queue half): an id pushed twice, an id pushed back after its job finished, and forged lapsed
entries in a model's started registry for a running job. Through a real worker (in process):
each job renders once, with one result and one record, and no death is noted."""

from __future__ import annotations

import json
from typing import Any

from redis import Redis
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from api_client import keys
from tests.fixtures.gate import hold_here
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.queue.job import DEATHS_FIELD

MODEL = "tiny-sd15"
QUEUE = f"rq:queue:{keys.queue_name(MODEL)}"
REGISTRY = f"rq:wip:{keys.queue_name(MODEL)}"


def results(conn: Redis, job_id: str) -> list[Result]:
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    return [
        r for r in Result.all(job, serializer=JSONSerializer) if r.type == Result.Type.SUCCESSFUL
    ]


def done(settings: Any, job_id: str) -> list[Any]:
    return [r for r in records(settings.timings_log) if r.job_id == job_id and r.status == "done"]


def test_an_id_pushed_twice_or_pushed_back_after_its_end_renders_once(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    renderer = make_renderer(settings, [MODEL])
    job = client.submit({"model": MODEL, "prompt": "once", "steps": 2})
    redis_conn.rpush(QUEUE, job.id)  # a careless producer pushes it again while it is queued
    burst(redis_conn, renderer, [MODEL])
    assert job.wait(timeout=1).steps == 2
    assert len(results(redis_conn, job.id)) == 1
    assert len(done(settings, job.id)) == 1
    redis_conn.rpush(QUEUE, job.id)  # and back after its end
    burst(redis_conn, renderer, [MODEL])
    assert redis_conn.llen(QUEUE) == 0
    assert len(results(redis_conn, job.id)) == 1
    assert len(done(settings, job.id)) == 1
    stream = redis_conn.xrange(keys.events_key(job.id))
    kinds = [json.loads(fields[b"event"])["kind"] for _, fields in stream]
    assert [k for k in kinds if k in ("started", "done")] == ["started", "done"], kinds


def test_forged_lapsed_registry_entries_for_a_running_job_neither_requeue_nor_poison_it(
    redis_conn: Redis, settings: Any, monkeypatch: Any
) -> None:
    client = client_for(redis_conn, settings)
    renderer = make_renderer(settings, [MODEL])
    job = client.submit({"model": MODEL, "prompt": "forged", "steps": 4})
    forged = [f"{job.id}:forged-a", f"{job.id}:forged-b"]
    planted: list[bool] = []

    def swept(step: int) -> bool:
        """Held at step 2: plant two lapsed entries once, then wait until a sweep took them."""
        if not planted:
            redis_conn.zadd(REGISTRY, {member: 1 for member in forged})
            planted.append(True)
        return all(redis_conn.zscore(REGISTRY, member) is None for member in forged)

    hold_here(monkeypatch, swept, limit_s=60)
    burst(redis_conn, renderer, [MODEL])
    assert job.wait(timeout=1).steps == 4
    assert redis_conn.llen(QUEUE) == 0  # not re-queued
    assert len(results(redis_conn, job.id)) == 1
    assert len(done(settings, job.id)) == 1
    meta = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer).meta
    assert not meta.get(DEATHS_FIELD), meta  # no death noted: it is no poison job
