"""Step time at the partial rung against full, model_offload and group_offload (issue 18 item 2),
per tiny model, from the records kiln writes: each rung pinned (KILN_MEMORY_MODE), partial under
a KILN_VRAM_BUDGET_GB that keeps about half the denoiser's blocks resident. On a CPU the onload
device is the CPU: offload saves no memory and streaming a block is a copy in host RAM, so these
numbers show what each rung's hooks cost, not what a card's bus would.

    python bench/partial.py [--models tiny-sd15,tiny-sdxl,tiny-flux] [--jobs 6] [--steps 8]
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

RUNGS = ("full", "partial", "model_offload", "group_offload")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-sd15,tiny-sdxl,tiny-flux")
    parser.add_argument("--jobs", type=int, default=6, help="per rung; the first (cold) is dropped")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    from worker.pipelines.tiny import build_tiny_models

    build_tiny_models(ROOT / "models")
    rows = [
        run(m, r, args.jobs, args.steps, args.size) for m in args.models.split(",") for r in RUNGS
    ]
    print("| model | rung | blocks resident / streamed | per step, median | p90 | vs full |")
    print("|---|---|---|---|---|---|")
    full = {row["model"]: row["median_s"] for row in rows if row["rung"] == "full"}
    for row in rows:
        split = row["split"] or "-"
        ratio = row["median_s"] / full[row["model"]]
        print(
            f"| {row['model']} | {row['rung']} | {split} | {row['median_s'] * 1000:.1f} ms"
            f" | {row['p90_s'] * 1000:.1f} ms | {ratio:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


def half_budget(model: str) -> float:
    """A budget keeping the first half of the denoiser's blocks resident (worker.memory.partial's
    rule)."""
    import diffusers

    from worker.manifest import load_manifests
    from worker.memory.ladder import GB, rung_need_gb
    from worker.memory.partial import MARGIN, denoiser_blocks, module_bytes
    from worker.pipelines.families import spec_of

    manifest = load_manifests(ROOT / "manifests", [model])[model]
    spec = spec_of(manifest.family)
    pipe = getattr(diffusers, spec.pipeline_class).from_pretrained(ROOT / "models" / model)
    sizes = [module_bytes(b) for b in denoiser_blocks(getattr(pipe, spec.denoiser))]
    others = rung_need_gb(manifest, "full") - sum(sizes) / GB
    kept = sum(sizes[: len(sizes) // 2]) + sizes[len(sizes) // 2] / 2
    return others + kept * (1 + MARGIN) / GB


def run(model: str, rung: str, jobs: int, steps: int, size: int) -> dict[str, Any]:
    from bench.harness import tiny_settings
    from worker.manifest import load_manifests
    from worker.render.context import LocalContext
    from worker.render.renderer import Renderer
    from worker.render.timings import TimingRecord

    seen: list[TimingRecord] = []
    budget = half_budget(model) if rung == "partial" else None
    with tempfile.TemporaryDirectory() as out:
        settings = tiny_settings(
            Path(out),
            memory_mode=rung,
            vram_budget_gb=budget,
            vram_reserve_gb=0.0,
        )
        renderer = Renderer(
            settings, load_manifests(settings.manifests, [model]), on_record=seen.append
        )
        for i in range(jobs):
            job = {"model": model, "prompt": "a bench", "steps": steps, "seed": i}
            job.update(width=size, height=size)
            renderer.render(job, LocalContext(f"{model}-{rung}-{i}"))
    warm = [r.per_step_s or 0.0 for r in seen[1:]]
    split = seen[-1].partial_blocks
    return {
        "model": model,
        "rung": rung,
        "budget_gb": budget,
        "split": f"{split.resident} / {split.streamed}" if split else None,
        "median_s": statistics.median(warm),
        "p90_s": statistics.quantiles(warm, n=10)[-1] if len(warm) > 1 else warm[0],
        "steps": steps,
        "size": size,
    }


if __name__ == "__main__":
    raise SystemExit(main())
