"""ControlNets, upscalers and hires passes, measured (issue 30 item 7), side by side in one run
through kiln's own renderer, each pipeline resident and warm before anything is timed:

- a ControlNet's extra time per step: the same job with 0, 1 and 2 controls (per model), and an
  IP-Adapter's: the same job with a reference image (where the manifest names an adapter);
- an upscaler's seconds per megapixel, at several input sizes;
- a hires pass against a direct render at its final size: the same model, steps and seed.

    python bench/controls.py                         # tiny-sd15, tiny-flux, tiny-upscaler
    python bench/controls.py --models tiny-sdxl --steps 8 --repeats 5 --json out.json
    python bench/controls.py --models-dir /models --models sdxl-base --upscaler realesrgan-x4plus

Medians of --repeats renders each; the ratios are of medians measured in the same run. The
tiny models have random weights: their times are the code paths' and these shapes', not a real
model's (bench/gpu_check.py's controls section runs the real architectures).
"""

from __future__ import annotations

import argparse
import io
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


def _png(width: int, height: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def _data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


def _render(renderer: Any, request: dict[str, Any]) -> Any:
    from worker.render.context import LocalContext

    return renderer.render(request, LocalContext(f"bench-{time.time_ns()}"))


def _median(results: list[Any], phase: str) -> float:
    return float(statistics.median(getattr(r.timings, phase) for r in results))


def controls(renderer: Any, model: str, steps: int, repeats: int) -> dict[str, Any]:
    """Per-step denoise seconds with no control, one, two (where the manifest has two), and a
    reference image through the IP-Adapter (where the manifest names one)."""
    manifest = renderer.manifests[model]
    width, height = manifest.resolutions[0]
    image = _data_url(_png(width, height, 1))
    names = sorted(manifest.controlnets)[:2]
    sets: dict[str, dict[str, Any]] = {"none": {}}
    for count in (1, 2):
        if len(names) >= count:
            chosen = [{"name": name, "image": image} for name in names[:count]]
            sets[f"{count} control(s)"] = {"controls": chosen}
    if manifest.family in ("flux", "qwenimage", "zimage", "sd3"):
        sets.pop("2 control(s)", None)  # one control a job is what those tests cover
    if manifest.ip_adapter is not None:
        sets["reference"] = {"reference": {"image": _data_url(_png(256, 256, 2))}}
    row: dict[str, Any] = {"model": model, "steps": steps, "size": f"{width}x{height}"}
    base = {"model": model, "prompt": "a lighthouse at dusk", "steps": steps, "seed": 1}
    requests = {label: {**base, **extra} for label, extra in sets.items()}
    for request in requests.values():
        _render(renderer, request)  # warm: the ControlNet's or adapter's load and first call
    runs: dict[str, list[Any]] = {label: [] for label in requests}
    for _ in range(repeats):  # in turn, so a drift in the machine's speed falls on all alike
        for label, request in requests.items():
            runs[label].append(_render(renderer, request))
    for label in requests:
        row[f"{label} s/step"] = round(_median(runs[label], "denoise") / steps, 4)
    if "reference" in runs:  # the image encoder's pass is in text_encode
        for label in ("none", "reference"):
            row[f"{label} text_encode s"] = round(_median(runs[label], "text_encode"), 4)
    plain = row["none s/step"]
    for label in sets:
        if label != "none":
            row[f"{label} x"] = round(row[f"{label} s/step"] / plain, 2)
    return row


def upscaler(renderer: Any, model: str, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """Seconds of the upscale phase per input and per output megapixel, at each size."""
    scale = renderer.manifests[model].scale or 1
    rows = []
    for side in sizes:
        request = {"model": model, "image": _data_url(_png(side, side, 2)), "width": side}
        request["height"] = side
        _render(renderer, request)
        done = [_render(renderer, request) for _ in range(repeats)]
        seconds = _median(done, "upscale")
        megapixels = side * side / 1e6
        rows.append(
            {
                "model": model,
                "input": f"{side}x{side}",
                "output": f"{side * scale}x{side * scale}",
                "upscale_s": round(seconds, 4),
                "s_per_input_mp": round(seconds / megapixels, 3),
                "s_per_output_mp": round(seconds / (megapixels * scale * scale), 3),
                "tile": done[-1].attempts[-1].detail,
            }
        )
    return rows


def hires(
    renderer: Any, model: str, upscaler_id: str | None, steps: int, repeats: int
) -> dict[str, Any]:
    """A 2x hires pass (latent, and the upscaler model when given) against a direct render at
    the final size: total seconds per image, the same steps and seed. The model's manifest is
    given the final size for the direct render (a bench-only change, undone after)."""
    manifest = renderer.manifests[model]
    width, height = manifest.resolutions[0]
    final = (width * 2, height * 2)
    renderer.manifests[model] = manifest.model_copy(
        update={"resolutions": [*manifest.resolutions, final]}
    )
    base = {"model": model, "prompt": "a lighthouse at dusk", "steps": steps, "seed": 3}
    cases: dict[str, dict[str, Any]] = {
        f"direct {final[0]}x{final[1]}": {"width": final[0], "height": final[1]},
        "hires latent": {"hires": {"scale": 2, "steps": steps, "strength": 0.5}},
    }
    if upscaler_id:
        cases[f"hires {upscaler_id}"] = {
            "hires": {"scale": 2, "steps": steps, "strength": 0.5, "upscaler": upscaler_id}
        }
    row: dict[str, Any] = {"model": model, "steps": steps, "first": f"{width}x{height}"}
    try:
        for label, extra in cases.items():
            _render(renderer, {**base, **extra})
            done = [_render(renderer, {**base, **extra}) for _ in range(repeats)]
            row[f"{label} total_s"] = round(_median(done, "total"), 4)
    finally:
        renderer.manifests[model] = manifest
    direct = row[f"direct {final[0]}x{final[1]} total_s"]
    for label in cases:
        if label.startswith("hires"):
            row[f"{label} x direct"] = round(row[f"{label} total_s"] / direct, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--models", default="tiny-sd15,tiny-flux")
    parser.add_argument("--upscaler", default="tiny-upscaler")
    parser.add_argument("--sizes", default="128,256,512", help="upscaler input sides, px")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models-dir", type=Path, default=None, help="default: build tiny ones")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from worker.manifest import load_manifests
    from worker.pipelines.tiny import build_tiny_models
    from worker.render.renderer import Renderer
    from worker.settings import Settings

    work = Path(tempfile.mkdtemp(prefix="kiln-controls-"))
    models_dir = args.models_dir or work / "models"
    if args.models_dir is None:
        build_tiny_models(models_dir)
    models = args.models.split(",")
    settings = Settings(
        models_dir=models_dir,
        output_dir=work / "out",
        timings_log=work / "timings.jsonl",
        redis_url="redis://127.0.0.1:1/0",  # unused: no queue, and the peaks book copes
        prefetch="off",
    )
    renderer = Renderer(settings, load_manifests(settings.manifests, [*models, args.upscaler]))
    report: dict[str, Any] = {"controls": [], "upscaler": [], "hires": []}
    for model in models:
        report["controls"].append(controls(renderer, model, args.steps, args.repeats))
        print(json.dumps(report["controls"][-1]))
    sizes = [int(side) for side in args.sizes.split(",")]
    report["upscaler"] = upscaler(renderer, args.upscaler, sizes, args.repeats)
    for row in report["upscaler"]:
        print(json.dumps(row))
    for model in models:
        report["hires"].append(hires(renderer, model, args.upscaler, args.steps, args.repeats))
        print(json.dumps(report["hires"][-1]))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
