"""The verbs that act on a job by id (kiln job, cancel, fetch, jobs) against a real worker, and
waits that always end with an answer: no serving worker, a timeout, a cancel logged at info."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from redis import Redis

from tests.conftest import kiln
from tests.support.inprocess import burst, client_for, make_renderer

SUBMIT = ("submit", "a quiet harbour", "--model", "tiny-sd15", "--steps", "2", "--seed", "9")


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_wait_with_no_serving_worker_says_so_in_seconds(
    kiln_env: dict[str, str], redis_conn: Redis
) -> None:
    started = time.monotonic()
    done = kiln(*SUBMIT, "--wait", env=kiln_env, timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 4, (done.returncode, done.stderr)
    line = one_line(done.stderr)
    [job_id] = [k.decode().removeprefix("rq:job:") for k in redis_conn.keys("rq:job:*")]
    assert job_id in line and "no live worker serves tiny-sd15" in line and "--queue-anyway" in line
    assert redis_conn.hget(f"rq:job:{job_id}", "status") == b"queued"  # it stays queued
    assert took < 30, took  # an interpreter start, the submit and the 3 s look for a worker

    # --queue-anyway waits; --timeout then ends it with one line and exit 3, the job going on.
    done = kiln(*SUBMIT, "--wait", "--queue-anyway", "--timeout", "1", env=kiln_env, timeout=60)
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert "still queued after 1 s" in one_line(done.stderr)


def test_job_verbs_follow_a_job_through_a_real_worker(
    kiln_env: dict[str, str], redis_conn: Redis, settings: Any, tmp_path: Path
) -> None:
    submitted = kiln(*SUBMIT, "--json", env=kiln_env)
    job_id = json.loads(submitted.stdout)["job_id"]
    queued = json.loads(kiln("job", job_id, "--json", env=kiln_env).stdout)
    assert (queued["status"], queued["position"], queued["model"]) == ("queued", 0, "tiny-sd15")
    assert queued["request"]["prompt"] == "a quiet harbour"
    not_yet = kiln("fetch", job_id, str(tmp_path), env=kiln_env)
    assert not_yet.returncode == 1 and "queued, not finished" in one_line(not_yet.stderr)
    doomed = client_for(redis_conn, settings).submit(
        {"model": "tiny-sd15", "prompt": "never", "steps": 2}
    )
    canceled = kiln("cancel", doomed.id, env=kiln_env)
    assert canceled.returncode == 0 and "canceled: taken off its queue" in canceled.stdout

    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    shown = kiln("job", job_id, env=kiln_env)
    assert shown.returncode == 0 and f"{job_id}: finished" in shown.stdout
    finished = json.loads(kiln("job", job_id, "--json", env=kiln_env).stdout)
    fetched = kiln("fetch", job_id, str(tmp_path), env=kiln_env)
    assert fetched.returncode == 0, fetched.stderr
    [path] = [Path(p) for p in fetched.stdout.split()]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == finished["result"]["images"][0]["sha256"]
    listed = kiln("jobs", "--model", "tiny-sd15", env=kiln_env).stdout.splitlines()
    assert job_id in listed[0] and "finished" in listed[0], listed  # newest first
    assert doomed.id in listed[1] and "canceled" in listed[1], listed
    again = kiln("cancel", job_id, env=kiln_env)
    assert again.returncode == 1 and "already finished" in again.stdout
    for verb in ("job", "cancel", "fetch"):
        missing = kiln(verb, "no-such-job", env=kiln_env)
        assert missing.returncode == 1 and "no-such-job" in one_line(missing.stderr), verb


def test_models_shows_modes_loras_and_whether_a_worker_serves_each(
    kiln_env: dict[str, str], redis_conn: Redis, settings: Any
) -> None:
    from tests.support.inprocess import make_worker

    make_worker(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])  # publishes
    listed = {m["id"]: m for m in json.loads(kiln("models", "--json", env=kiln_env).stdout)}
    sd15 = listed["tiny-sd15"]
    assert sd15["served"] is False and sd15["workers"] == []  # published, but no live worker
    assert "img2img" in sd15["modes"] and sd15["loras"] == ["detail", "kohya", "style"]
    human = kiln("models", env=kiln_env | {"COLUMNS": "300"}).stdout  # wide enough for all
    assert "no live worker" in human and "detail, kohya, style" in human
