"""`import api_client` stays light: a backend pays for it in every process it starts. Checked by
what a fresh interpreter has loaded (deterministic), not by a timing."""

from __future__ import annotations

import json
import subprocess
import sys

from redis import Redis
from rq.job import Job
from rq.queue import Queue
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)

from api_client import keys
from tests.conftest import ROOT

HEAVY = ("torch", "diffusers", "rq", "redis", "redis.asyncio")


def loaded_after(code: str) -> list[str]:
    """Which HEAVY modules a fresh interpreter has loaded after running code."""
    report = f"import json, sys; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    probe = f"{code}\n{report}"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    return loaded


def test_import_api_client_loads_no_torch_diffusers_rq_or_redis() -> None:
    # redis-py imports redis.asyncio with itself (redis/__init__.py), so redis waits too.
    assert loaded_after("import api_client; from api_client import *") == []


def test_redis_and_rq_load_when_a_call_needs_them(redis_url: str, redis_conn: Redis) -> None:
    """The same probe sees them once a client submits: the check above is not vacuous."""
    code = (
        "from api_client import KilnClient\n"
        f"job = KilnClient({redis_url!r}).submit("
        "{'model': 'tiny-sd15', 'prompt': 'p', 'steps': 2, 'seed': 1})\n"
        "assert job.status() == 'queued'"
    )
    assert loaded_after(code) == ["rq", "redis", "redis.asyncio"]


def test_the_rq_names_the_client_uses_are_rqs_own(redis_conn: Redis) -> None:
    queue = "kiln:tiny-sd15"
    assert keys.rq_job_key("j") == Job.key_for("j")
    assert keys.rq_queue_key(queue) == Queue(queue, connection=redis_conn).key
    registries = {
        keys.RQ_STARTED_PREFIX: StartedJobRegistry,
        keys.RQ_CANCELED_PREFIX: CanceledJobRegistry,
        keys.RQ_DEFERRED_PREFIX: DeferredJobRegistry,
        keys.RQ_SCHEDULED_PREFIX: ScheduledJobRegistry,
    }
    for prefix, registry in registries.items():
        assert prefix + queue == registry(queue, connection=redis_conn).key
