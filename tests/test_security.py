"""Only kiln's render function ever runs. Hostile jobs on a kiln queue, each naming something RQ's
own Job would import and run, are refused by a real worker over real Redis with nothing executed,
and the worker takes the next job."""

from __future__ import annotations

import http.server
import json
import os
import pickle
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq import Callback, Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.webhook import Webhook

from api_client import KilnJob, RenderFailed, keys
from api_client.events import EVENTS_TTL_S
from tests.support.inprocess import burst, client_for, make_renderer, make_worker
from tests.support.records import enqueue_raw, records
from worker.queue.job import RenderJob

MODEL = "tiny-sd15"
REQUEST: dict[str, Any] = {"model": MODEL, "prompt": "ok", "steps": 2, "seed": 1}
# `import this` prints the Zen of Python: any import of it shows in sys.modules.
IMPORT_CANARY = "this"


class Touch:
    """Unpickling this touches a file: the classic pickle payload, made harmless."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    return tmp_path / "executed"


@pytest.fixture
def webhook_hits() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP endpoint that records every request it gets."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args: Any) -> None:
            return None

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook", hits
    server.shutdown()


def hostile_jobs(conn: Redis, canary: Path, hook: str) -> dict[str, str]:
    """label -> job id, every one on the tiny-sd15 queue as a hostile producer could put it."""
    command = f"touch {canary}"
    good = {"request": REQUEST}
    return {
        "os.system": enqueue_raw(conn, MODEL, {}, func="os.system", args=(command,)),
        "eval": enqueue_raw(
            conn, MODEL, {}, func="builtins.eval", args=(f"__import__('os').system({command!r})",)
        ),
        "exec": enqueue_raw(
            conn, MODEL, {}, func="builtins.exec", args=(f"import os; os.system({command!r})",)
        ),
        "subprocess": enqueue_raw(
            conn, MODEL, {}, func="subprocess.check_call", args=(["touch", str(canary)],)
        ),
        "import side effect": enqueue_raw(conn, MODEL, good, func=f"{IMPORT_CANARY}.s"),
        "success callback": enqueue_raw(
            conn, MODEL, good, on_success=Callback(f"{IMPORT_CANARY}.s")
        ),
        "failure callback": enqueue_raw(conn, MODEL, good, on_failure=Callback("os.system")),
        "stopped callback": enqueue_raw(conn, MODEL, good, on_stopped=Callback("os.system")),
        "webhook": enqueue_raw(
            conn, MODEL, good, webhooks=[Webhook(hook, "finished"), Webhook(hook, "failed")]
        ),
        "positional args": enqueue_raw(conn, MODEL, {}, args=(REQUEST,)),
    }


def test_hostile_jobs_are_refused_unrun_and_the_worker_goes_on(
    redis_conn: Redis, settings: Any, canary: Path, webhook_hits: tuple[str, list[str]]
) -> None:
    hook, hits = webhook_hits
    assert IMPORT_CANARY not in sys.modules
    jobs = hostile_jobs(redis_conn, canary, hook)
    after = client_for(redis_conn, settings).submit(REQUEST)
    worker = burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])

    for label, job_id in jobs.items():
        handle = client_for(redis_conn, settings).job(job_id)
        with pytest.raises(RenderFailed, match="refused job") as caught:
            handle.wait(timeout=5)
        assert caught.value.status == "failed", label
        assert not (settings.output_dir / job_id).exists(), f"{label}: the render ran"
    assert not canary.exists(), "a hostile job executed"
    assert IMPORT_CANARY not in sys.modules, "a job's function or callback name was imported"
    # No send can still be on its way: RQ sends a record's webhooks in the worker's loop and waits
    # for the answer (urlopen), so any would be in hits once burst() returned; kiln's own
    # deliveries, the only ones sent from a thread, are all done.
    assert worker.webhooks.pending() == 0
    assert hits == []
    assert after.wait(timeout=5).model == MODEL
    # Refused jobs never reach the renderer, yet each leaves its one timing record.
    log = {r.job_id: r for r in records(settings.timings_log)}
    assert len(log) == len(jobs) + 1
    for label, job_id in jobs.items():
        assert log[job_id].status == "failed" and "refused job" in (log[job_id].error or ""), label

    # The test can fail: RQ's own Job resolves these names to the real callables.
    plain = Job.fetch(jobs["os.system"], connection=redis_conn, serializer=JSONSerializer)
    assert plain.func is os.system


def test_a_pickled_payload_is_never_unpickled(
    redis_conn: Redis, settings: Any, canary: Path
) -> None:
    queue = Queue(keys.queue_name(MODEL), connection=redis_conn)  # RQ's default: pickle
    job = queue.enqueue_call("worker.queue.render_job", kwargs={"request": REQUEST})
    payload = pickle.dumps((Touch(canary), None, (), {}))
    redis_conn.hset(job.key, "data", payload)
    after = client_for(redis_conn, settings).submit(REQUEST)
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])

    # Not JSON: moved into the quarantine before anything could read it.
    entry = json.loads(redis_conn.hget(keys.QUARANTINE_KEY, job.id) or b"{}")
    assert "data: not JSON" in entry.get("reason", ""), entry
    assert not redis_conn.exists(job.key)
    assert not canary.exists(), "the worker unpickled a payload"
    assert after.wait(timeout=5).model == MODEL
    # The test can fail: the payload does run when unpickled.
    pickle.loads(payload)
    assert canary.exists()


def test_abandoned_hostile_job_runs_no_callback_during_recovery(
    redis_conn: Redis, settings: Any
) -> None:
    """RQ's registry cleanup calls an abandoned job's failure callback; kiln's never resolves it."""
    assert IMPORT_CANARY not in sys.modules
    job_id = enqueue_raw(
        redis_conn, MODEL, {"request": REQUEST}, on_failure=Callback(f"{IMPORT_CANARY}.s")
    )
    queue = Queue(keys.queue_name(MODEL), connection=redis_conn, serializer=JSONSerializer)
    # As if a worker had taken it and died: in the started registry with a lapsed heartbeat.
    redis_conn.lrem(queue.key, 0, job_id)
    redis_conn.hset(f"rq:job:{job_id}", "status", "started")
    redis_conn.zadd(f"rq:wip:{queue.name}", {f"{job_id}:dead-execution": time.time() - 60})
    worker = make_worker(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    worker.sweeper.sweep()
    assert redis_conn.hget(f"rq:job:{job_id}", "status") == b"failed"  # no retries were asked for
    assert IMPORT_CANARY not in sys.modules
    # Its event stream ends as a failed job's does, with why, and expires with it.
    [failed] = KilnJob(job_id, redis_conn).events(timeout=1)
    assert failed.kind == "failed" and "abandoned 1 time(s)" in (failed.error or ""), failed
    assert 0 < redis_conn.ttl(keys.events_key(job_id)) <= EVENTS_TTL_S
    assert isinstance(
        RenderJob.fetch(job_id, connection=redis_conn, serializer=JSONSerializer), RenderJob
    )
