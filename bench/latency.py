"""Where a queued job's wall time goes, outside the render: submit, until the worker started it,
the render (started -> result), result -> the end event, end event -> the client's wait()
returning. One real `kiln worker`, one job in flight, medians.

    python bench/latency.py [--jobs 15] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "tiny-sd15"
SPANS = ("submit", "to_started", "render", "result_to_end_event", "end_event_to_client", "total")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=15)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    from api_client import KilnClient
    from bench.harness import private_redis, running_worker

    work = Path(tempfile.mkdtemp(prefix="kiln-latency-"))
    rows = []
    with private_redis(work) as url, running_worker(work, MODEL, url):
        client = KilnClient(url, manifests_dir=ROOT / "manifests")
        request = {"model": MODEL, "prompt": "latency", "steps": args.steps}
        for seed in range(3):
            client.submit({**request, "seed": seed}).wait(120)
        for seed in range(args.jobs):
            t0 = time.time()
            job = client.submit({**request, "seed": seed})
            t1 = time.time()
            result = job.wait(120)
            t2 = time.time()
            at = {event.kind: event.at for event in job.events(timeout=1)}
            done = result.finished_at.timestamp()
            rows.append(
                (
                    t1 - t0,
                    at["started"] - t0,
                    done - at["started"],
                    at["done"] - done,
                    t2 - at["done"],
                    t2 - t0,
                )
            )
    print(f"{MODEL}, {args.steps} steps, {args.jobs} jobs one at a time; medians")
    for index, name in enumerate(SPANS):
        print(f"{name:<22} {statistics.median(r[index] for r in rows) * 1000:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
