"""A deployment a module's tests share: one real `kiln worker` process over real Redis, with the
environment it runs in (for `kiln` commands too) and a client; and what a test asks of it: is
the worker alive, how did a job end, what does `kiln quarantine` list."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis import Redis

from api_client import KilnClient, KilnJob, RenderResult
from tests.conftest import MANIFESTS, kiln
from tests.workers import WorkerProcess, wait_until

ENDED = ("finished", "failed", "stopped", "canceled")


def worker_env(
    redis_url: str, models_dir: Path, root: Path, manifests: Path = MANIFESTS
) -> dict[str, str]:
    """A `kiln worker` process's environment: ours without KILN_*, then its Redis, manifests and
    models, its outputs and timings log under root/out, its inductor cache under root/inductor."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(
        KILN_REDIS_URL=redis_url,
        KILN_MANIFESTS=str(manifests),
        KILN_MODELS_DIR=str(models_dir),
        KILN_OUTPUT_DIR=str(root / "out"),
        KILN_TIMINGS_LOG=str(root / "out" / "timings.jsonl"),
        KILN_INDUCTOR_CACHE_DIR=str(root / "inductor"),
        PYTHONUNBUFFERED="1",
    )
    return env


@dataclass
class Deployment:
    conn: Redis
    client: KilnClient
    worker: WorkerProcess
    env: dict[str, str]  # the worker's (worker_env)
    planted: dict[str, str] = field(default_factory=dict)  # label -> job id, before it began
    metrics_port: int = 0  # its --metrics-port, if it has one

    @property
    def timings_log(self) -> Path:
        return Path(self.env["KILN_TIMINGS_LOG"])


def prepared(redis_url: str, models_dir: Path, root: Path) -> tuple[Redis, dict[str, str]]:
    """The test's own Redis, flushed, and a `kiln worker` environment under root (worker_env)."""
    conn = Redis.from_url(redis_url)
    conn.flushdb()
    return conn, worker_env(redis_url, models_dir, root)


@contextmanager
def deployed(
    conn: Redis, env: dict[str, str], log: Path, *args: str, **fields: Any
) -> Iterator[Deployment]:
    """A `kiln worker` of these arguments in env (worker_env), once ready, as a Deployment with a
    client of conn and fields (planted, metrics_port); on the way out the worker stops and conn
    is flushed and closed (the deployment's Redis is the test's own)."""
    worker = WorkerProcess(env, log, *args)
    try:
        worker.wait_ready(conn)
        client = KilnClient(connection=conn, manifests_dir=Path(env["KILN_MANIFESTS"]))
        yield Deployment(conn, client, worker, env, **fields)
    finally:
        worker.stop()
        conn.flushdb()
        conn.close()


def alive(d: Deployment) -> None:
    assert d.worker.proc.poll() is None, f"worker died:\n{d.worker.output()}"


def ends(d: Deployment, job: KilnJob, timeout: float = 60.0) -> RenderResult:
    """The job's result (RenderFailed if it failed), failing at once if the worker dies."""
    wait_until(lambda: alive(d) or job.status() in ENDED, timeout, f"job {job.id} to end")
    return job.wait(timeout=5)


def quarantined(d: Deployment, job_id: str) -> dict[str, Any]:
    """The entry `kiln quarantine --json` lists for this id (the real command line)."""
    done = kiln("quarantine", "--json", env=d.env, timeout=60)
    assert done.returncode == 0, done.stderr
    listed = {e["job_id"]: e for e in map(json.loads, done.stdout.splitlines())}
    assert job_id in listed, f"{job_id} not in `kiln quarantine`: {done.stdout}"
    return listed[job_id]
