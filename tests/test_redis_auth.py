"""Redis as deployed, not as on a laptop: a private redis-server with TLS only, ACL users (no
default user) and an append-only file. A real `kiln worker` connects over rediss:// with the
worker ACL, a client submits with the client ACL, and Redis is SIGKILLed and restarted mid-job."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import AuthenticationError, ResponseError

from api_client import KilnClient
from tests.conftest import kiln
from tests.fixtures.gate import Gate
from tests.support.deployments import Deployment, worker_env
from tests.support.jobs import denoising
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

# The ACLs kiln documents for operators (docs/fleet.md, "Redis ACLs"); these tests prove them.
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


@dataclass
class SecuredRedis:
    """A private redis-server as deployed: TLS only, ACL users (no default user), an AOF."""

    server: RedisServer
    worker_url: str
    client_url: str
    anonymous_url: str


def secured_redis(root: Path) -> SecuredRedis:
    tls = make_tls_files(root / "tls")
    # Redis 7.0 replays MULTI/EXEC from the AOF as the default user: turning it off loses
    # every transaction on restart (measured here), so it stays on, behind an admin password.
    admin = "user default on >admin-secret ~* &* +@all"
    (root / "users.acl").write_text(f"{admin}\n{WORKER_ACL}\n{CLIENT_ACL}\n")
    (root / "data").mkdir()
    server = RedisServer(
        root / "data",
        "--aclfile",
        str(root / "users.acl"),
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        tls=tls,
    )
    server.start()
    query = f"ssl_ca_certs={tls / 'ca.crt'}&ssl_cert_reqs=required"
    return SecuredRedis(
        server,
        f"rediss://kiln-worker:worker-secret@127.0.0.1:{server.port}/0?{query}",
        f"rediss://kiln-client:client-secret@127.0.0.1:{server.port}/0?{query}",
        f"rediss://127.0.0.1:{server.port}/0?{query}",
    )


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredRedis]:
    secured = secured_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield secured
    finally:
        secured.server.kill()


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Gate:
    """A job of more than 2 steps waits at the gate, mid-denoise, until a test opens it."""
    return Gate(tmp_path_factory.mktemp("gate") / "gate")


@pytest.fixture(scope="module")
def deployment(
    redis: SecuredRedis, gate: Gate, tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path
) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("deployment")
    manifests = slow_manifests(root / "manifests")
    env = worker_env(redis.worker_url, tiny_dir, root, manifests)
    worker = WorkerProcess(
        env,
        root / "worker.log",
        "--models",
        f"{SLOW_MODEL},tiny-sd15",
        options=gated(gate),
    )
    conn = Redis.from_url(redis.client_url)
    try:
        worker.wait_ready(conn)
        yield Deployment(conn, KilnClient(redis.client_url, manifests_dir=manifests), worker, env)
    finally:
        worker.stop()


def test_worker_and_client_work_over_tls_with_their_acl_users(
    deployment: Deployment, redis: SecuredRedis
) -> None:
    client = deployment.client
    result = client.submit({"model": "tiny-sd15", "prompt": "over tls", "steps": 2}).wait(
        timeout=60
    )
    assert Path(result.images[0].path).is_file()
    shown = kiln(
        "models",
        "--json",
        env={**deployment.env, "KILN_REDIS_URL": redis.client_url},
    )
    assert shown.returncode == 0, shown.stderr
    assert {m["id"]: m for m in json.loads(shown.stdout)}["tiny-sd15"]["workers"] == [
        deployment.worker.name
    ]
    # The ACLs are enforced: no anonymous access, and the client cannot flush the database.
    with pytest.raises((AuthenticationError, ResponseError)):
        Redis.from_url(redis.anonymous_url).set("kiln:x", 1)
    with pytest.raises(ResponseError, match="no permissions"):
        Redis.from_url(redis.client_url).flushdb()
    # The fleet's compiled code (worker/pipelines/compile_cache.py) is the workers' alone.
    fleet = CompileCache(Redis.from_url(redis.worker_url), 2**20, 60)
    assert fleet.stats() == {"entries": 0, "bytes": 0}
    with pytest.raises(ResponseError, match="no permissions"):
        CompileCache(Redis.from_url(redis.client_url), 2**20, 60).stats()
    with pytest.raises(ResponseError, match="no permissions"):
        Redis.from_url(redis.client_url).hset(f"{PREFIX}x", "tar", b"code")
    assert "could not connect" not in deployment.worker.output()
    assert "no permissions" not in deployment.worker.output(), deployment.worker.output()


def test_redis_restarted_mid_job_loses_nothing(
    deployment: Deployment, redis: SecuredRedis, gate: Gate
) -> None:
    client = deployment.client
    job = client.submit(
        {"model": SLOW_MODEL, "prompt": "through a restart", "steps": 12, "seed": 8}
    )

    wait_until(
        lambda: job.id in gate.held() and denoising(job, 2),
        120,
        "the job to wait at the gate, denoising",
    )
    redis.server.restart()  # SIGKILL, then start again on the same AOF
    queued_after = client.submit({"model": "tiny-sd15", "prompt": "after the restart", "steps": 2})
    gate.open()
    result = job.wait(timeout=180)
    assert result.steps == 12 and Path(result.images[0].path).is_file()
    assert queued_after.wait(timeout=60).model == "tiny-sd15"
    assert deployment.worker.proc.poll() is None, deployment.worker.output()
    deployment.worker.signal(signal.SIGTERM)
    assert deployment.worker.wait(timeout=60) == 0
