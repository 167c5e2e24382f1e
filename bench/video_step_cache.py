"""The video families' step caches, measured: each video model rendered with and without its
manifest's step_cache at the same seeds, side by side through kiln's own renderer on one resident
pipeline. Per model: denoise seconds uncached and cached, steps computed and reused, and how far
the cached video's frames are from the uncached ones (PSNR, mean absolute difference per channel).

    python bench/video_step_cache.py                       # tiny-wan, tiny-ltx: 20 steps, 9 frames
    python bench/video_step_cache.py --models wan2.2-ti2v-5b --models-dir /models --frames 121

The tiny models have random weights: their frames are noise, so the distances say nothing about
quality, only that the cache ran and by how much it moved the result. Both videos go through the
same lossy encode (mp4), so a distance includes a little of the codec's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.step_cache import PROMPTS, psnr  # noqa: E402


@dataclass
class Pair:
    """One prompt at one seed, uncached then cached."""

    seed: int
    plain_denoise_s: float
    cached_denoise_s: float
    steps_computed: int
    steps_reused: int
    psnr_db: float
    mean_abs_diff: float  # per channel, 0-255


def video_frames(path: str) -> np.ndarray:
    """A video file's frames as one uint8 array [frames, height, width, 3]."""
    from worker.files.video import frame, probe

    data = Path(path).read_bytes()
    count = probe(data).frames
    return np.stack([np.asarray(frame(data, i)) for i in range(count)])


def compare(renderer: Any, model: str, seeds: int, steps: int, frames: int) -> list[Pair]:
    """Each seed's job uncached (step_cache: false), then cached (true), on the resident
    pipeline."""
    from worker.render.context import LocalContext

    pairs = []
    for seed in range(1, seeds + 1):
        job = {"model": model, "prompt": PROMPTS[seed % len(PROMPTS)], "seed": seed}
        job |= {"steps": steps, "frames": frames}
        results = {
            cached: renderer.render(
                {**job, "step_cache": cached}, LocalContext(f"{model}-{seed}-{time.time_ns()}")
            )
            for cached in (False, True)
        }
        videos = {cached: video_frames(r.videos[0].path or "") for cached, r in results.items()}
        report = results[True].step_cache
        diff = np.abs(videos[True].astype(np.float64) - videos[False].astype(np.float64))
        pairs.append(
            Pair(
                seed=seed,
                plain_denoise_s=results[False].timings.denoise,
                cached_denoise_s=results[True].timings.denoise,
                steps_computed=report.steps_computed if report else 0,
                steps_reused=report.steps_reused if report else 0,
                psnr_db=psnr(videos[True], videos[False]),
                mean_abs_diff=float(diff.mean()),
            )
        )
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--models", default="tiny-wan,tiny-ltx")
    parser.add_argument("--models-dir", type=Path, default=None, help="default: build tiny ones")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--thresholds", default="", help="comma-separated; default the manifest's")
    args = parser.parse_args(argv)

    from bench.harness import private_redis
    from worker.pipelines.tiny import build_tiny_models
    from worker.settings import Settings

    work = Path(tempfile.mkdtemp(prefix="kiln-video-step-cache-"))
    models_dir = args.models_dir or work / "models"
    if args.models_dir is None:
        build_tiny_models(models_dir)
    with private_redis(work) as url:  # measured peaks: an unreachable Redis retries for minutes
        settings = Settings(
            models_dir=models_dir,
            output_dir=work / "out",
            timings_log=work / "timings.jsonl",
            inductor_cache_dir=work / "inductor",
            redis_url=url,
        )
        _measure(settings, args)
    return 0


def _measure(settings: Any, args: argparse.Namespace) -> None:
    from worker.manifest import load_manifests
    from worker.render.renderer import Renderer

    models = args.models.split(",")
    manifests = load_manifests(settings.manifests, models)
    print(f"\n{args.steps} steps, {args.frames} frames, {args.seeds} seeds; medians\n")
    print(
        "| model | step cache | denoise uncached | denoise cached | speed-up | computed |"
        " reused | PSNR dB | mean abs diff |"
    )
    print("|---" * 9 + "|")
    for model in models:
        spec = manifests[model].step_cache
        if spec is None:
            raise SystemExit(f"{model}: its manifest declares no step_cache")
        renderer = Renderer(settings, {model: manifests[model]})
        compare(renderer, model, 1, args.steps, args.frames)  # warm: load before the clock
        for threshold in [float(t) for t in args.thresholds.split(",") if t] or [spec.threshold]:
            # Set in the renderer's manifest table between jobs: the pipeline stays resident.
            tried = spec.model_copy(update={"threshold": threshold})
            renderer.manifests[model] = manifests[model].model_copy(update={"step_cache": tried})
            pairs = compare(renderer, model, args.seeds, args.steps, args.frames)
            _row(model, f"{spec.kind} {threshold:g}", pairs)
        renderer.cache.evict(model)


def _row(model: str, cache: str, pairs: list[Pair]) -> None:
    def median(name: str) -> float:
        return float(statistics.median(getattr(p, name) for p in pairs))

    plain, cached = median("plain_denoise_s"), median("cached_denoise_s")
    print(
        f"| {model} | {cache} | {plain:.3f} s | {cached:.3f} s | {plain / cached:.2f}x |"
        f" {median('steps_computed'):g} | {median('steps_reused'):g} |"
        f" {median('psnr_db'):.1f} | {median('mean_abs_diff'):.1f} |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
