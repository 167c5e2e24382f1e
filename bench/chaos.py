"""Chaos: N jobs over two or more real `kiln worker` processes and a real Redis, under faults at
random instants from a seeded schedule, then one line saying whether every job ended exactly once
and every end reached its webhook.

    python bench/chaos.py [--jobs N] [--faults N] [--seed S] [--workers W] [--seconds T]
                          [--models-dir DIR] [--deadline-s D] [--keep] [--verbose]

It starts everything it breaks: its own redis-server (AOF on, appendfsync everysec, a free port,
a temp dir; KILN_REDIS_URL is ignored), W workers serving tiny-sd15 (128 px, 2 steps) with a
webhook target, and a live Standard Webhooks receiver (every delivery checked with
api_client.verify_webhook). Jobs are submitted through KilnClient over the first T seconds, each
naming the target; the faults fall in the same T seconds, their kinds dealt in turn (so every
kind appears once there are four) and shuffled by the seed:

    sigkill   SIGKILL one worker (one that is rendering, if any is); a replacement starts at once
    sigstop   SIGSTOP one worker (the same choice) for longer than a lease (the worker's own
              heartbeat TTL plus half to two sweep intervals, read from KilnWorker), then SIGCONT
    redis     SHUTDOWN (the AOF is flushed), a pause, redis-server again on the same port and dir
    receiver  the receiver answers 503, or holds each request unanswered, for 2-15 s

The seed fixes the schedule (instants, kinds, drawn slots, lengths), not the operating system's
timing, so two runs with one seed inject the same faults and may still interleave differently.
Then it waits until every job has an end and every end's webhook arrived (or --deadline-s after
the schedule), and prints, last:

    jobs=N finished=N failed=N lost=N twice=N webhooks_missing=N webhooks_duplicated=N

failed: ended failed with a reason; lost: no end when the run stops; twice: more than one
committed end (RQ results stream, the job's terminal events) or more than one done timing record
(the workers' KILN_TIMINGS_LOG files); webhooks_missing: an ended job no delivery of whose end
arrived; webhooks_duplicated: a job with more than one distinct end webhook-id (the same id
delivered again is at-least-once, counted as redelivered in the summary above the line). Exit 1
when lost, twice or webhooks_missing is not 0; the summary then shows each such job's keys.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import heapq
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redis import Redis  # noqa: E402
from redis.exceptions import RedisError  # noqa: E402

MODEL = "tiny-sd15"
REQUEST = {"model": MODEL, "steps": 2, "width": 128, "height": 128}
TARGET = "chaos"
SECRET = "whsec_" + base64.b64encode(b"kiln-chaos-receiver-secret-0123").decode()
KINDS = ("sigkill", "sigstop", "redis", "receiver")
ENDED = {"finished": "done", "failed": "failed", "stopped": "stopped", "canceled": "stopped"}
# RQ's results stream: the entry types that are an end (RETRIED and the rest are not).
END_RESULTS = {"1", "2", "3"}
STARTUP_S = 120.0  # a worker's import and first load on a busy shared machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="worker slots (at least 2)")
    parser.add_argument(
        "--seconds", type=float, help="submissions and faults spread over this long (5 s a fault)"
    )
    parser.add_argument("--models-dir", type=Path, help="tiny models (built in models/ if unset)")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="wait after the schedule")
    parser.add_argument("--keep", action="store_true", help="keep the run's temp dir")
    parser.add_argument("--verbose", action="store_true", help="log every fault as it happens")
    args = parser.parse_args(argv)
    if args.workers < 2 or args.jobs < 1 or args.faults < 0:
        parser.error("--workers must be at least 2, --jobs at least 1, --faults at least 0")
    seconds = args.seconds or max(30.0, 5.0 * args.faults)
    models_dir = args.models_dir or _build_models(ROOT / "models")
    work = Path(tempfile.mkdtemp(prefix="kiln-chaos-"))
    run = Run(args, seconds, models_dir, work)
    try:
        code = run.go()
    finally:
        run.close()
        if args.keep or run.failed_check:
            print(f"chaos: logs, AOF and timings kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return code


def _build_models(directory: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "worker.cli", "tiny-models", str(directory)], cwd=ROOT, check=True
    )
    return directory


def worker_timings() -> dict[str, float]:
    """The lease and sweep as the worker has them (the settings: KILN_LEASE_S, KILN_SWEEP_S),
    read in a child so this process never imports torch."""
    code = (
        "import json; from worker.settings import Settings; s = Settings();"
        " print(json.dumps({'ttl': s.lease_s, 'sweep': s.sweep_s}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True
    )
    return {k: float(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"chaos: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)
    return value


@dataclass(order=True)
class Fault:
    at: float
    kind: str = field(compare=False)
    slot: int = field(compare=False)  # sigkill, sigstop: the victim's slot
    length_s: float = field(compare=False)  # sigstop, receiver: how long; redis: the pause
    mode: str = field(compare=False)  # receiver: "503" or "hang"


def schedule(
    seed: int, faults: int, seconds: float, workers: int, ttl: float, sweep: float
) -> list[Fault]:
    """The faults of a run, in order: the same seed gives the same list."""
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(faults)]
    rng.shuffle(kinds)
    out: list[Fault] = []
    for kind in kinds:
        at = rng.uniform(0, seconds)
        slot = rng.randrange(workers)
        if kind == "sigstop":
            length = ttl + rng.uniform(sweep / 2, 2 * sweep)
        elif kind == "receiver":
            length = rng.uniform(2, 15)
        else:
            length = rng.uniform(0.5, 3)
        out.append(Fault(at, kind, slot, length, rng.choice(("503", "hang"))))
    return sorted(out)


class RedisProcess:
    """redis-server with AOF on, restartable on the same port and directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port)]
        argv += ["--dir", str(self.directory), "--save", "", "--appendonly", "yes"]
        argv += ["--appendfsync", "everysec", "--maxmemory-policy", "noeviction"]
        with open(self.directory / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._answers, 30, f"redis-server on port {self.port}")

    def _answers(self) -> bool:
        try:
            return bool(Redis(port=self.port, socket_connect_timeout=1).ping())
        except (RedisError, OSError):
            return False

    def shutdown(self) -> None:
        """SHUTDOWN: Redis flushes its AOF and exits; nothing it acknowledged is lost."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(RedisError):  # the connection closes under the reply
            Redis(port=self.port, socket_timeout=10).shutdown()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self, pause_s: float) -> None:
        self.shutdown()
        time.sleep(pause_s)
        self.start()
        self.restarts += 1


@dataclass
class Delivery:
    webhook_id: str
    job_id: str
    kind: str


class Receiver:
    """A Standard Webhooks receiver that can be made to fail: 503 to every request, or hold
    each one unanswered, until its outage ends. Only verified deliveries it answered 204 count."""

    def __init__(self) -> None:
        self.port = free_port()
        self.lock = threading.Lock()
        self.delivered: list[Delivery] = []
        self.invalid: list[str] = []
        self.refused = 0
        self.mode = "up"
        self.recovered = threading.Event()
        self.recovered.set()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/kiln-hook"

    def start(self) -> None:
        self.thread.start()

    def outage(self, mode: str) -> None:
        self.mode = mode
        self.recovered.clear()

    def recover(self) -> None:
        self.mode = "up"
        self.recovered.set()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if receiver.mode == "hang":
                    receiver.recovered.wait(60)
                    self.close_connection = True
                    return  # no answer at all: the sender's timeout or a closed socket
                if receiver.mode == "503":
                    with receiver.lock:
                        receiver.refused += 1
                    self.send_response(503)
                    self.end_headers()
                    return
                receiver.accept(body, dict(self.headers.items()))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return None

        return Handler

    def accept(self, body: bytes, headers: dict[str, str]) -> None:
        from api_client.webhooks import WebhookInvalid, verify_webhook

        try:
            event = verify_webhook(SECRET, body, headers)
        except WebhookInvalid as exc:
            with self.lock:
                self.invalid.append(str(exc))
            return
        webhook_id = {k.lower(): v for k, v in headers.items()}["webhook-id"]
        with self.lock:
            self.delivered.append(Delivery(webhook_id, event.job_id, event.kind))

    def stop(self) -> None:
        self.recover()
        self.server.shutdown()
        self.server.server_close()


class Worker:
    """One `kiln worker` process in a slot; a SIGKILLed one is replaced by a new process."""

    def __init__(self, name: str, env: dict[str, str], work: Path) -> None:
        self.name = name
        self.timings = work / "timings" / f"{name}.jsonl"
        log = work / "logs" / f"{name}.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker.cli", "worker", "--name", name],
                env={**env, "KILN_TIMINGS_LOG": str(self.timings)},
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.stopped_until = 0.0  # monotonic time of its SIGCONT, while SIGSTOPped

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, sig: signal.Signals) -> None:
        if self.alive():
            self.proc.send_signal(sig)


class Run:
    def __init__(self, args: argparse.Namespace, seconds: float, models: Path, work: Path) -> None:
        self.args = args
        self.seconds = seconds
        self.work = work
        for sub in ("redis", "logs", "timings", "out"):
            (work / sub).mkdir()
        self.redis = RedisProcess(work / "redis")
        self.receiver = Receiver()
        self.env = self._worker_env(models)
        self.slots: list[Worker] = []
        self.retired: list[Worker] = []
        self.spawned = 0
        self.done_faults: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.mid_render: Counter[str] = Counter()  # sigkill, sigstop of a worker running a job
        self.unexpected_exits = 0
        self.job_ids = [f"chaos-{args.seed}-{i}" for i in range(args.jobs)]
        self.submitted: list[str] = []
        self.failed_check = False

    def _worker_env(self, models: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        env.update(
            KILN_REDIS_URL=self.redis.url,
            KILN_MODELS=MODEL,
            KILN_MODELS_DIR=str(models),
            KILN_MANIFESTS=str(ROOT / "manifests"),
            KILN_OUTPUT_DIR=str(self.work / "out"),
            KILN_INDUCTOR_CACHE_DIR=str(self.work / "inductor"),
            KILN_WEBHOOKS=json.dumps({TARGET: {"url": self.receiver.url, "secret": SECRET}}),
            # The schedule shortened, never the rule: a receiver outage here lasts seconds, not
            # a deploy's minutes, so tries come seconds apart (the default's first gap is 5 s).
            KILN_WEBHOOK_RETRIES=os.environ.get("KILN_WEBHOOK_RETRIES", "1,2,4,8,15,30,60"),
            KILN_LOG_FORMAT="json",
            HF_HUB_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        env.setdefault("OMP_NUM_THREADS", "1")  # W workers share the cores; no oversubscription
        return env

    def say(self, message: str) -> None:
        if self.args.verbose:
            print(f"[{time.monotonic() - self.t0:7.1f} s] {message}", flush=True)

    def spawn(self, slot: int) -> Worker:
        self.spawned += 1
        worker = Worker(f"chaos-w{slot}-{self.spawned}", self.env, self.work)
        if slot < len(self.slots):
            self.retired.append(self.slots[slot])
            self.slots[slot] = worker
        else:
            self.slots.append(worker)
        return worker

    def go(self) -> int:
        timing = worker_timings()
        faults = schedule(
            self.args.seed,
            self.args.faults,
            self.seconds,
            self.args.workers,
            timing["ttl"],
            timing["sweep"],
        )
        self.redis.start()
        self.receiver.start()
        self.t0 = time.monotonic()
        for slot in range(self.args.workers):
            self.spawn(slot)
        conn = Redis.from_url(self.redis.url, socket_timeout=10)
        wait_until(lambda: self._any_ready(conn), STARTUP_S, "a worker to publish its state")
        self.say(f"workers up; lease {timing['ttl']:g} s, sweep {timing['sweep']:g} s")
        started = time.monotonic()
        self._play(faults, started)
        self.say("schedule over; waiting for every end and its webhook")
        self._wait_for_ends(conn, time.monotonic() + self.args.deadline_s)
        elapsed = time.monotonic() - started
        return self._report(conn, elapsed, timing)

    def _any_ready(self, conn: Redis) -> bool:
        from api_client import keys

        return any(conn.exists(keys.worker_key(w.name)) for w in self.slots)

    def _play(self, faults: list[Fault], started: float) -> None:
        """Submissions evenly over the run's seconds and the faults at their instants, in one
        timeline; a fault's end (SIGCONT, the receiver back) is an action of its own."""
        rng = random.Random(self.args.seed + 1)
        actions: list[tuple[float, int, Callable[[], None]]] = []
        step = self.seconds / self.args.jobs
        for i, job_id in enumerate(self.job_ids):
            at = i * step + rng.uniform(0, step)
            actions.append((at, len(actions), lambda j=job_id, n=i: self._submit(j, n)))
        for fault in faults:
            actions.append((fault.at, len(actions), lambda f=fault: self._fault(f, actions)))
        heapq.heapify(actions)
        while actions:
            at, _, action = heapq.heappop(actions)
            self._respawn_exited()
            delay = started + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            action()

    def _submit(self, job_id: str, n: int) -> None:
        """Through KilnClient; a Redis that is restarting is waited for and the same job id sent
        again (a job id submitted twice renders once)."""
        from api_client import KilnClient

        deadline = time.monotonic() + 60
        while True:
            try:
                client = KilnClient(
                    connection=Redis.from_url(self.redis.url, socket_timeout=10),
                    manifests_dir=ROOT / "manifests",
                )
                client.submit(
                    {**REQUEST, "prompt": f"chaos {n}", "seed": n, "webhook": TARGET},
                    job_id=job_id,
                )
                client.connection.close()
                self.submitted.append(job_id)
                return
            except (RedisError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _fault(self, fault: Fault, actions: list[tuple[float, int, Callable[[], None]]]) -> None:
        if fault.kind == "redis":
            self.say(f"redis: SHUTDOWN, {fault.length_s:.1f} s down")
            self.redis.restart(fault.length_s)
        elif fault.kind == "receiver":
            self.say(f"receiver: {fault.mode} for {fault.length_s:.1f} s")
            self.receiver.outage(fault.mode)
            end = fault.at + fault.length_s
            heapq.heappush(actions, (end, 10**9 + len(actions), self.receiver.recover))
        else:
            worker = self._victim(fault.slot, fault.kind)
            if worker is None:
                self.skipped[fault.kind] += 1
                return
            if fault.kind == "sigkill":
                self.say(f"SIGKILL {worker.name}")
                worker.send(signal.SIGKILL)
                worker.proc.wait()
                self.spawn(self.slots.index(worker))
            else:
                self.say(f"SIGSTOP {worker.name} for {fault.length_s:.1f} s")
                worker.send(signal.SIGSTOP)
                worker.stopped_until = time.monotonic() + fault.length_s
                end = fault.at + fault.length_s
                heapq.heappush(actions, (end, 10**9 + len(actions), lambda: self._cont(worker)))
        self.done_faults[fault.kind] += 1

    def _busy(self) -> set[str]:
        """The workers a job's hash names as running it now (RQ's worker_name)."""
        try:
            conn = Redis.from_url(self.redis.url, socket_timeout=5)
            with conn.pipeline(transaction=False) as pipe:
                for job_id in self.submitted:
                    pipe.hmget(f"rq:job:{job_id}", ["status", "worker_name"])
                rows = pipe.execute()
            conn.close()
        except RedisError:
            return set()
        return {name.decode() for status, name in rows if status == b"started" and name}

    def _victim(self, slot: int, kind: str) -> Worker | None:
        """A worker that is running a job if any is (so a kill or a stop lands mid-render more
        often than the fleet's load alone would make it), else any live one; among equals the
        drawn slot first. A sigstop skips a worker already stopped (it would overlap itself)."""
        order = [self.slots[(slot + k) % len(self.slots)] for k in range(len(self.slots))]
        fit = [w for w in order if w.alive() and (kind == "sigkill" or w.stopped_until == 0.0)]
        busy = self._busy()
        hits = [w for w in fit if w.name in busy]
        if hits:
            self.mid_render[kind] += 1
            return hits[0]
        return fit[0] if fit else None

    def _cont(self, worker: Worker) -> None:
        self.say(f"SIGCONT {worker.name}")
        worker.send(signal.SIGCONT)
        worker.stopped_until = 0.0

    def _respawn_exited(self) -> None:
        for slot, worker in enumerate(self.slots):
            if not worker.alive():
                self.unexpected_exits += 1
                self.say(f"{worker.name} exited by itself ({worker.proc.returncode}); replaced")
                self.spawn(slot)

    def _wait_for_ends(self, conn: Redis, deadline: float) -> None:
        for worker in self.slots:
            if worker.stopped_until:
                self._cont(worker)
        while time.monotonic() < deadline:
            self._respawn_exited()
            try:
                ends = self._ends(conn)
            except RedisError:
                time.sleep(0.5)
                continue
            arrived = self._arrived()
            if len(ends) == len(self.submitted) and all(
                kind in arrived.get(job_id, {}) for job_id, kind in ends.items()
            ):
                time.sleep(2.0)  # what a late duplicate would need to show itself
                return
            time.sleep(0.5)

    def _ends(self, conn: Redis) -> dict[str, str]:
        """Each ended job's end kind (done, failed, stopped), from its RQ status."""
        pipe = conn.pipeline(transaction=False)
        for job_id in self.submitted:
            pipe.hget(f"rq:job:{job_id}", "status")
        statuses = pipe.execute()
        return {
            job_id: ENDED[status.decode()]
            for job_id, status in zip(self.submitted, statuses, strict=True)
            if status is not None and status.decode() in ENDED
        }

    def _arrived(self) -> dict[str, dict[str, set[str]]]:
        """Per job: end kind -> the distinct webhook-ids delivered for it."""
        arrived: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        with self.receiver.lock:
            for d in self.receiver.delivered:
                arrived[d.job_id][d.kind].add(d.webhook_id)
        return arrived

    def _done_records(self) -> Counter[str]:
        records: Counter[str] = Counter()
        for worker in [*self.retired, *self.slots]:
            if not worker.timings.exists():
                continue
            for line in worker.timings.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut by SIGKILL
                if record.get("event") == "job_timing" and record.get("status") == "done":
                    records[record.get("job_id")] += 1
        return records

    def _committed(self, conn: Redis, job_id: str) -> tuple[int, int, str | None]:
        """Ends in RQ's results stream, terminal events in the job's stream, and the last
        terminal event's error."""
        results = conn.xrange(f"rq:results:{job_id}")
        ended = sum(fields.get(b"type", b"").decode() in END_RESULTS for _, fields in results)
        terminal = 0
        error = None
        for _, fields in conn.xrange(f"kiln:events:{job_id}"):
            for value in fields.values():
                try:
                    event = json.loads(value)
                except ValueError:
                    continue
                if isinstance(event, dict) and event.get("kind") in ("done", "failed", "stopped"):
                    terminal += 1
                    error = event.get("error")
        return ended, terminal, error

    def _report(self, conn: Redis, elapsed: float, timing: dict[str, float]) -> int:
        ends = wait_until(lambda: self._safe(lambda: self._ends(conn)), 60, "Redis to answer")
        arrived = self._arrived()
        records = self._done_records()
        twice, failed, missing, duplicated, reasons = [], [], [], [], Counter[str]()
        for job_id in self.submitted:
            results, terminal, error = self._committed(conn, job_id)
            if results > 1 or terminal > 1 or records[job_id] > 1:
                twice.append(
                    f"{job_id} (results {results}, ends {terminal}, done records {records[job_id]})"
                )
            kind = ends.get(job_id)
            if kind == "failed":
                failed.append(job_id)
                reasons[error or "no reason given"] += 1
            if kind is not None and kind not in arrived.get(job_id, {}):
                missing.append(job_id)
            ids = set().union(*arrived.get(job_id, {}).values()) if job_id in arrived else set()
            if len(ids) > 1:
                duplicated.append(job_id)
        lost = [j for j in self.job_ids if j not in ends]
        finished = sum(kind == "done" for kind in ends.values())
        with self.receiver.lock:
            deliveries = Counter((d.job_id, d.webhook_id) for d in self.receiver.delivered)
            invalid, refused = len(self.receiver.invalid), self.receiver.refused
        redelivered = sum(n - 1 for n in deliveries.values())
        print(
            f"chaos: seed {self.args.seed}, {len(self.submitted)} jobs over {self.seconds:.0f} s,"
            f" {elapsed:.0f} s to the last end; {self.args.workers} workers ({self.spawned}"
            f" started, {self.unexpected_exits} exited by themselves); lease"
            f" {timing['ttl']:g} s"
        )
        print(
            "chaos: faults "
            + ", ".join(f"{k} {self.done_faults[k]}" for k in KINDS)
            + f" (mid-render: sigkill {self.mid_render['sigkill']},"
            f" sigstop {self.mid_render['sigstop']})"
            + (f" (skipped: {dict(self.skipped)})" if self.skipped else "")
            + f"; redis restarts {self.redis.restarts}"
        )
        print(
            f"chaos: webhooks {sum(deliveries.values())} accepted, {redelivered} redelivered"
            f" (same webhook-id again), {refused} answered 503, {invalid} failed verification"
        )
        for reason, count in reasons.most_common():
            print(f"chaos: failed x{count}: {reason}")
        for job_id in twice:
            print(f"chaos: twice: {job_id}")
        for job_id in lost + missing:
            print(
                f"chaos: {'lost' if job_id in lost else 'webhook missing'}: {job_id}:"
                f" {self._keys_of(conn, job_id)}"
            )
        print(
            f"jobs={len(self.job_ids)} finished={finished} failed={len(failed)} lost={len(lost)}"
            f" twice={len(twice)} webhooks_missing={len(missing)}"
            f" webhooks_duplicated={len(duplicated)}",
            flush=True,
        )
        self.failed_check = bool(lost or twice or missing)
        return 1 if self.failed_check else 0

    def _safe(self, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except RedisError:
            return None

    def _keys_of(self, conn: Redis, job_id: str) -> str:
        """What Redis holds for a job that went wrong: its hash's status and times, the queues
        and registries that name it, its event kinds and results."""
        fields = conn.hmget(
            f"rq:job:{job_id}", ["status", "origin", "enqueued_at", "started_at", "ended_at"]
        )
        names = ("status", "origin", "enqueued_at", "started_at", "ended_at")
        found = {n: v.decode() for n, v in zip(names, fields, strict=True) if v is not None}
        where = []
        for key in conn.scan_iter("rq:*", count=1000):
            name = key.decode()
            kind = conn.type(key).decode()
            members = conn.lrange(key, 0, -1) if kind == "list" else []
            members += conn.zrange(key, 0, -1) if kind == "zset" else []
            if any(m.decode().split(":")[0] == job_id for m in members):
                where.append(name)
        events = [
            json.loads(v).get("kind", "?")
            for _, f in conn.xrange(f"kiln:events:{job_id}")
            for v in f.values()
            if v.startswith(b"{")
        ]
        results = [f.get(b"type", b"?").decode() for _, f in conn.xrange(f"rq:results:{job_id}")]
        return json.dumps({"hash": found, "in": where, "events": events, "results": results})

    def close(self) -> None:
        for worker in self.slots:
            worker.send(signal.SIGCONT)
            worker.send(signal.SIGKILL)
        for worker in [*self.slots, *self.retired]:
            if worker.proc.poll() is None:
                worker.proc.wait(timeout=30)
        self.redis.shutdown()
        self.receiver.stop()


if __name__ == "__main__":
    sys.exit(main())
