"""What self-hosters' model files cost against the diffusers layout they came from (issue 39),
side by side in one process: the host load (read_pipeline) and resident size of the single-file
tiny pipelines (tiny-sd15-file, tiny-sdxl-file) against their diffusers twins, and one
transformer step of tiny-flux-gguf (Q8_0, dequantized by diffusers' GGUF layers each call)
against tiny-flux at full precision. With --compile, each transformer under torch.compile too:
Dynamo's graphs and graph breaks (torch._dynamo.explain), the Inductor-compiled call's largest
difference from eager, and its step. Models are built into --models-dir if absent.

    python bench/model_files.py [--models-dir DIR] [--repeats 5] [--steps 20] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PAIRS = [
    ("tiny-sd15", "tiny-sd15-file"),
    ("tiny-sdxl", "tiny-sdxl-file"),
    ("tiny-sd3", "tiny-sd3-file"),
    ("tiny-flux", "tiny-flux-file"),
    ("tiny-flux", "tiny-flux-fp8"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/kiln-bench-models"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="the transformers compiled too")
    args = parser.parse_args()

    from worker.manifest import load_manifests
    from worker.memory.device import probe
    from worker.pipelines.tiny import build_tiny_models
    from worker.settings import Settings

    build_tiny_models(args.models_dir, ["sd15", "sdxl", "flux"])
    settings = Settings(models_dir=args.models_dir, quantize="off")
    manifests = load_manifests(settings.manifests)
    info = probe(settings)
    print(f"{info.name}, {__import__('os').cpu_count()} CPUs, {args.repeats} loads each (median)")
    for twin, single in PAIRS:
        for model in (twin, single):
            seconds, size = _load(manifests[model], info, settings, args.repeats)
            print(f"{model:16} load {seconds * 1000:7.1f} ms  resident {size / 1e6:6.2f} MB")
    for model in ("tiny-flux", "tiny-flux-gguf"):
        call = _captured(manifests[model], info, settings)
        step = _step(call, args.steps)
        print(f"{model:16} transformer step {step * 1000:6.2f} ms (median of {args.steps})")
        if args.compile:
            print(f"{model:16} compiled: {_compiled(call, args.steps)}")
    return 0


def _load(manifest: Any, info: Any, settings: Any, repeats: int) -> tuple[float, int]:
    from worker.pipelines.loading import read_pipeline
    from worker.pipelines.resident import host_bytes

    manifest = manifest.model_copy(
        update={"loras": {}, "controlnets": {}, "ip_adapter": None, "taesd": None}
    )
    read_pipeline(manifest, info, settings)  # imports and the page cache, not counted
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        loaded = read_pipeline(manifest, info, settings)
        times.append(time.perf_counter() - started)
    return statistics.median(times), host_bytes(loaded.pipe)


def _captured(manifest: Any, info: Any, settings: Any) -> tuple[Any, Any, Any]:
    """The transformer and one denoising call's inputs at 128x128 with one prompt, as the
    pipeline's own step makes them (captured from a real call)."""
    from worker.pipelines.loading import read_pipeline

    manifest = manifest.model_copy(update={"loras": {}, "controlnets": {}, "step_cache": None})
    pipe = read_pipeline(manifest, info, settings).pipe
    captured: dict[str, Any] = {}

    def grab(_module: Any, args: Any, kwargs: Any) -> None:
        captured.setdefault("args", (args, kwargs))

    hook = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    pipe("a fox", num_inference_steps=1, height=128, width=128, output_type="latent")
    hook.remove()
    args, kwargs = captured["args"]
    return pipe.transformer, args, kwargs


def _step(call: tuple[Any, Any, Any], steps: int) -> float:
    """The median of steps calls (after two to warm)."""
    import torch

    module, args, kwargs = call
    times = []
    with torch.inference_mode():
        for _ in range(steps + 2):
            started = time.perf_counter()
            module(*args, **kwargs)
            times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def _compiled(call: tuple[Any, Any, Any], steps: int) -> str:
    """Dynamo's view of the transformer, and Inductor's compiled call against eager."""
    import torch

    module, args, kwargs = call
    with torch.inference_mode():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(module)(*args, **kwargs)
        torch._dynamo.reset()
        eager = module(*args, **kwargs)[0]
        compiled: Any = torch.compile(module)
        started = time.perf_counter()
        out = compiled(*args, **kwargs)[0]
        first = time.perf_counter() - started
    step = _step((compiled, args, kwargs), steps)
    return (
        f"{explained.graph_count} graph(s), {explained.graph_break_count} break(s),"
        f" {explained.op_count} ops; Inductor: first call {first:.1f} s, step {step * 1000:.2f} ms,"
        f" largest difference from eager {(out - eager).abs().max().item():.1e}"
        f" (output up to {eager.abs().max().item():.1f})"
    )

if __name__ == "__main__":
    raise SystemExit(main())
