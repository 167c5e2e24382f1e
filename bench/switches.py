"""A queue alternating two models (A, B, A, B...) on a worker that keeps one pipeline on the
device (KILN_MAX_RESIDENT=1), with the RAM cache off and on, side by side in one process
(issue 18): load seconds per job, from the records kiln writes.

    python bench/switches.py [--models tiny-sd15,tiny-flux] [--jobs 12] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-sd15,tiny-flux")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    from worker.tiny import build_tiny_models

    build_tiny_models(ROOT / "models")
    models = args.models.split(",")
    rows = [run(models, args.jobs, ram_gb) for ram_gb in (0.0, 8.0)]
    print(
        "| KILN_RAM_CACHE_GB | loads from | load per switch, median (after the first two) | max |"
    )
    print("|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['ram_cache_gb']:g} | {', '.join(sorted(set(row['sources'][2:])))}"
            f" | {row['median_s']:.3f} s | {row['max_s']:.3f} s |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


def run(models: list[str], jobs: int, ram_gb: float) -> dict[str, Any]:
    from api_client.schema import RenderRequest
    from worker.context import LocalContext
    from worker.manifest import load_manifests
    from worker.render import Renderer
    from worker.settings import Settings
    from worker.timings import TimingRecord

    seen: list[TimingRecord] = []
    with tempfile.TemporaryDirectory() as out:
        settings = Settings(
            models_dir=ROOT / "models",
            manifests=ROOT / "manifests",
            output_dir=Path(out),
            timings_log=Path(out) / "timings.jsonl",
            max_resident=1,
            ram_cache_gb=ram_gb,
        )
        renderer = Renderer(
            settings, load_manifests(settings.manifests, models), on_record=seen.append
        )
        for i in range(jobs):
            request = RenderRequest(model=models[i % len(models)], prompt="a fox", steps=2, seed=1)
            renderer.render(request.model_dump(exclude_none=True), LocalContext(job_id=f"j{i}"))
    loads = [r.timings.load for r in seen[2:]]
    return {
        "ram_cache_gb": ram_gb,
        "sources": [r.load_source for r in seen],
        "loads_s": [r.timings.load for r in seen],
        "median_s": statistics.median(loads),
        "max_s": max(loads),
    }


if __name__ == "__main__":
    sys.exit(main())
