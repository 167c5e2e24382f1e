"""Nothing a client writes can take a worker down. One real `kiln worker` process serves every test
here, over real Redis: corrupt job records written straight into Redis (each field rq parses,
`data` missing or not JSON, an id that is no job id) are quarantined with their reason and the
next good job runs; values a client makes huge come back cut short; text that cannot be encoded
is refused naming its field; rq options that change what runs are refused unrun."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq import Queue, Repeat, Retry
from rq.job import Job
from rq.serializers import JSONSerializer

from api_client import KilnClient, RenderFailed, RequestRejected, keys
from api_client.schema import RENDER_FUNC
from tests.conftest import MANIFESTS, kiln
from tests.support.deployments import Deployment, alive, deployed, ends, prepared, quarantined
from tests.support.records import enqueue_raw, log_lines, records, render_record
from tests.workers import wait_until

MODEL = "tiny-sd15"
QUEUE_KEY = f"rq:queue:{keys.queue_name(MODEL)}"
GOOD: dict[str, Any] = {"model": MODEL, "prompt": "ok", "steps": 2, "seed": 1}
MB = 1024 * 1024


def make_record(conn: Redis, field: str, value: bytes | None, **options: Any) -> str:
    """A real rq job record for kiln's render call, one field then made garbage (None: deleted)."""
    job = render_record(conn, MODEL, GOOD, **options)
    if value is None:
        conn.hdel(job.key, field)
    else:
        conn.hset(job.key, field, value)
    return str(job.id)


@pytest.fixture(scope="module")
def deployment(
    redis_url: str, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    out = tmp_path_factory.mktemp("hostile")
    conn, env = prepared(redis_url, tiny_dir, out)
    # Start-up clean-up cases: a dead worker left a corrupt record in the intermediate list, and
    # another one in the started registry with its heartbeat long expired.
    held = make_record(conn, "status", b"exploded")
    conn.rpush(f"{QUEUE_KEY}:intermediate", held)
    abandoned = make_record(conn, "retry_intervals", b"[never")
    conn.zadd(f"rq:wip:{keys.queue_name(MODEL)}", {f"{abandoned}:dead-execution": 1})
    behind = KilnClient(connection=conn, manifests_dir=MANIFESTS).submit(GOOD).id
    planted = {"intermediate": held, "started registry": abandoned, "good job behind": behind}
    with deployed(conn, env, out / "worker.log", "--models", MODEL, planted=planted) as d:
        yield d


def gone(d: Deployment, job_id: str) -> None:
    """Moved aside: no hash left, nowhere on the queue, its list or its intermediate list."""
    assert not d.conn.exists(f"rq:job:{job_id}")
    for key in (QUEUE_KEY, f"{QUEUE_KEY}:intermediate"):
        assert job_id.encode() not in d.conn.lrange(key, 0, -1), key


# -- 1. corrupt records -------------------------------------------------------------------------


def test_startup_cleanup_quarantines_corrupt_records_and_releases_its_lock(
    deployment: Deployment,
) -> None:
    d = deployment
    result = ends(d, d.client.job(d.planted["good job behind"]), timeout=120)
    assert result.images
    alive(d)
    held = quarantined(d, d.planted["intermediate"])
    assert "status='exploded'" in held["reason"], held
    wait_until(
        lambda: d.conn.hexists(keys.QUARANTINE_KEY, d.planted["started registry"]),
        30,
        "the abandoned corrupt record to be quarantined",
    )
    abandoned = quarantined(d, d.planted["started registry"])
    assert "retry_intervals='[never'" in abandoned["reason"], abandoned
    for label in ("intermediate", "started registry"):
        gone(d, d.planted[label])
    assert not d.conn.exists(f"rq:clean_registries:{keys.queue_name(MODEL)}"), "lock stranded"


CORRUPT: dict[str, tuple[str, bytes | None, str]] = {
    # label: field, garbage (None: field deleted), what the reason must say
    "status": ("status", b"bogus", "status='bogus'"),
    "created_at": ("created_at", b"last tuesday", "created_at='last tuesday'"),
    "result_ttl": ("result_ttl", b"forever", "result_ttl='forever'"),
    "timeout": ("timeout", b"soon", "timeout='soon'"),
    "dependency_ids": ("dependency_ids", b"[unclosed", "dependency_ids='[unclosed'"),
    "retry_intervals": ("retry_intervals", b'{"a": 1}', "retry_intervals="),
    "data missing": ("data", None, "data: missing"),
    "data not JSON": ("data", b"\x00garbage{", "data: not JSON"),
}


@pytest.mark.parametrize("label", list(CORRUPT))
def test_corrupt_record_is_quarantined_and_the_next_job_runs(
    deployment: Deployment, label: str
) -> None:
    d = deployment
    field, garbage, says = CORRUPT[label]
    bad = make_record(d.conn, field, garbage)
    d.conn.rpush(QUEUE_KEY, bad)
    assert ends(d, d.client.submit(GOOD)).images
    alive(d)
    entry = quarantined(d, bad)
    assert says in entry["reason"], entry
    with pytest.raises(RenderFailed, match=f"quarantined: .*{re.escape(says[:8])}") as caught:
        d.client.job(bad).wait(timeout=1)
    assert caught.value.status == "quarantined"
    assert entry["queue"] == keys.queue_name(MODEL)
    gone(d, bad)


def test_a_meta_kiln_cannot_read_is_ignored_and_the_job_runs(deployment: Deployment) -> None:
    """rq's own tools rewrite meta in their serializer (`rq requeue` writes pickle): never
    unpickled, never a reason to delete the job, which renders."""
    d = deployment
    bad = make_record(d.conn, "meta", b"\x80\x04\x95 pickle, never loaded")
    d.conn.rpush(QUEUE_KEY, bad)
    assert ends(d, d.client.job(bad)).images
    alive(d)
    assert not d.conn.hexists(keys.QUARANTINE_KEY, bad)


def test_an_id_that_is_no_job_id_is_quarantined(deployment: Deployment) -> None:
    d = deployment
    d.conn.rpush(QUEUE_KEY, "no job id!")
    assert ends(d, d.client.submit(GOOD)).images
    alive(d)
    assert "could not read it" in quarantined(d, "no job id!")["reason"]
    gone(d, "no job id!")


def test_a_job_id_too_long_to_echo_is_quarantined_and_refused_by_the_client(
    deployment: Deployment,
) -> None:
    d = deployment
    long_id = "j" * 300  # rq takes any length; kiln echoes ids and makes directories of them
    job = Job.create(
        RENDER_FUNC,
        kwargs={"request": GOOD},
        id=long_id,
        connection=d.conn,
        serializer=JSONSerializer,
        origin=keys.queue_name(MODEL),
    )
    job.save()
    d.conn.rpush(QUEUE_KEY, long_id)
    assert ends(d, d.client.submit(GOOD)).images
    alive(d)
    assert (
        "id: longer than 200 characters (300)"
        in quarantined(d, long_id[:200] + "... (300 chars)")["reason"]
    )
    gone(d, long_id)
    with pytest.raises(RequestRejected, match="job_id="):
        d.client.submit(GOOD, job_id=long_id)


def test_kiln_quarantine_clears_an_entry(deployment: Deployment) -> None:
    d = deployment
    bad = make_record(d.conn, "status", b"bogus")
    d.conn.rpush(QUEUE_KEY, bad)
    assert ends(d, d.client.submit(GOOD)).images
    listing = kiln("quarantine", env=d.env, timeout=60)
    assert bad in listing.stdout and "status='bogus'" in listing.stdout
    assert kiln("quarantine", "--clear", bad, env=d.env, timeout=60).returncode == 0
    assert bad not in kiln("quarantine", env=d.env, timeout=60).stdout
    assert kiln("quarantine", "--clear", bad, env=d.env, timeout=60).returncode == 1


# -- 2. bounded echoes --------------------------------------------------------------------------


def test_huge_values_and_keys_are_echoed_cut_short(deployment: Deployment) -> None:
    d = deployment
    huge_model = "m" * (10 * MB)
    long_key = "k" * 5000
    stdout_before = d.worker.log.stat().st_size
    jobs = {
        "model": enqueue_raw(d.conn, MODEL, {"request": {**GOOD, "model": huge_model}}),
        "key": enqueue_raw(d.conn, MODEL, {"request": {**GOOD, long_key: 1}}),
    }
    for label, job_id in jobs.items():
        with pytest.raises(RenderFailed) as caught:
            ends(d, d.client.job(job_id))
        assert len(caught.value.message) < 2500, label
        meta = d.conn.hget(f"rq:job:{job_id}", "meta") or b""
        assert len(meta) < 4000, (label, len(meta))
        assert "chars)" in caught.value.message, caught.value.message
    alive(d)
    lines = log_lines(d.timings_log, *jobs.values())
    assert len(lines) == 2 and all(len(line) < 5000 for line in lines), [len(x) for x in lines]
    grown = d.worker.log.stat().st_size - stdout_before
    metas = [len(d.conn.hget(f"rq:job:{j}", "meta") or b"") for j in jobs.values()]
    print(f"\nmeta bytes {metas}, log lines {[len(x) for x in lines]}, stdout +{grown} bytes")
    assert grown < 64 * 1024, f"stdout grew {grown} bytes"
    # The client refuses them too, with a message as short.
    for request in ({**GOOD, "model": huge_model}, {**GOOD, long_key: 1}):
        with pytest.raises(RequestRejected) as rejected:
            d.client.submit(request)
        assert len(str(rejected.value)) < 1000


# -- 3. unencodable text ------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["prompt", "negative_prompt", "model"])
def test_a_lone_surrogate_is_refused_naming_its_field(deployment: Deployment, field: str) -> None:
    d = deployment
    request = {**GOOD, field: "a fox \ud800"}
    with pytest.raises(RequestRejected, match=f"{field}="):
        d.client.submit(request)
    # A producer writing its own JSON can still carry one (escaped); the worker refuses it.
    job = Job.create(
        RENDER_FUNC, kwargs={"request": GOOD}, connection=d.conn, serializer=JSONSerializer
    )
    job.origin = keys.queue_name(MODEL)
    job.save()
    escaped = json.dumps([RENDER_FUNC, None, [], {"request": request}], ensure_ascii=True)
    d.conn.hset(job.key, "data", escaped.encode())
    d.conn.rpush(QUEUE_KEY, job.id)
    with pytest.raises(RenderFailed, match=f"{field}="):
        ends(d, d.client.job(job.id))
    assert ends(d, d.client.submit(GOOD)).images
    alive(d)


# -- 4. rq options that change what runs -----------------------------------------------------


def test_repeat_and_foreign_dependencies_are_refused_unrun(deployment: Deployment) -> None:
    d = deployment
    other = Queue("elsewhere", connection=d.conn, serializer=JSONSerializer)
    foreign = other.enqueue_call("builtins.print", args=("x",)).id
    d.conn.hset(f"rq:job:{foreign}", "status", "finished")  # as if it ran where it was sent
    jobs = {
        "repeat": enqueue_raw(d.conn, MODEL, {"request": GOOD}, repeat=Repeat(times=3)),
        "depends_on": enqueue_raw(d.conn, MODEL, {"request": GOOD}, depends_on=[foreign]),
        "retry": enqueue_raw(d.conn, MODEL, {"request": GOOD}, retry=Retry(50)),
    }
    d.conn.delete(f"rq:job:{foreign}")
    says = {"repeat": "repeat", "depends_on": "depends_on", "retry": "retry max 50"}
    for label, job_id in jobs.items():
        with pytest.raises(RenderFailed, match="refused job") as caught:
            ends(d, d.client.job(job_id))
        assert says[label] in caught.value.message, caught.value.message
    alive(d)
    rendered = {r.job_id for r in records(d.timings_log) if r.status == "done"}
    assert not rendered & set(jobs.values())
    assert not any((d.timings_log.parent / job_id).exists() for job_id in jobs.values())
