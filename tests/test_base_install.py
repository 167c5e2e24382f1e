"""`pip install kiln-render` alone (pydantic, redis, rq) runs the client verbs against a real
Redis and worker, and a worker verb there says in one line which extra to install, exit 2.
tests/fixtures/base_install.py makes the extras' modules, torch and worker.settings unimportable
in the `kiln` subprocess."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from redis import Redis

from tests.conftest import ROOT
from tests.support.inprocess import burst, make_renderer, make_worker
from tests.workers import wait_until

BASE_KILN = [sys.executable, "-m", "tests.fixtures.base_install"]
SUBMIT = ("submit", "a quiet harbour", "--model", "tiny-sd15", "--steps", "2", "--seed", "9")
WORKER_VERBS = [  # one a handler family: the worker's, the manifests', ops/, queue/, Pillow's
    ("worker", "--burst"),
    ("manifests", "publish"),
    ("doctor",),
    ("top", "--once"),
    ("quarantine",),
    ("replay", "any.png"),
]


def base_kiln(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*BASE_KILN, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_client_verbs_run_on_the_base_install(
    kiln_env: dict[str, str], redis_conn: Redis, settings: Any, tmp_path: Path
) -> None:
    # The base install reads no manifest files (PyYAML is the worker's): workers publish them.
    make_worker(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    listed = base_kiln("models", "--json", env=kiln_env)
    assert listed.returncode == 0, listed.stderr
    assert "tiny-sd15" in [m["id"] for m in json.loads(listed.stdout)]
    assert "no live worker" in base_kiln("models", env=kiln_env).stdout

    doomed = json.loads(base_kiln(*SUBMIT, "--json", env=kiln_env).stdout)["job_id"]
    canceled = base_kiln("cancel", doomed, env=kiln_env)
    assert canceled.returncode == 0 and "canceled" in canceled.stdout, canceled.stderr

    waiting = subprocess.Popen(
        [*BASE_KILN, *SUBMIT, "--wait", "--queue-anyway", "--json"],
        env=kiln_env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: redis_conn.llen("rq:queue:kiln:tiny-sd15"), 60, "the job to be queued")
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, err
    result = json.loads(out)
    job_id = result["job_id"]

    shown = base_kiln("job", job_id, env=kiln_env)
    assert shown.returncode == 0, shown.stderr
    assert (
        f"{job_id}: finished" in shown.stdout and result["images"][0]["sha256"][:16] in shown.stdout
    )
    recent = base_kiln("jobs", env=kiln_env).stdout.splitlines()
    assert job_id in recent[0] and "finished" in recent[0], recent
    fetched = base_kiln("fetch", job_id, str(tmp_path), env=kiln_env)
    assert fetched.returncode == 0, fetched.stderr
    [path] = [Path(p) for p in fetched.stdout.split()]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == result["images"][0]["sha256"]


def test_a_worker_verb_on_the_base_install_names_the_extra_in_one_line(
    kiln_env: dict[str, str],
) -> None:
    for verb in WORKER_VERBS:
        done = base_kiln(*verb, env=kiln_env)
        assert done.returncode == 2, (verb, done.stderr)
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f"kiln {verb[0]}: needs the worker extra ("), line
        assert line.endswith("is missing): pip install 'kiln-render[worker]'"), line
    gateway = base_kiln("api", env=kiln_env)
    assert gateway.returncode == 2 and gateway.stderr.strip() == (
        "kiln api: needs the api extra (uvicorn is missing): pip install 'kiln-render[api]'"
    )
