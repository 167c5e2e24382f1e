"""Redis as deployed, not as on a laptop: a private redis-server with TLS only, ACL users (no
default user) and an append-only file. A real `kiln worker` connects over rediss:// with the
worker ACL, a client submits with the client ACL, and Redis is SIGKILLed and restarted mid-job."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import AuthenticationError, ResponseError

from api_client import KilnClient
from tests.conftest import kiln
from tests.fixtures.gate import Gate
from tests.workers import (
    SLOW_MODEL,
    RedisServer,
    WorkerProcess,
    gated,
    make_tls_files,
    slow_manifests,
    wait_until,
)
from worker.pipelines.compile_cache import PREFIX, CompileCache

# The ACLs kiln documents for operators (README "Redis ACLs"); these tests prove they suffice.
WORKER_ACL = (
    "user kiln-worker on >worker-secret ~rq:* ~kiln:* ~kiln-fleet:* &rq:pubsub:* "
    "-@all +@read +@write +@keyspace +@list +@hash +@set +@sortedset +@string +@transaction "
    "+@scripting +@pubsub +@connection -@dangerous +info +client|setname +client|list"
)
CLIENT_ACL = (
    "user kiln-client on >client-secret ~rq:* ~kiln:* &rq:pubsub:* "
    "-@all +@read +@write +@keyspace +@list +@hash +@set +@sortedset +@string +@transaction "
    "+@scripting +@connection -@dangerous +info +publish"
)


class Deployment:
    def __init__(self, root: Path, tiny_dir: Path) -> None:
        self.tls = make_tls_files(root / "tls")
        # Redis 7.0 replays MULTI/EXEC from the AOF as the default user: turning it off loses
        # every transaction on restart (measured here), so it stays on, behind an admin password.
        admin = "user default on >admin-secret ~* &* +@all"
        (root / "users.acl").write_text(f"{admin}\n{WORKER_ACL}\n{CLIENT_ACL}\n")
        (root / "data").mkdir()
        self.redis = RedisServer(
            root / "data",
            "--aclfile",
            str(root / "users.acl"),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            tls=self.tls,
        )
        self.redis.start()
        query = f"ssl_ca_certs={self.tls / 'ca.crt'}&ssl_cert_reqs=required"
        self.worker_url = (
            f"rediss://kiln-worker:worker-secret@127.0.0.1:{self.redis.port}/0?{query}"
        )
        self.client_url = (
            f"rediss://kiln-client:client-secret@127.0.0.1:{self.redis.port}/0?{query}"
        )
        self.anonymous_url = f"rediss://127.0.0.1:{self.redis.port}/0?{query}"
        self.manifests = slow_manifests(root / "manifests")
        self.output = root / "out"
        self.env = {
            "KILN_REDIS_URL": self.worker_url,
            "KILN_MANIFESTS": str(self.manifests),
            "KILN_MODELS_DIR": str(tiny_dir),
            "KILN_OUTPUT_DIR": str(self.output),
            "KILN_TIMINGS_LOG": str(self.output / "timings.jsonl"),
            "KILN_INDUCTOR_CACHE_DIR": str(root / "inductor"),
            "PYTHONUNBUFFERED": "1",
        }
        # A job of more than 2 steps waits at the gate, mid-denoise, until a test opens it.
        self.gate = Gate(root / "gate")
        self.worker = WorkerProcess(
            self.env_with_path(),
            root / "worker.log",
            "--models",
            f"{SLOW_MODEL},tiny-sd15",
            fake=gated(self.gate),
        )

    def env_with_path(self) -> dict[str, str]:
        import os

        return {**{k: v for k, v in os.environ.items() if not k.startswith("KILN_")}, **self.env}

    def client(self) -> KilnClient:
        return KilnClient(self.client_url, manifests_dir=self.manifests)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Deployment]:
    deployed = Deployment(tmp_path_factory.mktemp("deployment"), tiny_dir)
    try:
        deployed.worker.wait_ready(Redis.from_url(deployed.client_url))
        yield deployed
    finally:
        deployed.worker.stop()
        deployed.redis.kill()


def test_worker_and_client_work_over_tls_with_their_acl_users(deployment: Deployment) -> None:
    client = deployment.client()
    result = client.submit({"model": "tiny-sd15", "prompt": "over tls", "steps": 2}).wait(
        timeout=60
    )
    assert Path(result.images[0].path).is_file()
    shown = kiln(
        "models",
        "--json",
        env={**deployment.env_with_path(), "KILN_REDIS_URL": deployment.client_url},
    )
    assert shown.returncode == 0, shown.stderr
    assert {m["id"]: m for m in json.loads(shown.stdout)}["tiny-sd15"]["workers"] == [
        deployment.worker.name
    ]
    # The ACLs are enforced: no anonymous access, and the client cannot flush the database.
    with pytest.raises((AuthenticationError, ResponseError)):
        Redis.from_url(deployment.anonymous_url).set("kiln:x", 1)
    with pytest.raises(ResponseError, match="no permissions"):
        Redis.from_url(deployment.client_url).flushdb()
    # The fleet's compiled code (worker/pipelines/compile_cache.py) is the workers' alone.
    fleet = CompileCache(Redis.from_url(deployment.worker_url), 2**20, 60)
    assert fleet.stats() == {"entries": 0, "bytes": 0}
    with pytest.raises(ResponseError, match="no permissions"):
        CompileCache(Redis.from_url(deployment.client_url), 2**20, 60).stats()
    with pytest.raises(ResponseError, match="no permissions"):
        Redis.from_url(deployment.client_url).hset(f"{PREFIX}x", "tar", b"code")
    assert "could not connect" not in deployment.worker.output()
    assert "no permissions" not in deployment.worker.output(), deployment.worker.output()


def test_redis_restarted_mid_job_loses_nothing(deployment: Deployment) -> None:
    client = deployment.client()
    job = client.submit(
        {"model": SLOW_MODEL, "prompt": "through a restart", "steps": 12, "seed": 8}
    )

    def denoising() -> bool:
        progress = job.progress()
        held = job.id in deployment.gate.held()
        return held and progress is not None and progress.phase == "denoise" and progress.step >= 2

    wait_until(denoising, 120, "the job to wait at the gate, denoising")
    deployment.redis.restart()  # SIGKILL, then start again on the same AOF
    queued_after = client.submit({"model": "tiny-sd15", "prompt": "after the restart", "steps": 2})
    deployment.gate.open()
    result = job.wait(timeout=180)
    assert result.steps == 12 and Path(result.images[0].path).is_file()
    assert queued_after.wait(timeout=60).model == "tiny-sd15"
    assert deployment.worker.proc.poll() is None, deployment.worker.output()
    deployment.worker.signal(signal.SIGTERM)
    assert deployment.worker.wait(timeout=60) == 0
