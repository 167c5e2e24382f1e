"""Every key a job writes has a lifetime, after each path a client takes (submit, cancel while
queued) and after a job's end; shared state is bounded: a queue holds MAX_QUEUED jobs at most,
and a queue's event stream is trimmed by age (KILN_EVENTS_RETENTION_S), not by count."""

from __future__ import annotations

import time
from typing import Any

import pytest
from redis import Redis
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer

from api_client import KilnClient, RequestRejected, keys
from api_client.cancel import CANCELED_TTL_S
from api_client.enqueue import MAX_QUEUED, QUEUED_TTL_S, RESULT_TTL_S
from api_client.events import EVENTS_RETENTION_S, EVENTS_TTL_S
from api_client.job import STOP_TTL_S
from api_client.schema import JobEvent
from tests.support.inprocess import burst, client_for, make_renderer
from worker.manifest import load_manifests, publish_manifests
from worker.queue import events as job_events

MODEL = "tiny-sd15"
QUEUE = keys.queue_name(MODEL)
REQUEST = {"model": MODEL, "prompt": "a wren", "steps": 2, "seed": 5}
# Shared state: bounded in size (MAX_QUEUED, trimmed by age, one entry per model or worker...),
# not by a lifetime.
SHARED = (
    "rq:queue:",
    "rq:queues",
    "rq:wip:",
    "rq:finished:",
    "rq:failed:",
    "rq:workers",
    keys.QUEUE_EVENTS_KEY_PREFIX,
    keys.MANIFESTS_KEY,
    keys.FITS_KEY,
    keys.WORKERS_KEY,
    keys.WEBHOOK_TARGETS_KEY,
)


def lifetimes(conn: Redis, job_id: str) -> dict[str, int]:
    """TTL of every key that names the job, and of any key that is not shared state."""
    found: dict[str, int] = {}
    for raw in conn.scan_iter(count=1000):
        key = raw.decode()
        if job_id in key or not key.startswith(SHARED):
            found[key] = conn.ttl(key)
    return found


def assert_lifetimes(found: dict[str, int], bounds: dict[str, int]) -> None:
    """Each key has a TTL in (0, its bound]; bounds is keyed by the key itself."""
    assert set(found) == set(bounds), (found, bounds)
    for key, ttl in found.items():
        assert 0 < ttl <= bounds[key], (key, ttl, bounds[key])


@pytest.fixture
def client(redis_conn: Redis, settings: Any) -> KilnClient:
    publish_manifests(redis_conn, load_manifests(settings.manifests, [MODEL]))
    return client_for(redis_conn, settings)


def test_a_submitted_job_expires_if_no_worker_ever_takes_it(
    redis_conn: Redis, client: KilnClient
) -> None:
    job = client.submit(REQUEST, job_id="never-taken")
    client.submit(REQUEST, job_id="never-taken")  # idempotent: the lifetime stays as it was
    assert_lifetimes(
        lifetimes(redis_conn, job.id),
        {keys.rq_job_key(job.id): QUEUED_TTL_S, keys.events_key(job.id): QUEUED_TTL_S},
    )
    assert redis_conn.hget(keys.rq_job_key(job.id), "ttl") == str(QUEUED_TTL_S).encode()


def test_a_job_canceled_while_queued_leaves_every_key_with_a_lifetime(
    redis_conn: Redis, client: KilnClient
) -> None:
    canceled = keys.RQ_CANCELED_PREFIX + QUEUE
    redis_conn.zadd(canceled, {"long-gone": time.time() - 1})  # an entry already past its expiry
    job = client.submit(REQUEST)
    assert job.cancel() == "queued"
    assert job.cancel() == "canceled"  # twice: nothing more happens

    assert_lifetimes(
        lifetimes(redis_conn, job.id),
        {
            keys.rq_job_key(job.id): CANCELED_TTL_S,
            keys.events_key(job.id): EVENTS_TTL_S,
            keys.stop_key(job.id): STOP_TTL_S,
            canceled: CANCELED_TTL_S,
        },
    )
    [(entry, expires)] = redis_conn.zrange(canceled, 0, -1, withscores=True)
    assert entry == job.id.encode()  # the lapsed entry went with this cancel
    assert time.time() < expires <= time.time() + CANCELED_TTL_S
    assert redis_conn.llen(keys.rq_queue_key(QUEUE)) == 0
    # RQ's readers see it as a canceled job.
    registry = CanceledJobRegistry(QUEUE, connection=redis_conn, serializer=JSONSerializer)
    assert registry.get_job_ids() == [job.id]
    assert job.status() == "canceled"
    assert [e.kind for e in job.events(timeout=1)] == ["queued", "stopped"]


def test_a_job_that_ran_leaves_every_key_with_a_lifetime(
    redis_conn: Redis, client: KilnClient, settings: Any
) -> None:
    job = client.submit(REQUEST)
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    assert job.wait(timeout=5).steps == 2
    found = {k: v for k, v in lifetimes(redis_conn, job.id).items() if job.id in k}
    assert {keys.rq_job_key(job.id), keys.events_key(job.id)} <= set(found)
    # Whatever else the worker writes for a job (RQ's results stream...) lives as long at most.
    assert_lifetimes(found, {key: max(RESULT_TTL_S, EVENTS_TTL_S) for key in found})


OLD_EVENTS = 300  # three stream nodes' worth (stream-node-max-entries is 100)
NODE = 100


def write_old_events(conn: Redis, model: str, age_s: float) -> None:
    """OLD_EVENTS events age_s old in the model's queue stream, with explicit ids."""
    old_ms = int((time.time() - age_s) * 1000)
    key = keys.queue_events_key(model)
    with conn.pipeline(transaction=False) as pipe:
        for n in range(OLD_EVENTS):
            pipe.xadd(key, {"event": "{}"}, id=f"{old_ms}-{n}")
        pipe.execute()


def old_left(conn: Redis, model: str, age_s: float) -> int:
    cut = int((time.time() - age_s / 2) * 1000)
    return len(conn.xrange(keys.queue_events_key(model), max=str(cut)))


def test_the_queue_stream_is_trimmed_by_age_by_client_and_worker(
    redis_conn: Redis, settings: Any
) -> None:
    publish_manifests(redis_conn, load_manifests(settings.manifests, [MODEL]))
    hour = 3600.0
    # A day old at the default retention: kept.
    write_old_events(redis_conn, MODEL, EVENTS_RETENTION_S - hour)
    client_for(redis_conn, settings).submit(REQUEST)
    assert old_left(redis_conn, MODEL, EVENTS_RETENTION_S - hour) == OLD_EVENTS

    # Older than the client's retention: gone with its next write, but for the node the cut
    # falls in (`~` trims whole nodes).
    redis_conn.flushdb()
    publish_manifests(redis_conn, load_manifests(settings.manifests, [MODEL]))
    client = KilnClient(
        connection=redis_conn, manifests_dir=settings.manifests, events_retention_s=hour
    )
    write_old_events(redis_conn, MODEL, 2 * hour)
    job = client.submit(REQUEST)
    assert old_left(redis_conn, MODEL, 2 * hour) <= NODE
    [*_, newest] = client.queue_events(MODEL, after="0", timeout=0.1)
    assert (newest.kind, newest.job_id) == ("queued", job.id)
    redis_conn.delete(keys.queue_events_key(MODEL))  # old ids go only into a stream without new
    write_old_events(redis_conn, MODEL, 2 * hour)
    job.cancel()  # its stopped event trims too
    assert old_left(redis_conn, MODEL, 2 * hour) <= NODE

    # The worker's writes trim to its own KILN_EVENTS_RETENTION_S.
    write_old_events(redis_conn, "tiny-sdxl", 2 * hour)
    write_old_events(redis_conn, "tiny-sd3", 2 * hour)
    abandoned = JobEvent(kind="failed", job_id="j2", model="tiny-sd3", at=time.time())
    job_events.set_retention(hour)
    try:
        journal = job_events.open_journal(redis_conn, "j1", "kiln:tiny-sdxl", {})
        journal.flush()  # its started event
        with redis_conn.pipeline(transaction=False) as pipe:
            job_events.add_ended(pipe, [abandoned])  # a job that ends outside a journal
            pipe.execute()
    finally:
        job_events.set_retention(EVENTS_RETENTION_S)
    assert old_left(redis_conn, "tiny-sdxl", 2 * hour) <= NODE
    assert old_left(redis_conn, "tiny-sd3", 2 * hour) <= NODE
    assert 0 < redis_conn.ttl(keys.events_key("j2")) <= EVENTS_TTL_S


def test_retention_comes_from_kiln_events_retention_s(
    redis_url: str, make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_EVENTS_RETENTION_S", "7200")
    assert KilnClient.from_env().events_retention_s == 7200
    assert make_settings().events_retention_s == 7200
    monkeypatch.delenv("KILN_EVENTS_RETENTION_S")
    assert KilnClient.from_env().events_retention_s == EVENTS_RETENTION_S
    assert make_settings().events_retention_s == EVENTS_RETENTION_S
    monkeypatch.setenv("KILN_EVENTS_RETENTION_S", "a day")
    with pytest.raises(ValueError, match="KILN_EVENTS_RETENTION_S must be a number of seconds"):
        KilnClient.from_env()
    with pytest.raises(ValueError, match="at least 60 s"):
        KilnClient(redis_url, events_retention_s=0)


def test_a_full_queue_refuses_a_submit_naming_the_model(
    redis_conn: Redis, client: KilnClient
) -> None:
    queue_key = keys.rq_queue_key(QUEUE)
    redis_conn.rpush(queue_key, *[f"waiting-{n}" for n in range(MAX_QUEUED)])
    with pytest.raises(RequestRejected) as caught:
        client.submit(REQUEST, job_id="one-too-many")
    [problem] = caught.value.problems
    assert (problem.field, problem.value) == ("model", MODEL)
    assert problem.rule.startswith(f"queue full: {MAX_QUEUED} jobs waiting"), problem.rule
    assert not redis_conn.exists(keys.rq_job_key("one-too-many"), keys.events_key("one-too-many"))
    assert redis_conn.llen(queue_key) == MAX_QUEUED

    redis_conn.lpop(queue_key)  # a worker took one: room again
    assert client.submit(REQUEST, job_id="one-too-many").status() == "queued"
