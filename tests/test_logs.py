"""The worker's log as an operator's shipper reads it. From real `kiln worker` processes: under
KILN_LOG_FORMAT=json every line on stdout and stderr is one JSON object (kiln's records, stdlib
and RQ lines, the warm-shutdown warning), and a Redis outage leaves exactly one `redis_lost`
and one `redis_regained` line, with how long Redis was gone. In a subprocess: library loggers,
warnings and tracebacks in both formats. In process: the outage watch's rules."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry
from structlog.testing import capture_logs

from api_client import KilnClient
from tests.conftest import ROOT
from tests.fixtures.gate import Gate
from tests.support.jobs import denoising
from tests.workers import Options, RedisServer, WorkerProcess, free_port, gated, wait_until
from worker.queue.upkeep.pulse import RedisWatch, WatchedRetry, watch_connection

OUTAGE_S = 4.0


class SplitWorker(WorkerProcess):
    """A gated `kiln worker` (a job of more than 2 steps waits at self.gate) with stdout and
    stderr in two files: merged, a line from one stream could land inside a line of the other
    and neither would parse."""

    def __init__(self, env: dict[str, str], directory: Path, *args: str) -> None:
        self.gate = Gate(directory / "gate")
        json_logs = Options({"KILN_LOG_FORMAT": "json"})
        log, errors = directory / "stdout.log", directory / "stderr.log"
        super().__init__(env, log, *args, options=gated(self.gate) | json_logs, errors=errors)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] + self.err.read_text(errors="replace")

    def lines(self) -> list[tuple[str, str]]:
        """(stream, line) for every line written so far, blank ones included."""
        return [
            (path.stem, line)
            for path in (self.log, self.err)
            for line in path.read_text(errors="replace").splitlines()
        ]

    def events(self) -> list[dict[str, Any]]:
        """Every line that parses as a JSON object (the other ones are what test (a) catches)."""
        found = []
        for _, line in self.lines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                found.append(event)
        return found

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("event") == name]


def not_json(lines: list[tuple[str, str]]) -> list[str]:
    bad = []
    for stream, line in lines:
        try:
            parsed = json.loads(line)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            bad.append(f"{stream}: {line!r}")
    return bad


def test_every_line_of_a_json_worker_is_json_through_a_warm_shutdown(
    redis_conn: Redis, kiln_env: dict[str, str], settings: Any, tmp_path: Path
) -> None:
    worker = SplitWorker(kiln_env, tmp_path, "--models", "tiny-sd15")
    try:
        worker.wait_ready(redis_conn)
        client = KilnClient(connection=redis_conn, manifests_dir=settings.manifests)
        job = client.submit({"model": "tiny-sd15", "prompt": "json lines", "steps": 8, "seed": 2})
        wait_until(
            lambda: worker.gate.held() == [job.id] and denoising(job), 120, "the job at the gate"
        )
        worker.signal(signal.SIGTERM)
        wait_until(lambda: "warm shutdown requested" in worker.output(), 30, "the SIGTERM")
        worker.gate.open()
        assert worker.wait(timeout=120) == 0, worker.output()
        assert job.wait(timeout=1).steps == 8  # the warm shutdown finished it
    finally:
        worker.stop()
    lines = worker.lines()
    assert lines, "the worker wrote nothing"
    assert not_json(lines) == [], "\n".join(not_json(lines))
    [warm] = [e for e in worker.events() if "warm shutdown requested" in str(e.get("event"))]
    assert warm["level"] == "warning" and warm["logger"] == "worker.queue.worker", warm
    assert "timestamp" in warm
    names = [e.get("event") for e in worker.events()]
    assert "worker_started" in names and "job_timing" in names, names


LIBRARY_LINES = """
import logging, sys, warnings
from worker import logs
logs.configure(sys.argv[1], secrets=["s3cret"])
import diffusers.utils.logging as diffusers_logging
import transformers.utils.logging as transformers_logging
logs.route_library_logs()
diffusers_logging.get_logger("diffusers.pipelines").warning("from diffusers")
transformers_logging.get_logger("transformers.models").error("from transformers")
warnings.warn("from warnings")
try:
    raise ValueError("redis://kiln:s3cret@h:6379/0")
except ValueError:
    logging.getLogger("rq.worker").exception("from rq")
"""


def test_library_logs_warnings_and_tracebacks_are_json_lines_and_redacted() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LIBRARY_LINES, "json"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = [("stderr", line) for line in done.stderr.splitlines()]
    assert not_json(lines) == [], "\n".join(not_json(lines))
    by_logger = {e["logger"]: e for e in map(json.loads, done.stderr.splitlines())}
    assert by_logger["diffusers.pipelines"]["event"] == "from diffusers"
    assert by_logger["transformers.models"]["level"] == "error"
    assert "UserWarning: from warnings" in by_logger["py.warnings"]["event"]
    assert "ValueError: redis://***@h:6379/0" in by_logger["rq.worker"]["exception"]
    assert "s3cret" not in done.stdout + done.stderr
    console = subprocess.run(
        [sys.executable, "-c", LIBRARY_LINES, "console"], cwd=ROOT, capture_output=True, text=True
    )
    assert console.returncode == 0, console.stderr
    assert "from diffusers" in console.stderr and "[diffusers.pipelines]" in console.stderr
    assert "s3cret" not in console.stdout + console.stderr


def test_an_outage_is_logged_once_however_many_commands_and_threads_meet_it() -> None:
    watch = RedisWatch()
    with capture_logs() as logged:
        watch.answered()  # nothing was lost: nothing to say
        before = time.monotonic()
        watch.failed(ConnectionError("refused"), before)
        watch.failed(TimeoutError("timed out"), time.monotonic())  # the same outage
        watch.answered()
        watch.answered()
        watch.failed(ConnectionError("late"), before)  # sent before Redis came back
        assert watch.lost_at is None
        watch.failed(ConnectionError("again"), time.monotonic())  # a new outage
    assert [(e["event"], e.get("error")) for e in logged] == [
        ("redis_lost", "ConnectionError: refused"),
        ("redis_regained", None),
        ("redis_lost", "ConnectionError: again"),
    ]
    assert 0 <= logged[1]["down_s"] < 5


def test_a_watched_connection_keeps_its_retry_policy_and_reports_to_one_watch() -> None:
    retry = Retry(ExponentialBackoff(cap=0.01, base=0.001), retries=2)
    connection = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", retry=retry)
    watch = watch_connection(connection)
    assert watch_connection(connection) is watch  # a second Pulse finds the same watch
    watched = connection.get_retry()
    assert isinstance(watched, WatchedRetry) and watched.get_retries() == 2
    copied = copy.deepcopy(watched)  # as redis-py makes each new connection's policy
    assert isinstance(copied, WatchedRetry) and copied.watch is watch
    with capture_logs() as logged, pytest.raises(RedisConnectionError):
        connection.ping()  # nothing listens there: refused, retried twice, raised
    assert [e["event"] for e in logged] == ["redis_lost"]
    assert watch.lost_at is not None


def test_a_pooled_socket_left_from_before_an_outage_is_not_redis_answering(
    tmp_path: Path,
) -> None:
    """redis-py's pool calls connect() on every connection it hands out, and on one already
    connected that returns at once: a stale socket from before the outage must not read as
    Redis back (it logged redis_regained, then a second redis_lost, in one outage)."""
    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    retry = Retry(ExponentialBackoff(cap=0.01, base=0.001), retries=1)
    connection = Redis.from_url(f"redis://127.0.0.1:{redis.port}/0", retry=retry)
    try:
        watch = watch_connection(connection)
        pool = connection.connection_pool
        idle, busy = pool.get_connection(), pool.get_connection()  # two sockets, connected
        pool.release(idle)
        redis.kill()
        with capture_logs() as logged:
            with pytest.raises(RedisConnectionError):
                connection.ping()  # on idle: the outage begins
            pool.release(busy)  # another thread's socket, back in the pool from before
            with pytest.raises(RedisConnectionError):
                connection.ping()  # on busy: the same outage
        assert [e["event"] for e in logged] == ["redis_lost"]
        redis.start()
        with capture_logs() as logged:
            assert connection.ping() is True
        assert [e["event"] for e in logged] == ["redis_regained"] and watch.lost_at is None
    finally:
        connection.close()
        redis.kill()


@pytest.mark.slow  # tests/test_idle_stop.py holds the one-lost-one-regained rule in make test
def test_a_redis_outage_leaves_one_lost_and_one_regained_line(
    kiln_env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    url = f"redis://127.0.0.1:{redis.port}/0"
    worker = SplitWorker({**kiln_env, "KILN_REDIS_URL": url}, tmp_path, "--models", "tiny-sd15")
    try:
        worker.wait_ready(Redis.from_url(url))
        # 1. Redis goes away for OUTAGE_S while the worker waits on its queues, and comes back on
        #    the same port (empty: it saves nothing).
        redis.kill()
        stopped_at = time.monotonic()
        wait_until(lambda: worker.named("redis_lost"), 30, "the worker to log redis_lost")
        time.sleep(max(OUTAGE_S - (time.monotonic() - stopped_at), 0))  # the outage itself
        redis.start()
        outage_s = time.monotonic() - stopped_at
        wait_until(lambda: worker.named("redis_regained"), 60, "the worker to log redis_regained")
        # 2. The worker works on: a job submitted after the outage is rendered.
        conn = Redis.from_url(url)
        worker.wait_ready(conn)  # its state is published again
        client = KilnClient(connection=conn, manifests_dir=Path(kiln_env["KILN_MANIFESTS"]))
        client.submit({"model": "tiny-sd15", "prompt": "after", "steps": 2}).wait(timeout=120)
    finally:
        worker.stop()
        redis.kill()
    [lost] = worker.named("redis_lost")
    [regained] = worker.named("redis_regained")
    assert lost["level"] == "warning" and "ConnectionError" in lost["error"], lost
    assert regained["level"] == "info", regained
    # Regained is noticed at the next retry after Redis answers (redis-py backs off up to 2 s).
    assert outage_s - 1.0 <= regained["down_s"] <= outage_s + 4.0, (regained, outage_s)
    assert not_json(worker.lines()) == []


def test_a_worker_whose_redis_is_down_at_start_says_so_before_loading_anything(
    kiln_env: dict[str, str], tmp_path: Path
) -> None:
    """Redis is the worker's first contact: an unreachable one is logged (redis_lost) at the
    first failed try, before the imports and weights that take seconds, and then retried."""
    env = {**kiln_env, "KILN_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    started = time.monotonic()
    worker = WorkerProcess(env, tmp_path / "w.log", "--models", "tiny-sd15", "--burst")

    def redis_lost() -> dict[str, Any] | None:
        if worker.proc.poll() is not None:
            raise AssertionError(
                f"the worker ended without saying Redis was lost:\n{worker.output()}"
            )
        for line in worker.log.read_text(errors="replace").splitlines():
            if line.startswith("{") and json.loads(line).get("event") == "redis_lost":
                return dict(json.loads(line))
        return None

    try:
        lost = wait_until(redis_lost, 60, "the worker to say Redis was lost")
        took = time.monotonic() - started
        assert "Connection refused" in lost["error"] or "Error 111" in lost["error"], lost
        assert worker.proc.poll() is None  # still retrying, not given up
        assert took < 20, took  # an interpreter start and the settings, nothing heavier
    finally:
        worker.stop()
