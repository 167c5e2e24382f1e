"""The dialects' share of bench/api_bench.py (issue 38: a dialect costs at most 5 ms a job over
kiln's own route and no Redis command per waiting call beyond the event stream it reads):

  per job   OpenAIPath: POST /openai/v1/images/generations (response_format b64_json) held until
            the job ends, over the same keep-alive httpx connection as kiln's route, the same
            requests and seeds; api_bench.per_job runs it in its rotation beside kiln's route and
            the Python client. The worker's own time on each job (for the time outside the
            render) and the image's sha256 are read from the job's result after the block, once
            its Redis commands are counted; A1111Path does the same with /sdapi/v1/txt2img where
            the gateway serves that dialect.
  held      --held concurrent OpenAI generation calls (raw HTTP/1.1 on asyncio, one connection a
            call) on one fresh `kiln api` process, rendered by the real `kiln worker`: the worker
            is paused (SIGSTOP) while the calls are made and held, so a quiet window of
            --held-wait seconds shows what waiting costs (Redis commands by INFO commandstats,
            the gateway's Redis connections by CLIENT LIST, its threads and RSS by psutil), then
            resumed (SIGCONT) to render them all; every call must answer 200 with its job's image.

Run through bench/api_bench.py, which imports this module and prints its tables."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench import api_bench as shared

OPENAI = "/openai/v1/images/generations"
A1111 = "/sdapi/v1/txt2img"
BENCH_OWN = ("client|list",)  # the connection sampler's own reads, left out of the held figures


# -- per job: a dialect's call, its job read back after the block ---------------------------------


class DialectPath:
    """One dialect's call held until its job ends, on the bench's keep-alive httpx client. The
    answer carries no job id, so the jobs are read back after the block (outside the counted
    Redis commands) from the token's newest jobs: one job in flight, so they are the block's."""

    label = ""
    route = ""

    def __init__(self, http: Any, conn: Any, token: str) -> None:
        from api_client import KilnClient
        from api_client.http.tokens import Tokens

        self.http, self.token = http, token
        self.tokens = Tokens(conn)
        self.client = KilnClient(connection=conn, manifests_dir=shared.ROOT / "manifests")
        # kiln's route leaves size and guidance to the manifest: a dialect's job must match
        self.manifest = self.client.manifests()[shared.MODEL]
        self.made: list[tuple[int, str]] = []  # (seed, sha256 of the image answered)

    def body(self, steps: int, seed: int) -> dict[str, Any]:
        raise NotImplementedError

    def image(self, answer: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def __call__(self, steps: int, seed: int) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        answer = self.http.post(self.route, json=self.body(steps, seed), headers=headers)
        assert answer.status_code == 200, f"{self.route}: {answer.status_code} {answer.text[:500]}"
        self.made.append((seed, hashlib.sha256(self.image(answer.json())).hexdigest()))

    def settle(self) -> list[float]:
        """The worker's own seconds on each call's job since the last settle, in call order;
        each job's seed and image checked against what its call sent and got."""
        caller = self.tokens.caller(self.token)
        assert caller is not None
        ids = list(reversed(self.tokens.recent_jobs(caller, len(self.made))))
        renders = []
        for (seed, sha), job_id in zip(self.made, ids, strict=True):
            result = self.client.job(job_id).result()
            assert result is not None, f"{self.label}: job {job_id} has no result"
            assert result.seed == seed, f"{self.label}: job {job_id} seed {result.seed} != {seed}"
            assert result.images[0].sha256 == sha, f"{self.label}: job {job_id}'s image differs"
            made = (result.width, result.height, result.guidance)
            want = (*self.manifest.default_size, self.manifest.guidance.default)
            assert made == want, f"{self.label}: job {job_id} rendered {made}, kiln's route {want}"
            renders.append(result.timings.total)
        self.made = []
        return renders


class OpenAIPath(DialectPath):
    label = "OpenAI dialect: POST images/generations, held, b64_json"
    route = OPENAI

    def body(self, steps: int, seed: int) -> dict[str, Any]:
        return {**shared.request(steps, seed), "response_format": "b64_json"}

    def image(self, answer: dict[str, Any]) -> bytes:
        return base64.b64decode(answer["data"][0]["b64_json"])


class A1111Path(DialectPath):
    label = "A1111 dialect: POST sdapi/v1/txt2img, held"
    route = A1111

    def body(self, steps: int, seed: int) -> dict[str, Any]:
        width, height = self.manifest.default_size
        size = {"width": width, "height": height, "cfg_scale": self.manifest.guidance.default}
        return {"prompt": shared.PROMPT, "steps": steps, "seed": seed, **size}

    def image(self, answer: dict[str, Any]) -> bytes:
        return base64.b64decode(answer["images"][0])


def dialect_paths(http: Any, conn: Any, token: str, url: str) -> dict[str, DialectPath]:
    """The OpenAI dialect; A1111's too where this gateway serves /sdapi/v1 (its txt2img)."""
    paths: dict[str, DialectPath] = {"openai": OpenAIPath(http, conn, token)}
    if a1111_served(http):
        paths["a1111"] = A1111Path(http, conn, token)
    return paths


def a1111_served(http: Any) -> bool:
    return bool(http.get("/sdapi/v1/samplers").status_code == 200)


def dialect_figures(figures: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Each dialect against kiln's own route (http), side by side: ms outside the render and
    Redis commands a job more (the issue's bounds: at most 5 ms, no command more)."""
    route = figures["http"]
    out = {}
    for name in names:
        own = figures[name]
        by_command = {
            k: own["redis_by_command"].get(k, 0) - route["redis_by_command"].get(k, 0)
            for k in sorted({*own["redis_by_command"], *route["redis_by_command"]})
        }
        out[name] = {
            "outside_added_ms_median": (
                own["outside_render_median_s"] - route["outside_render_median_s"]
            )
            * 1000,
            "wall_added_ms_median": (own["median_s"] - route["median_s"]) * 1000,
            "extra_redis_cmds_per_job": own["redis_cmds_per_job"] - route["redis_cmds_per_job"],
            "extra_redis_by_command": {k: v for k, v in by_command.items() if abs(v) >= 0.05},
        }
    return out


def dialect_rows(job: dict[str, Any]) -> list[str]:
    """The rows under the per-job table: each dialect over kiln's route."""
    lines = []
    for name, diff in job.get("dialects", {}).items():
        lines.append(
            f"| {name} dialect - kiln's route | | {diff['wall_added_ms_median']:+.1f} ms | |"
            f" **{diff['outside_added_ms_median']:+.1f} ms** | |"
            f" **{diff['extra_redis_cmds_per_job']:+.1f}** |"
        )
    return lines


def dialect_notes(job: dict[str, Any]) -> list[str]:
    lines = []
    for name, diff in job.get("dialects", {}).items():
        by = ", ".join(
            f"{shared._cell(k)} {v:+.1f}" for k, v in diff["extra_redis_by_command"].items()
        )
        lines.append(
            f"The {name} dialect's Redis commands per job against kiln's route, by command: "
            + (by or "the same")
            + "."
        )
    if "a1111" not in job.get("dialects", {}):
        lines.append("The A1111 dialect (/sdapi/v1/txt2img) is not served by this gateway: no row.")
    return lines


# -- held: many OpenAI calls waiting on one gateway ---------------------------------------------


class ProcessSampler(threading.Thread):
    """The gateway process's threads and RSS every 0.05 s: the peak of each, and the samples."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        import psutil

        self.process = psutil.Process(pid)
        self.threads: list[int] = []
        self.rss: list[int] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            with contextlib.suppress(Exception):
                self.threads.append(self.process.num_threads())
                self.rss.append(self.process.memory_info().rss)
            self.halt.wait(0.05)

    def take(self) -> dict[str, Any]:
        """Peaks since the last take, then start afresh."""
        threads, rss = self.threads or [0], self.rss or [0]
        self.threads, self.rss = [], []
        return {"threads_peak": max(threads), "rss_peak_mb": max(rss) / 2**20}


async def held_call(port: int, token: str, body: bytes) -> tuple[int, bytes, float]:
    """One generation call on its own connection (Connection: close, so the answer ends at
    EOF): its status, body, and the time.perf_counter() it was answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        (
            f"POST {OPENAI} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        + body
    )
    await writer.drain()
    raw = await reader.read()
    answered = time.perf_counter()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    if b"transfer-encoding: chunked" in head.lower():
        payload = dechunk(payload)
    return status, payload, answered


def dechunk(raw: bytes) -> bytes:
    body = b""
    while raw:
        size_line, _, rest = raw.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        body, raw = body + rest[:size], rest[size + 2 :]
    return body


class Held:
    """One held run on one fresh gateway: the calls made while the worker is paused, a quiet
    window with only them waiting, a second with kiln's own SSE stream open on each of their
    jobs too (what the route a dialect is measured against costs a waiting client), then the
    worker resumed to render them all."""

    def __init__(
        self, args: argparse.Namespace, url: str, server: Any, worker: Any, token: str
    ) -> None:
        from redis import Redis

        from api_client.http.tokens import Tokens

        self.args, self.server, self.worker, self.token = args, server, worker, token
        self.conn = Redis.from_url(url)
        self.tokens = Tokens(self.conn)
        caller = self.tokens.caller(token)
        assert caller is not None
        self.caller = caller
        self.redis_port = shared.redis_tcp_port(url)
        self.procs = ProcessSampler(server.proc.pid)
        self.links = shared.Sampler(url, server.proc.pid, self.redis_port)
        self.stages: dict[str, Any] = {}
        self.watchers: list[Any] = []

    def connections(self) -> dict[str, Any]:
        return shared.gateway_connections(self.conn, self.server.proc.pid, self.redis_port)

    def run(self) -> list[tuple[int, bytes, float]]:
        self.procs.start()
        self.links.start()
        ready = self.connections()
        time.sleep(0.3)
        self.stages["ready"] = self.procs.take() | {"redis_connections": ready["client_list"]}
        os.kill(self.worker.pid, signal.SIGSTOP)
        try:
            answers = asyncio.run(self.calls())
        finally:
            os.kill(self.worker.pid, signal.SIGCONT)
        self.stages["rendering"] = self.procs.take() | {
            "seconds": time.perf_counter() - self.stages["rendering"].pop("resumed_at"),
            "redis_commands": own_commands(self.conn),
        }
        after = self.connections()
        for sampler in (self.procs, self.links):
            sampler.halt.set()
            sampler.join()
        self.stages["after"] = {
            "redis_connections": after["client_list"],
            "redis_connections_peak": self.links.peak["client_list"],
            "threads": self.procs.process.num_threads(),
        }
        return answers

    async def calls(self) -> list[tuple[int, bytes, float]]:
        """1. every call made at once; 2. a quiet window; 3. kiln's SSE stream on each job and
        a second window; 4. the worker resumed, every answer and every stream's end awaited."""
        args, loop = self.args, asyncio.get_running_loop()

        def body(n: int) -> bytes:
            made = {**shared.request(args.steps, 20_000 + n), "response_format": "b64_json"}
            return json.dumps(made).encode()

        port = self.server.port
        calls = asyncio.gather(*(held_call(port, self.token, body(n)) for n in range(args.held)))
        job_ids = await loop.run_in_executor(None, self.all_held)
        await loop.run_in_executor(None, self.quiet, "waiting")
        self.watchers = [shared.Watcher(job_id, port, self.token) for job_id in job_ids]
        burst = asyncio.Semaphore(args.connect_burst)
        await asyncio.gather(*(shared.open_watcher(w, port, burst) for w in self.watchers))
        await asyncio.sleep(0.5)  # each stream registers with the hub after its first event
        await loop.run_in_executor(None, self.quiet, "waiting_with_sse")
        self.stages["rendering"] = {"resumed_at": time.perf_counter()}
        self.conn.config_resetstat()
        os.kill(self.worker.pid, signal.SIGCONT)
        answers = await asyncio.wait_for(calls, timeout=args.held_timeout)
        await asyncio.wait([w.closed for w in self.watchers], timeout=60)
        return answers

    def all_held(self) -> list[str]:
        """Wait until every call's job is submitted and its call waits on its events; the
        stage's figures; the jobs' ids."""
        from api_client.http.tokens import OWNED_PREFIX

        began = time.perf_counter()
        self.conn.config_resetstat()
        deadline = began + self.args.held_timeout
        polls = 1
        while self.conn.zcard(OWNED_PREFIX + self.caller.id) < self.args.held:
            assert time.perf_counter() < deadline, "the held calls were not all submitted"
            time.sleep(0.05)
            polls += 1
        time.sleep(0.5)  # the last calls register with the event hub
        sent = own_commands(self.conn)
        sent["zcard"] = sent.get("zcard", 0) - polls  # this thread's own polls
        self.stages["opening"] = self.procs.take() | {
            "seconds": time.perf_counter() - began,
            "redis_commands": {k: v for k, v in sent.items() if v},
            "redis_connections_peak": dict(self.links.peak),
        }
        return self.tokens.recent_jobs(self.caller, self.args.held)

    def quiet(self, name: str) -> None:
        """--held-wait seconds with nothing but waiting: what the gateway sends Redis."""
        self.procs.take()
        self.conn.config_resetstat()
        time.sleep(self.args.held_wait)
        self.stages[name] = self.procs.take() | {
            "seconds": self.args.held_wait,
            "redis_commands": own_commands(self.conn),
            "redis_connections": self.connections(),
        }


def held(
    args: argparse.Namespace, url: str, env: dict[str, str], work: Path, worker: Any
) -> dict[str, Any]:
    """args.held OpenAI calls held on one fresh gateway while the worker is paused, then
    rendered; the gateway's Redis connections, threads, RSS and commands in each stage."""
    from redis import Redis

    from api_client import KilnClient
    from api_client.http.tokens import Tokens

    conn = Redis.from_url(url)
    name = f"bench-held-{os.getpid()}-{time.monotonic_ns()}"
    token = Tokens(conn).create(name, "jobs", max_queued=max(args.held, 1))
    with shared.gateway(env, work, "api-held") as server:
        run = Held(args, url, server, worker, token)
        answers = run.run()
        alive = server.proc.poll() is None
    found = check_held(args, KilnClient(connection=conn), run, answers)
    return found | {"gateway_alive_at_end": alive}


def own_commands(conn: Any) -> dict[str, int]:
    return {k: v for k, v in sorted(shared.commands(conn).items()) if v and k not in BENCH_OWN}


def check_held(
    args: argparse.Namespace, client: Any, run: Held, answers: list[tuple[int, bytes, float]]
) -> dict[str, Any]:
    """Every answer 200 with one image, the images those of the token's jobs' results; every
    SSE stream on the same jobs ended with its job's done event."""
    statuses: dict[int, int] = {}
    answered: set[str] = set()
    for status, payload, _at in answers:
        statuses[status] = statuses.get(status, 0) + 1
        if status == 200:
            data = json.loads(payload)["data"]
            answered |= {hashlib.sha256(base64.b64decode(d["b64_json"])).hexdigest() for d in data}
    ids = run.tokens.recent_jobs(run.caller, args.held)
    results = [client.job(job_id).result() for job_id in ids]
    rendered = {r.images[0].sha256 for r in results if r is not None}
    stages = run.stages
    alone, with_sse = (
        stages["waiting"]["redis_commands"],
        stages["waiting_with_sse"]["redis_commands"],
    )
    n = max(args.held, 1)
    return {
        "calls": args.held,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "answered_with_image": statuses.get(200, 0),
        "images_match_results": answered == rendered and len(rendered) == args.held,
        "jobs_rendered": sum(1 for r in results if r is not None),
        "sse_streams": len(run.watchers),
        "sse_streams_ended_done": sum(
            1 for w in run.watchers if w.ended and w.events and w.events[-1][1] == "done"
        ),
        "stages": stages,
        "wait_window_s": args.held_wait,
        "keepalive_s": held_keepalive_s(),
        "redis_cmds_per_call_waiting": sum(alone.values()) / n,
        "redis_cmds_per_sse_stream_waiting": (sum(with_sse.values()) - sum(alone.values())) / n,
        "redis_cmds_per_call_opening": sum(stages["opening"]["redis_commands"].values()) / n,
        "render_all_s": stages["rendering"]["seconds"],
        "renders_median_s": statistics.median(
            [r.timings.total for r in results if r is not None] or [0.0]
        ),
    }


def held_keepalive_s() -> float:
    from api_client.http import held as held_module

    return float(held_module.KEEPALIVE_S)


def held_table(found: dict[str, Any]) -> list[str]:
    stages = found["stages"]
    ready, opening, after = stages["ready"], stages["opening"], stages["after"]
    n, window = found["calls"], found["wait_window_s"]

    def cmds(stage: dict[str, Any]) -> str:
        shown = ", ".join(f"{shared._cell(k)} {v}" for k, v in stage["redis_commands"].items())
        return shown or "none"

    def row(name: str, stage: dict[str, Any], connections: str) -> str:
        return (
            f"| {name} | {stage['seconds']:.2f} | {stage['threads_peak']} |"
            f" {stage['rss_peak_mb']:.0f} | {connections} | {cmds(stage)} |"
        )

    waiting, with_sse = stages["waiting"], stages["waiting_with_sse"]
    return [
        f"### Held: {n} concurrent OpenAI generation calls on one `kiln api` process"
        " (rendered by the real worker, paused while they are made and wait)",
        "",
        "| stage | seconds | gateway threads (peak) | gateway RSS MB (peak) |"
        " gateway Redis connections | Redis commands (all senders) |",
        "|---|---|---|---|---|---|",
        f"| ready, no call | | {ready['threads_peak']} | {ready['rss_peak_mb']:.0f} |"
        f" {ready['redis_connections']} | |",
        row(
            f"{n} calls made and held (jobs submitted)",
            opening,
            f"{opening['redis_connections_peak']['client_list']} (peak)",
        ),
        row(
            f"all {n} waiting, worker paused",
            waiting,
            str(waiting["redis_connections"]["client_list"]),
        ),
        row(
            f"the same, and kiln's SSE stream open on each of the {n} jobs",
            with_sse,
            str(with_sse["redis_connections"]["client_list"]),
        ),
        row(
            "worker resumed: rendered and answered",
            stages["rendering"],
            f"{after['redis_connections']} (peak over the run {after['redis_connections_peak']})",
        ),
        "",
        f"Answered 200 with its image: {found['answered_with_image']} / {n}"
        f" (statuses {found['statuses']}; images equal to the jobs' results:"
        f" {found['images_match_results']}); kiln's SSE streams ended with done:"
        f" {found['sse_streams_ended_done']} / {found['sse_streams']}. Redis commands while"
        f" waiting {window:g} s (a keep-alive check every {found['keepalive_s']:g} s): per held"
        f" call {found['redis_cmds_per_call_waiting']:.2f}, per kiln SSE stream (the second"
        f" window less the first) {found['redis_cmds_per_sse_stream_waiting']:.2f}; per call"
        f" while being made (submit, tenancy, the catch-up reads):"
        f" {found['redis_cmds_per_call_opening']:.1f}. The {n} jobs rendered in"
        f" {found['render_all_s']:.1f} s ({found['renders_median_s'] * 1000:.0f} ms a job on"
        " the worker).",
    ]
