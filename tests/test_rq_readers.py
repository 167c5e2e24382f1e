"""RQ's own readers against a kiln Redis, as a user of RQ would run them: Job.return_value and
latest_result, the finished and failed registries, `rq info`, rq-exporter and rq-dashboard
(the real packages, as processes over the network, with the JSON serializer), a dependent RQ
job, and `rq requeue` (which rewrites a job's meta in pickle)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from redis import Redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from api_client import KilnClient, keys
from tests.support.inprocess import burst, make_renderer
from tests.support.records import enqueue_raw
from tests.workers import free_port, wait_until

MODEL = "tiny-sd15"
QUEUE = keys.queue_name(MODEL)
BIN = Path(sys.executable).parent


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return str(answer.read().decode())


def serve(argv: list[str], url: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start a reader's HTTP server; its process and the body of url once it answers."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def answers() -> str | None:
        assert proc.poll() is None, log.read_text()
        try:
            return fetch(url)
        except OSError:
            return None

    return proc, wait_until(answers, 60, f"{argv[0]} to answer", poll=0.3)


def test_rqs_readers_see_kilns_jobs_as_any_rq_job(
    redis_conn: Redis, redis_url: str, settings: Any, tmp_path: Path
) -> None:
    client = KilnClient(connection=redis_conn)
    done = [
        client.submit({"model": MODEL, "prompt": f"reader {i}", "steps": 2, "seed": i})
        for i in range(3)
    ]
    refused = enqueue_raw(redis_conn, MODEL, {"request": {}}, func="os.getcwd")
    # An RQ job in a queue of its own that waits for a kiln job.
    other = Queue("other", connection=redis_conn, serializer=JSONSerializer)
    dependent = other.enqueue("os.getcwd", depends_on=done[0].id)
    assert dependent.get_status() == JobStatus.DEFERRED

    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])

    # Job.return_value / latest_result, as RQ's own worker leaves them.
    for handle in done:
        job = Job.fetch(handle.id, connection=redis_conn, serializer=JSONSerializer)
        assert job.get_status() == JobStatus.FINISHED
        latest = job.latest_result()
        assert latest is not None and latest.type == Result.Type.SUCCESSFUL
        assert job.return_value()["job_id"] == handle.id
        assert redis_conn.ttl(Result.get_key(handle.id)) > 0
    finished = FinishedJobRegistry(QUEUE, connection=redis_conn, serializer=JSONSerializer)
    assert sorted(finished.get_job_ids(cleanup=False)) == sorted(j.id for j in done)
    failed = FailedJobRegistry(QUEUE, connection=redis_conn, serializer=JSONSerializer)
    assert failed.get_job_ids(cleanup=False) == [refused]
    # The dependent was enqueued when the job it waited for finished, as with RQ's worker.
    assert Job.fetch(dependent.id, connection=redis_conn).get_status() == JobStatus.QUEUED

    # `rq info` with the JSON serializer.
    info = subprocess.run(
        [str(BIN / "rq"), "info", "-u", redis_url, "-S", "json", "-Q", QUEUE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert info.returncode == 0, info.stderr
    assert "3 finished" in info.stdout and "1 failed" in info.stdout, info.stdout

    # rq-exporter 3.1.0 and rq-dashboard 0.9.0, each its real server, read over HTTP.
    port = free_port()
    exporter, metrics = serve(
        [str(BIN / "rq-exporter"), "--redis-url", redis_url, "--port", str(port)],
        f"http://127.0.0.1:{port}/metrics",
        tmp_path / "exporter.log",
    )
    try:
        assert f'rq_jobs{{queue="{QUEUE}",status="finished"}} 3.0' in metrics, metrics
        assert f'rq_jobs{{queue="{QUEUE}",status="failed"}} 1.0' in metrics, metrics
    finally:
        exporter.kill()
    port = free_port()
    dashboard, queues = serve(
        [str(BIN / "rq-dashboard"), "--json", "-u", redis_url, "-b", "127.0.0.1", "-p", str(port)],
        f"http://127.0.0.1:{port}/0/data/queues.json",
        tmp_path / "dashboard.log",
    )
    try:
        import json

        by_name = {q["name"]: q for q in json.loads(queues)["queues"]}
        assert by_name[QUEUE]["finished_job_registry_count"] == 3, queues
        assert by_name[QUEUE]["failed_job_registry_count"] == 1, queues
    finally:
        dashboard.kill()


def test_rq_requeue_of_a_failed_kiln_job_never_makes_kiln_delete_it(
    redis_conn: Redis, redis_url: str, settings: Any
) -> None:
    """`rq requeue` without -S rewrites the job's meta in pickle: kiln reads it as empty
    (never unpickled) and runs the job again, instead of quarantining and deleting it."""
    refused = enqueue_raw(redis_conn, MODEL, {"request": {}}, func="os.getcwd")
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    assert redis_conn.hget(f"rq:job:{refused}", "status") == b"failed"
    requeue = subprocess.run(
        [str(BIN / "rq"), "requeue", "-u", redis_url, "--queue", QUEUE, refused],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert requeue.returncode == 0, requeue.stderr
    meta = redis_conn.hget(f"rq:job:{refused}", "meta")
    assert meta is not None and meta.startswith(b"\x80"), "rq requeue no longer writes pickle"

    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    assert redis_conn.hget(keys.QUARANTINE_KEY, refused) is None
    assert redis_conn.hget(f"rq:job:{refused}", "status") == b"failed"  # refused again, kept
    job = Job.fetch(refused, connection=redis_conn, serializer=JSONSerializer)
    assert "is not" in job.meta["error"]["message"]  # the new failure's reason, in JSON
