"""Redis that keeps what it acknowledged: `kiln doctor` against private redis-servers started
here (one that would lose everything on restart and may evict, one set up as the compose file
has it, one whose ACL refuses CONFIG), and the compose file's own Redis settings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from redis import Redis

from tests.conftest import ROOT, kiln
from tests.workers import RedisServer
from worker.ops.doctor import durability_lines


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    redis = RedisServer(tmp_path, *request.param)
    redis.start()
    try:
        yield redis
    finally:
        redis.kill()


FORGETFUL = ("--appendonly", "no", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
DURABLE = ("--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction")


@pytest.mark.parametrize("server", [FORGETFUL], indirect=True)
def test_doctor_warns_of_a_redis_that_forgets_on_restart_and_evicts(
    server: RedisServer, kiln_env: dict[str, str]
) -> None:
    url = f"redis://127.0.0.1:{server.port}/0"
    done = kiln("doctor", env={**kiln_env, "KILN_REDIS_URL": url})
    assert done.returncode == 0, done.stderr  # a warning, not a failure: Redis answers
    out = done.stdout
    assert "durability    WARNING: AOF off and no RDB save schedule" in out, out
    assert "durability    WARNING: maxmemory-policy allkeys-lru (67108864 bytes)" in out, out


@pytest.mark.parametrize("server", [DURABLE], indirect=True)
def test_a_redis_set_up_as_compose_has_it_gets_no_warning(server: RedisServer) -> None:
    lines = durability_lines(f"redis://127.0.0.1:{server.port}/0")
    assert lines == [
        "AOF on (appendfsync everysec): a crash loses at most the last second",
        "maxmemory-policy noeviction (no limit): a full Redis refuses writes, drops nothing",
    ]


@pytest.mark.parametrize("server", [FORGETFUL], indirect=True)
def test_config_refused_by_the_acl_is_said_not_checked(server: RedisServer) -> None:
    admin = Redis(port=server.port)
    # kiln's worker user as docs/fleet.md lists it: no @dangerous, so no CONFIG.
    admin.acl_setuser(
        "kiln-worker",
        enabled=True,
        passwords=["+pw"],
        keys=["rq:*", "kiln:*"],
        commands=["-@all", "+@read", "+@write", "+@connection", "+info", "-@dangerous"],
    )
    [line] = durability_lines(f"redis://kiln-worker:pw@127.0.0.1:{server.port}/0")
    assert line.startswith("not checked: CONFIG GET refused (")
    assert "appendonly, save and maxmemory-policy" in line


def test_compose_runs_redis_with_an_fsynced_aof_on_a_volume_and_no_eviction() -> None:
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    redis = compose["services"]["redis"]
    argv = redis["command"]
    options = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert argv[0] == "redis-server"
    assert options["--appendonly"] == "yes"
    assert options["--appendfsync"] in ("everysec", "always")
    assert options["--maxmemory-policy"] == "noeviction"
    [volume] = redis["volumes"]
    name, target = volume.split(":")[:2]
    assert target == "/data" and name in compose["volumes"]  # redis:7-alpine's working dir
