"""Whether one tenant can stall the gateway (issue 36 item 3): /healthz latency of a real `kiln api`
(on a private redis-server, a fresh admin token) idle, then while one client sends a JSON body of
400,000 unknown keys and three others upload a 15 MB PNG, each over and over (tests/fixtures/
stall.py, the load tests/test_api_loop.py asserts on). Prints a markdown table: p50, p90 and
max of --polls polls --pause s apart, and what the load's requests answered and took.

--tree runs the gateway from another checkout (e.g. `git archive HEAD | tar -x -C /tmp/old`) with
this venv, for a before and after on one machine.

    python bench/gateway_loop.py [--polls 20] [--pause 0.1] [--tree DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.api_bench import free_port, redis_server  # noqa: E402
from tests.fixtures.stall import UPLOAD_MB, WIDE_KEYS, Load, poll  # noqa: E402

READY_TIMEOUT_S = 60.0


def start_gateway(tree: Path, url: str, work: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """`kiln api` from tree on a free port, ready; (process, its URL, an admin token)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_REDIS_URL=url, KILN_MANIFESTS=str(tree / "manifests"), PYTHONUNBUFFERED="1")
    kiln = [sys.executable, "-m", "worker.cli"]
    made = subprocess.run(
        [*kiln, "api", "token", "create", "bench-loop", "--scope", "admin"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    token = made.stdout.strip().splitlines()[-1]
    port = free_port()
    with open(work / "api.log", "ab") as log:
        proc = subprocess.Popen(
            [*kiln, "api", "--port", str(port)], cwd=tree, env=env, stdout=log, stderr=log
        )
    gateway = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(gateway + "/readyz", timeout=2) as response:
                if response.status == 200:
                    return proc, gateway, token
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"kiln api did not start; see {work / 'api.log'}")
        time.sleep(0.05)


def row(phase: str, latencies: list[float]) -> str:
    p50 = statistics.median(latencies)
    p90 = statistics.quantiles(latencies, n=10, method="inclusive")[-1]
    ms = [f"{1000 * v:.1f}" for v in (p50, p90, max(latencies))]
    return f"| {phase} | {len(latencies)} | {' | '.join(ms)} |"


def answered(load: Load, what: str) -> str:
    mine = [(status, seconds) for kind, status, seconds in load.answers if kind == what]
    statuses = ", ".join(str(s) for s in sorted({status for status, _ in mine}))
    took = statistics.median(seconds for _, seconds in mine)
    return f"{len(mine)} answered ({statuses}), median {took:.2f} s each"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--polls", type=int, default=20, help="/healthz polls a phase")
    parser.add_argument("--pause", type=float, default=0.1, help="seconds between polls")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to run kiln api from")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-loop-") as tmp:
        work = Path(tmp)
        with redis_server(work, None) as url:
            proc, gateway, token = start_gateway(args.tree.resolve(), url, work)
            try:
                idle = poll(gateway, args.polls, args.pause)
                with Load(gateway, token) as load:
                    busy = poll(gateway, args.polls, args.pause)
            finally:
                proc.terminate()
                proc.wait(timeout=20)
    print(f"kiln api from {args.tree.resolve()}, {platform.node()}, {os.cpu_count()} cores\n")
    print("| /healthz | polls | p50 ms | p90 ms | max ms |")
    print("|---|---:|---:|---:|---:|")
    print(row("idle", idle))
    print(row(f"one {WIDE_KEYS:,}-key body + three {UPLOAD_MB} MB uploads", busy))
    print(f"\nwide body: {answered(load, 'wide')}; uploads: {answered(load, 'upload')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
