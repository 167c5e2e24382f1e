"""Model switches on a worker that keeps one pipeline on the device (KILN_MAX_RESIDENT=1), side
by side in one process (issue 18), from the records kiln writes:

1. a queue alternating two models (A, B, A, B...), the RAM cache off and on: load seconds per
   switch;
2. a queue that takes several models in turn, each new to the process, with and without reading
   the next job's model ahead (worker/pipelines/prefetch.py): load seconds per job, and the queue's
   wall time, since on a CPU the read competes with the render it overlaps.

    python bench/switches.py [--models tiny-sd15,tiny-flux] [--jobs 12]
        [--turns tiny-sd15,tiny-flux,...] [--steps 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-sd15,tiny-flux")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--turns", default=",".join(TURNS), help="models taken in turn, once each")
    parser.add_argument("--steps", type=int, default=8, help="steps of each job in the turns")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    from worker.pipelines.tiny import build_tiny_models

    build_tiny_models(ROOT / "models")
    models = args.models.split(",")
    sequence = [models[i % len(models)] for i in range(args.jobs)]
    rows = [run(sequence, ram_gb) for ram_gb in (0.0, 8.0)]
    print(
        "| KILN_RAM_CACHE_GB | loads from | load per switch, median (after the first two) | max |"
    )
    print("|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['ram_cache_gb']:g} | {', '.join(sorted(set(row['sources'][2:])))}"
            f" | {row['median_s']:.3f} s | {row['max_s']:.3f} s |"
        )
    turns = args.turns.split(",")
    run(turns, 0.0, steps=1)  # every family's classes imported and its files in the page cache
    ahead = [run(turns, 8.0, read_ahead=on, steps=args.steps) for on in (False, True)]
    print(f"\n{len(turns)} models in turn, each new, {args.steps} steps, KILN_RAM_CACHE_GB=8:\n")
    print("| read ahead | loads from | load per job, median (after the first) | queue wall time |")
    print("|---|---|---|---|")
    for row in ahead:
        sources = ", ".join(f"{s} {row['sources'][1:].count(s)}" for s in ("disk", "ram"))
        print(
            f"| {'on' if row['read_ahead'] else 'off'} | {sources}"
            f" | {statistics.median(row['loads_s'][1:]):.3f} s | {row['wall_s']:.2f} s |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows + ahead, indent=2) + "\n", encoding="utf-8")
    return 0


TURNS = ["tiny-sd15", "tiny-flux", "tiny-sdxl", "tiny-sd3", "tiny-flux2", "tiny-qwenimage"]


def run(
    sequence: list[str], ram_gb: float, read_ahead: bool = False, steps: int = 2
) -> dict[str, Any]:
    """The jobs of sequence in order on one renderer; read_ahead: its prefetcher is told the
    next job's model, as a queue worker's lanes tell it."""
    from api_client.schema import RenderRequest
    from bench.harness import tiny_settings
    from worker.manifest import load_manifests
    from worker.render.context import LocalContext
    from worker.render.renderer import Renderer
    from worker.render.timings import TimingRecord

    seen: list[TimingRecord] = []
    with tempfile.TemporaryDirectory() as out:
        settings = tiny_settings(
            Path(out),
            max_resident=1,
            ram_cache_gb=ram_gb,
            prefetch="on" if read_ahead else "off",  # auto would not read ahead on a CPU
        )
        renderer = Renderer(
            settings,
            load_manifests(settings.manifests, sorted(set(sequence))),
            on_record=seen.append,
        )
        started = time.perf_counter()
        for i, model in enumerate(sequence):
            upcoming = sequence[i + 1] if i + 1 < len(sequence) else None
            renderer.prefetcher.upcoming = (lambda m=upcoming: m) if read_ahead else None
            request = RenderRequest(model=model, prompt="a fox", steps=steps, seed=1)
            renderer.render(request.model_dump(exclude_none=True), LocalContext(job_id=f"j{i}"))
        wall = time.perf_counter() - started
    # After the first two (both cold); a sequence of two or fewer: all of them.
    loads = [r.timings.load for r in seen[2:]] or [r.timings.load for r in seen]
    return {
        "ram_cache_gb": ram_gb,
        "read_ahead": read_ahead,
        "sources": [r.load_source for r in seen],
        "loads_s": [r.timings.load for r in seen],
        "median_s": statistics.median(loads),
        "max_s": max(loads),
        "wall_s": wall,
    }


if __name__ == "__main__":
    sys.exit(main())
