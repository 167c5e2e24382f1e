"""Step caches, measured (issue 29 item 3): a prompt suite rendered with and without each model's
step cache at the same seeds, side by side through kiln's own renderer, one resident pipeline per
model. Per model and threshold: seconds of denoise and of the whole job per image, the speed-up,
steps reused, and PSNR and SSIM of each cached image against its uncached twin.

    python bench/step_cache.py                                  # tiny-flux, tiny-qwenimage
    python bench/step_cache.py --thresholds 0.05,0.1,0.2 --steps 28 --compile
    python bench/step_cache.py --models flux1-dev --models-dir /models --json out.json
    python bench/step_cache.py --models tiny-flux-mag --manifests DIR   # a manifest of your own

The tiny models have random weights: their images are noise, so their PSNR and SSIM say nothing
about quality, only that the measurement runs. bench/gpu_check.py's step_cache section runs the
same comparison on FLUX.1-dev's and Qwen-Image's real architectures. No perceptual metric: LPIPS
and DISTS download their network weights, which these machines cannot.

Thresholds: each is set in the renderer's manifest table between jobs; the pipeline stays
resident, loaded (and compiled, --compile) for the model's own step_cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPTS = (
    "a lighthouse on a cliff at dusk, oil painting",
    "a red fox in fresh snow, telephoto photograph",
    "isometric cutaway of a pottery kiln, technical drawing",
    "a bowl of ramen on a wooden table, soft window light",
    "a city street in the rain at night, neon reflections",
    "portrait of an old sailor, charcoal sketch",
)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 images, in dB; inf when identical."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Structural similarity (Wang et al. 2004) of two uint8 RGB images on their BT.601 luma:
    an 11x11 Gaussian window of sigma 1.5, K1 0.01, K2 0.03, the mean of the SSIM map."""
    import torch
    import torch.nn.functional as F

    def luma(x: np.ndarray) -> torch.Tensor:
        rgb = torch.from_numpy(x.astype(np.float64))
        y = rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114
        return y[None, None]

    x, y = luma(a), luma(b)
    coords = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-(coords**2) / (2 * 1.5**2))
    window = (g[:, None] * g[None, :] / g.sum() ** 2)[None, None]

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, window)

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    ssim_map = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / (
        (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
    )
    return float(ssim_map.mean())


@dataclass
class Pair:
    """One prompt at one seed, uncached then cached."""

    prompt: str
    seed: int
    plain_denoise_s: float
    cached_denoise_s: float
    plain_total_s: float
    cached_total_s: float
    steps_computed: int
    steps_reused: int
    psnr_db: float
    ssim: float


def compare(
    renderer: Any,
    model: str,
    threshold: float | None,
    prompts: tuple[str, ...],
    steps: int,
    extra: dict[str, Any] | None = None,
) -> list[Pair]:
    """Each prompt uncached (step_cache: false), then cached (true) at the same seed, on the
    renderer's resident pipeline; threshold (None: the manifest's) is set in its manifest table."""
    from PIL import Image

    from worker.render.context import LocalContext

    manifest = renderer.manifests[model]
    if manifest.step_cache is None:
        raise SystemExit(f"{model}: its manifest declares no step_cache")
    if threshold is not None:
        spec = manifest.step_cache.model_copy(update={"threshold": threshold})
        renderer.manifests[model] = manifest.model_copy(update={"step_cache": spec})
    pairs = []
    try:
        for seed, prompt in enumerate(prompts, start=1):
            job = {"model": model, "prompt": prompt, "steps": steps, "seed": seed, **(extra or {})}
            results = {}
            for cached in (False, True):
                tag = f"{model}-{threshold}-{seed}-{cached}-{time.time_ns()}"
                results[cached] = renderer.render({**job, "step_cache": cached}, LocalContext(tag))
            images = {}
            for cached, result in results.items():
                with Image.open(result.images[0].path) as image:
                    images[cached] = np.asarray(image.convert("RGB"))
            report = results[True].step_cache
            pairs.append(
                Pair(
                    prompt=prompt,
                    seed=seed,
                    plain_denoise_s=round(results[False].timings.denoise, 4),
                    cached_denoise_s=round(results[True].timings.denoise, 4),
                    plain_total_s=round(results[False].timings.total, 4),
                    cached_total_s=round(results[True].timings.total, 4),
                    steps_computed=report.steps_computed if report else 0,
                    steps_reused=report.steps_reused if report else 0,
                    psnr_db=round(psnr(images[True], images[False]), 2),
                    ssim=round(ssim(images[True], images[False]), 4),
                )
            )
    finally:
        renderer.manifests[model] = manifest
    return pairs


def summary(model: str, threshold: float, pairs: list[Pair]) -> dict[str, Any]:
    """Medians over the suite; the speed-up is the ratio of the medians."""

    def median(name: str) -> float:
        return float(statistics.median(getattr(p, name) for p in pairs))

    finite = [p.psnr_db for p in pairs if np.isfinite(p.psnr_db)]
    return {
        "model": model,
        "threshold": threshold,
        "images": len(pairs),
        "plain_denoise_s": round(median("plain_denoise_s"), 4),
        "cached_denoise_s": round(median("cached_denoise_s"), 4),
        "denoise_speedup": round(median("plain_denoise_s") / median("cached_denoise_s"), 2),
        "plain_total_s": round(median("plain_total_s"), 4),
        "cached_total_s": round(median("cached_total_s"), 4),
        "steps_reused": median("steps_reused"),
        "steps": pairs[0].steps_computed + pairs[0].steps_reused,
        "psnr_db": round(statistics.median(finite), 2) if finite else float("inf"),
        "ssim": round(median("ssim"), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--models", default="tiny-flux,tiny-qwenimage")
    parser.add_argument("--models-dir", type=Path, default=None, help="default: build tiny ones")
    parser.add_argument(
        "--manifests", default=None, help="more manifest directories (KILN_MANIFESTS's form)"
    )
    parser.add_argument("--thresholds", default="", help="comma-separated; default the manifest's")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4, help=f"1-{len(PROMPTS)}")
    parser.add_argument("--compile", action="store_true", help="pin compile on (a CPU too)")
    parser.add_argument("--json", type=Path, default=None, help="write every pair here")
    args = parser.parse_args(argv)

    from worker.manifest import load_manifests
    from worker.pipelines.tiny import build_tiny_models
    from worker.render.renderer import Renderer
    from worker.settings import Settings

    work = Path(tempfile.mkdtemp(prefix="kiln-step-cache-"))
    models_dir = args.models_dir or work / "models"
    if args.models_dir is None:
        build_tiny_models(models_dir)
    models = args.models.split(",")
    settings = Settings(
        models_dir=models_dir,
        output_dir=work / "out",
        timings_log=work / "timings.jsonl",
        inductor_cache_dir=work / "inductor",
        redis_url="redis://127.0.0.1:1/0",  # no Redis: measured peaks stay in this process
        **({"manifests": args.manifests} if args.manifests else {}),
    )
    manifests = load_manifests(settings.manifests, models)
    prompts = PROMPTS[: max(1, min(args.prompts, len(PROMPTS)))]
    extra = {"compile": True} if args.compile else {}
    rows, every = [], {}
    for model in models:
        renderer = Renderer(settings, {model: manifests[model]})
        # Warm: load (and compile) before the clock, so the first pair is not a cold one.
        compare(renderer, model, None, prompts[:1], args.steps, extra)
        spec = manifests[model].step_cache
        thresholds = [float(t) for t in args.thresholds.split(",") if t] or [spec.threshold]
        for threshold in thresholds:
            pairs = compare(renderer, model, threshold, prompts, args.steps, extra)
            rows.append(summary(model, threshold, pairs))
            every[f"{model}@{threshold}"] = [asdict(p) for p in pairs]
        renderer.cache.evict(model)
    _print(rows, args)
    if args.json:
        args.json.write_text(json.dumps({"summary": rows, "pairs": every}, indent=2) + "\n")
    return 0


def _print(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    how = "compiled" if args.compile else "eager"
    print(f"\n{args.steps} steps, {args.prompts} prompts, {how}; medians over the suite\n")
    head = (
        "| model | threshold | denoise uncached | denoise cached | speed-up | job uncached |"
        " job cached | steps reused | PSNR dB | SSIM |"
    )
    print(head)
    print("|---" * 10 + "|")
    for r in rows:
        print(
            f"| {r['model']} | {r['threshold']:g} | {r['plain_denoise_s']:.3f} s |"
            f" {r['cached_denoise_s']:.3f} s | {r['denoise_speedup']:.2f}x |"
            f" {r['plain_total_s']:.3f} s | {r['cached_total_s']:.3f} s |"
            f" {r['steps_reused']:g} of {r['steps']} | {r['psnr_db']} | {r['ssim']} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
