"""Routing and the queue surface: one queue per model, at_front priority, idempotent job ids, and
the worker state (models, resident, heartbeat) that `kiln models` and client.models() show."""

from __future__ import annotations

import json
import time
from typing import Any

from redis import Redis

from tests.conftest import kiln
from tests.support.inprocess import burst, client_for, make_renderer, make_worker
from tests.support.records import enqueue_raw, records


def test_a_worker_takes_only_the_queues_of_its_models(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    mine = client.submit({"model": "tiny-sd15", "prompt": "mine", "steps": 2})
    other = client.submit({"model": "tiny-sdxl", "prompt": "not mine", "steps": 2})
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    assert mine.wait(timeout=5).model == "tiny-sd15"
    assert other.status() == "queued"
    assert redis_conn.lrange("rq:queue:kiln:tiny-sdxl", 0, -1) == [other.id.encode()]


def test_at_front_jumps_the_queue(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    normal = [
        client.submit({"model": "tiny-sd15", "prompt": f"n{i}", "steps": 2}) for i in range(3)
    ]
    urgent = client.submit({"model": "tiny-sd15", "prompt": "urgent", "steps": 2}, at_front=True)
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    order = [r.job_id for r in records(settings.timings_log)]
    assert order == [urgent.id] + [job.id for job in normal]


def test_the_same_job_id_renders_once(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    request = {"model": "tiny-sd15", "prompt": "once", "steps": 2, "seed": 4}
    first = client.submit(request, job_id="order-1234")
    second = client.submit(request, job_id="order-1234")
    assert first.id == second.id == "order-1234"
    assert redis_conn.llen("rq:queue:kiln:tiny-sd15") == 1
    renderer = make_renderer(settings, ["tiny-sd15"])
    burst(redis_conn, renderer, ["tiny-sd15"])
    result = first.wait(timeout=5)
    # Submitted again after it finished: still the same job, nothing enqueued.
    assert client.submit(request, job_id="order-1234").wait(timeout=1) == result
    burst(redis_conn, renderer, ["tiny-sd15"])
    assert [r.job_id for r in records(settings.timings_log)] == ["order-1234"]


def test_workers_publish_models_resident_and_heartbeat(
    redis_conn: Redis, settings: Any, kiln_env: dict[str, str]
) -> None:
    client = client_for(redis_conn, settings)
    client.submit({"model": "tiny-sd15", "prompt": "warm up", "steps": 2})
    renderer = make_renderer(settings, ["tiny-sd15", "tiny-sdxl"])
    worker = make_worker(redis_conn, renderer, ["tiny-sd15", "tiny-sdxl"])
    worker.work(burst=True)
    assert client.workers() == []  # a worker that exits withdraws its state
    before = time.time()
    worker.publish_state()  # what the pulse thread does every couple of seconds
    [state] = client.workers()
    assert state.name == worker.name and state.models == ["tiny-sd15", "tiny-sdxl"]
    assert state.resident == ["tiny-sd15"] and state.heartbeat >= before
    info = {i.manifest.id: i for i in client.models()}
    assert info["tiny-sd15"].workers == [worker.name] and info["tiny-sd15"].resident_on == [
        worker.name
    ]
    assert info["tiny-sdxl"].workers == [worker.name] and info["tiny-sdxl"].resident_on == []
    shown = kiln("models", "--json", env=kiln_env, check=True)
    listed = {m["id"]: m for m in json.loads(shown.stdout)}
    assert listed["tiny-sd15"]["resident_on"] == [worker.name]
    assert listed["tiny-sdxl"]["workers"] == [worker.name]


def test_metrics_endpoint_counts_jobs_and_phases(redis_conn: Redis, make_settings: Any) -> None:
    """`--metrics-port`: after a burst, /metrics shows the jobs by status, phase histograms, the
    drilled out-of-memory attempts and descent, the resident rung, memory, and queue depth."""
    import socket
    import urllib.request

    from prometheus_client import REGISTRY

    from worker.queue.upkeep.metrics import start_metrics

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start_metrics(port, redis_conn, ["tiny-sd15", "tiny-sdxl"])
    # Counters are per process and other tests' jobs count too: compare before and after.
    counted = {
        "done": ("kiln_jobs_total", {"model": "tiny-sd15", "status": "done"}),
        "failed": ("kiln_jobs_total", {"model": "tiny-sd15", "status": "failed"}),
        "oom": ("kiln_oom_total", {"model": "tiny-sd15", "rung": "full", "phase": "denoise"}),
        "descent": ("kiln_rung_descents_total", {"model": "tiny-sd15", "rung": "full"}),
    }
    before = {k: REGISTRY.get_sample_value(*v) or 0.0 for k, v in counted.items()}
    settings = make_settings(faults="oom@denoise:full*2")
    client = client_for(redis_conn, settings)
    client.submit({"model": "tiny-sd15", "prompt": "counted", "steps": 2})
    enqueue_raw(redis_conn, "tiny-sd15", {"request": {"model": "tiny-sd15", "prompt": ""}})
    client.submit({"model": "tiny-sdxl", "prompt": "waiting", "steps": 2})
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    after = {k: REGISTRY.get_sample_value(*v) or 0.0 for k, v in counted.items()}
    assert {k: after[k] - before[k] for k in counted} == {
        "done": 1,
        "failed": 1,
        "oom": 2,
        "descent": 1,
    }
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'kiln_jobs_total{model="tiny-sd15",status="done"}' in text
    assert 'kiln_phase_seconds_count{model="tiny-sd15",phase="denoise"}' in text
    assert 'kiln_resident_rung{model="tiny-sd15",rung="partial"} 1.0' in text  # one rung down
    assert "kiln_device_memory_allocated_bytes " in text
    assert 'kiln_queue_depth{model="tiny-sdxl"} 1.0' in text
    assert 'kiln_queue_depth{model="tiny-sd15"} 0.0' in text
