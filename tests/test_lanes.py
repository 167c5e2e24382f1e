"""Priority lanes (worker/queue/lanes.py): a request's priority picks its model's queue,
kiln:<model> or kiln:<model>:batch; a worker takes interactive jobs first and at least one batch
job in every BATCH_EVERY while batch jobs wait; ETAs, `kiln models` and cancel know both lanes."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from redis import Redis
from rq import Queue

from api_client import RequestRejected, keys
from api_client.eta import taken_first
from api_client.schema import RenderRequest, TimingFit, request_digest, request_payload
from tests.conftest import kiln
from tests.fixtures.gate import hold_here
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from tests.workers import wait_until
from worker.manifest import load_manifests, publish_manifests
from worker.queue.lanes import BATCH_EVERY, LaneOrder, worker_queues

MODEL = "tiny-sd15"
JOB = {"model": MODEL, "prompt": "a lane", "steps": 2}


def _names(queues: list[Queue]) -> list[str]:
    return [q.name for q in queues]


def test_lane_order_puts_interactive_first_lets_batch_through_and_takes_turns(
    redis_conn: Redis,
) -> None:
    queues = [Queue(n, connection=redis_conn) for n in worker_queues(["a", "b"])]
    assert _names(queues) == ["kiln:a", "kiln:b", "kiln:a:batch", "kiln:b:batch"]
    lanes = LaneOrder(queues)
    a, b, a_batch = queues[0], queues[1], queues[2]
    assert _names(lanes.order()) == ["kiln:a", "kiln:b", "kiln:a:batch", "kiln:b:batch"]
    # Models take turns within a lane; interactive stays ahead of batch...
    assert _names(lanes.after(a)) == ["kiln:b", "kiln:a", "kiln:a:batch", "kiln:b:batch"]
    assert _names(lanes.after(b))[:2] == ["kiln:a", "kiln:b"]
    # ...until BATCH_EVERY - 1 interactive jobs in a row: then batch is looked at first.
    assert _names(lanes.after(a)) == ["kiln:a:batch", "kiln:b:batch", "kiln:b", "kiln:a"]
    # A batch job taken starts the count again, and passes the batch turn to the next model.
    assert _names(lanes.after(a_batch)) == ["kiln:b", "kiln:a", "kiln:b:batch", "kiln:a:batch"]
    assert BATCH_EVERY == keys.BATCH_EVERY == 4


def test_eta_counts_the_other_lanes_jobs_the_rule_takes_first() -> None:
    # An interactive job lets one batch job through per BATCH_EVERY - 1 interactive ahead of it.
    assert [taken_first("interactive", ahead, 10) for ahead in (0, 2, 3, 7)] == [0, 0, 1, 2]
    assert taken_first("interactive", 9, 1) == 1  # never more than are queued
    # A batch job waits for at most BATCH_EVERY - 1 interactive jobs per batch job to its own.
    assert [taken_first("batch", ahead, 100) for ahead in (0, 1)] == [3, 6]
    assert taken_first("batch", 5, 2) == 2


def test_priority_picks_the_lane_and_interactive_is_the_unset_request() -> None:
    plain, said = RenderRequest(**JOB), RenderRequest(**JOB, priority="interactive")
    batch = RenderRequest(**JOB, priority="batch")
    # Said or left out, interactive is the same request: wire form and digest as before lanes.
    assert request_payload(said) == request_payload(plain)
    assert "priority" not in request_payload(plain)
    assert request_digest(said) == request_digest(plain)
    assert (plain.lane, batch.lane) == ("interactive", "batch")
    assert request_payload(batch)["priority"] == "batch"
    assert request_digest(batch) != request_digest(plain)
    with pytest.raises(RequestRejected) as rejected:
        RenderRequest.parse({**JOB, "priority": "urgent"})
    [problem] = rejected.value.problems
    assert problem.field == "priority" and problem.value == "urgent"
    assert "interactive" in problem.rule and "batch" in problem.rule
    assert keys.queue_name(MODEL, "batch") == "kiln:tiny-sd15:batch"
    assert keys.model_of("kiln:tiny-sd15:batch") == keys.model_of("kiln:tiny-sd15") == MODEL
    with pytest.raises(ValueError, match=r"lane 'urgent': must be one of interactive, batch"):
        keys.queue_name(MODEL, "urgent")


def test_a_batch_job_waits_on_its_lane_and_is_canceled_there(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    job = client.submit({**JOB, "priority": "batch"})
    batch_key = keys.rq_queue_key(keys.queue_name(MODEL, "batch"))
    assert redis_conn.lrange(batch_key, 0, -1) == [job.id.encode()]
    assert redis_conn.llen(keys.rq_queue_key(keys.queue_name(MODEL))) == 0
    assert job.cancel() == "queued"
    assert redis_conn.llen(batch_key) == 0 and job.status() == "canceled"
    stopped = [e for e in client.queue_events(MODEL, after="0", timeout=0.5) if e.job_id == job.id]
    assert stopped[-1].kind == "stopped" and stopped[-1].model == MODEL


def test_eta_and_models_count_both_lanes(redis_conn: Redis, settings: Any) -> None:
    publish_manifests(redis_conn, load_manifests(settings.manifests, [MODEL]))
    fit = TimingFit(fixed_s=0.2, per_step_s=0.05, samples=4, rung="full")
    redis_conn.hset(keys.FITS_KEY, keys.fit_field(MODEL, 128, 128), fit.model_dump_json())
    client = client_for(redis_conn, settings)
    batch = [client.submit({**JOB, "priority": "batch", "seed": n}) for n in range(2)]
    interactive = [client.submit({**JOB, "seed": 10 + n}) for n in range(5)]
    one = fit.eta(2)
    # The fourth interactive job has 3 interactive ahead and lets one batch job through first.
    assert interactive[3].eta() == pytest.approx(4 * one + one)
    # The second batch job: one batch ahead, and at most 3 interactive for each of the two.
    assert batch[1].eta() == pytest.approx((1 + 5) * one + one)
    [info] = [i for i in client.models() if i.manifest.id == MODEL]
    assert info.queued == {"interactive": 5, "batch": 2}
    default = info.default_eta_s
    assert default is not None
    assert info.eta_now_s("interactive") == pytest.approx((5 + 1) * default + default)
    assert info.eta_now_s("batch") == pytest.approx((2 + 5) * default + default)


def _order(settings: Any) -> list[str]:
    return [r.job_id for r in records(settings.timings_log)]


def test_a_late_interactive_job_overtakes_queued_batch_jobs(
    redis_conn: Redis, settings: Any, monkeypatch: Any
) -> None:
    client = client_for(redis_conn, settings)
    batch = [client.submit({**JOB, "priority": "batch", "seed": n}).id for n in range(3)]
    late: list[str] = []

    def submit_late() -> None:
        # Once the worker renders the first batch job, an interactive one arrives.
        wait_until(lambda: client.job(batch[0]).status() == "started", 120, "batch to start")
        late.append(client.submit({**JOB, "seed": 99}).id)

    hold_here(monkeypatch, lambda step: bool(late), at=1)  # until the late submit has landed
    submitter = threading.Thread(target=submit_late)
    submitter.start()
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    submitter.join(timeout=10)
    assert late, "the late interactive job was never submitted"
    assert _order(settings) == [batch[0], late[0], batch[1], batch[2]]


def test_a_stream_of_interactive_jobs_still_lets_batch_through(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    batch = [client.submit({**JOB, "priority": "batch", "seed": n}).id for n in range(2)]
    interactive = [client.submit({**JOB, "seed": 10 + n}).id for n in range(8)]
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    order = _order(settings)
    assert sorted(order) == sorted(batch + interactive)
    # Interactive first, but one batch job in every BATCH_EVERY while batch jobs wait.
    assert [order.index(b) for b in batch] == [BATCH_EVERY - 1, 2 * BATCH_EVERY - 1], order
    assert [j for j in order if j in interactive] == interactive  # first in, first out


def test_kiln_submit_priority_batch_queues_on_the_batch_lane(
    redis_conn: Redis, settings: Any, kiln_env: dict[str, str]
) -> None:
    publish_manifests(redis_conn, load_manifests(settings.manifests, [MODEL]))
    done = kiln("submit", "a lane", "--model", MODEL, "--priority", "batch", env=kiln_env)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.split()[1]
    assert done.stdout.strip() == f"queued {job_id} on kiln:{MODEL}:batch"
    batch_key = keys.rq_queue_key(keys.queue_name(MODEL, "batch"))
    assert redis_conn.lrange(batch_key, 0, -1) == [job_id.encode()]
    models = kiln("models", "--json", env=kiln_env)
    [tiny] = [m for m in json.loads(models.stdout) if m["id"] == MODEL]
    assert tiny["queued"] == {"interactive": 0, "batch": 1}
    wrong = kiln("submit", "a lane", "--model", MODEL, "--priority", "urgent", env=kiln_env)
    assert wrong.returncode == 2 and "--priority: invalid choice: 'urgent'" in wrong.stderr
