"""How good job.eta() is: a real `kiln worker` warms up on mixed step counts (so its fit has a
line to draw), then a burst of jobs with random step counts is queued at once; each job's ETA
at submit is compared with when its result really arrived.

    python bench/eta.py [--jobs 12] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "tiny-sd15"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from api_client import KilnClient
    from bench.harness import private_redis, running_worker

    work = Path(tempfile.mkdtemp(prefix="kiln-eta-"))
    with private_redis(work) as url, running_worker(work, MODEL, url):
        client = KilnClient(url, manifests_dir=ROOT / "manifests")
        for steps in (2, 2, 8, 4, 16, 8, 2, 16):  # the first is cold and not fitted
            client.submit({"model": MODEL, "prompt": "fit", "steps": steps}).wait(120)
        rng = random.Random(args.seed)
        jobs = []
        for _ in range(args.jobs):
            steps = rng.choice((2, 4, 8, 12, 16, 24))
            job = client.submit({"model": MODEL, "prompt": "eta", "steps": steps})
            jobs.append((job, steps, time.time(), job.eta()))
        rows = []
        for job, steps, submitted, eta in jobs:
            result = job.wait(300)
            rows.append((steps, eta, result.finished_at.timestamp() - submitted))
    print(f"{'steps':>5} {'eta s':>7} {'actual s':>8} {'error':>7}")
    errors = []
    for steps, eta, actual in rows:
        error = (eta - actual) / actual if eta is not None else float("nan")
        errors.append(abs(error))
        print(f"{steps:>5} {eta or 0:>7.2f} {actual:>8.2f} {error:>+7.1%}")
    print(
        f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}"
        f" over {len(rows)} jobs queued at once"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
