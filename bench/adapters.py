"""What per-job LoRA and per-job modes cost on a resident pipeline (issue 17), side by side in
one process per model: the load with and without adapter slots, a hot swap, a strength change,
the first derivation of the img2img pipeline, and the step time with no slots, with 2 empty
slots, and with them bypassed as a job that names no adapter runs (worker/pipelines/adapters.py).

    python bench/adapters.py [--models tiny-sd15,tiny-flux] [--repeats 20] [--json FILE]

Eager on the CPU: the compiled case (0 recompiles across swaps) is the slow test in
tests/test_lora.py, whose swap times it prints.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = "tiny-sd15,tiny-sdxl,tiny-sd3,tiny-flux,tiny-flux2,tiny-qwenimage,tiny-zimage"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    from worker.pipelines.tiny import build_tiny_models

    build_tiny_models(ROOT / "models")
    rows = [measure(model, args.repeats) for model in args.models.split(",")]
    print(
        "| model | load, no slots | load, 2 slots | swap | strength | img2img derive"
        " | step, no slots | step, 2 empty slots | step, 2 slots bypassed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        derive = "-" if r["derive_ms"] is None else f"{r['derive_ms']:.1f} ms"
        print(
            f"| {r['model']} | {r['load_s']:.2f} s | {r['load_slots_s']:.2f} s"
            f" | {r['swap_ms']:.1f} ms | {r['scale_ms']:.2f} ms"
            f" | {derive}"
            f" | {r['step_ms']:.1f} ms | {r['step_slots_ms']:.1f} ms"
            f" | {r['step_bypassed_ms']:.1f} ms |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


def measure(model: str, repeats: int) -> dict[str, Any]:
    from api_client.schema import LoraChoice
    from worker.manifest import load_manifests
    from worker.memory.device import probe
    from worker.memory.faults import FaultPlan
    from worker.pipelines.loading import load_pipeline
    from worker.settings import Settings

    settings = Settings(models_dir=ROOT / "models", manifests=ROOT / "manifests")
    manifest = load_manifests(settings.manifests, [model])[model]
    info = probe(settings)
    plain = load_pipeline(
        manifest.model_copy(update={"loras": {}}), "full", info, settings, FaultPlan()
    )
    slotted = load_pipeline(manifest, "full", info, settings, FaultPlan())
    assert slotted.adapters is not None
    slots = slotted.adapters

    swaps, scales = [], []
    for i in range(repeats):
        name = ("detail", "style")[i % 2]
        started = time.perf_counter()
        slots.apply([LoraChoice(name=name, weight=1.0)])
        swaps.append(time.perf_counter() - started)
        started = time.perf_counter()
        slots.apply([LoraChoice(name=name, weight=0.5)])
        scales.append(time.perf_counter() - started)
    slots.apply([])

    derive = None
    if "img2img" in manifest.modes:
        started = time.perf_counter()
        slotted.pipe_for("img2img")
        derive = (time.perf_counter() - started) * 1000
    steps = _step_ms([(plain, False), (slotted, False), (slotted, True)], manifest, repeats)
    return {
        "model": model,
        "load_s": plain.load_s,
        "load_slots_s": slotted.load_s,
        "swap_ms": statistics.median(swaps) * 1000,
        "scale_ms": statistics.median(scales) * 1000,
        "derive_ms": derive,
        "step_ms": steps[0],
        "step_slots_ms": steps[1],
        "step_bypassed_ms": steps[2],
    }


def _step_ms(cases: list[tuple[Any, bool]], manifest: Any, repeats: int) -> list[float]:
    """One denoiser forward of each (pipeline, slots bypassed) at the manifest's first size,
    interleaved (so all see the same machine noise), median of repeats after one warm forward
    each. The bypass is entered and left inside the timing, as a job pays for it."""
    import contextlib

    import torch

    calls = [
        (loaded, bypass, loaded.denoiser, *_denoiser_inputs(loaded, manifest))
        for loaded, bypass in cases
    ]
    times: list[list[float]] = [[] for _ in cases]
    with torch.inference_mode():
        for i in range(repeats + 1):
            for index, (loaded, bypass, denoiser, args, kwargs) in enumerate(calls):
                started = time.perf_counter()
                with loaded.adapters.bypassed() if bypass else contextlib.nullcontext():
                    denoiser(*args, **kwargs)
                if i:
                    times[index].append(time.perf_counter() - started)
    return [statistics.median(t) * 1000 for t in times]


def _denoiser_inputs(loaded: Any, manifest: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The denoiser's own arguments, captured from one real 1-step pipeline call."""
    import torch

    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    denoiser = loaded.denoiser

    def grab(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not captured:
            captured.append((args, dict(kwargs)))

    handle = denoiser.register_forward_pre_hook(grab, with_kwargs=True)
    width, height = manifest.resolutions[0]
    try:
        loaded.pipe(
            prompt="a fox",
            num_inference_steps=1,
            width=width,
            height=height,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        )
    finally:
        handle.remove()
    return captured[0]


if __name__ == "__main__":
    sys.exit(main())
