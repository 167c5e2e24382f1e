"""ControlNets beside a resident pipeline: read at the first job that names one and kept with the
pipeline (never a second copy of the base model), placed as the pipeline's rung places such a
model (RungSpec.place_beside), and the control pipeline derived from the resident modules as
img2img's is. Also the worker's own preprocessor (Canny edges, no model needed) and the call
arguments a family's control pipeline takes.

The request side (what a manifest allows, what a request may ask) is api_client.controls."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api_client.controls import ControlNetSpec
from api_client.manifest import Manifest
from api_client.schema import ControlChoice, RenderRequest
from worker.manifest import weights_source
from worker.pipelines.pull import config_marker

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from worker.memory.device import DeviceInfo
    from worker.pipelines.resident import LoadedPipeline

log = logging.getLogger(__name__)

# Canny's hysteresis thresholds on the Sobel gradient's L1 magnitude, as OpenCV's Canny takes
# them: A1111's and ComfyUI's defaults (100, 200).
CANNY_LOW, CANNY_HIGH = 100.0, 200.0


@dataclass(frozen=True)
class Control:
    """One of a job's controls, ready for its pipeline: the request's choice, its manifest
    entry, and the control image as the ControlNet reads it (preprocessed)."""

    choice: ControlChoice
    spec: ControlNetSpec
    image: Image.Image


def specs(manifest: Manifest, request: RenderRequest) -> list[ControlNetSpec]:
    return [manifest.controlnets[c.name] for c in request.controls or []]


def sources(manifest: Manifest, request: RenderRequest) -> tuple[str, ...]:
    """The distinct ControlNet checkpoints a job loads beside its pipeline, sorted."""
    return tuple(sorted({_key(spec) for spec in specs(manifest, request)}))


def beside_gb(manifest: Manifest, request: RenderRequest) -> float:
    """16-bit GB of those checkpoints, as their manifest entries declare them."""
    sizes = {_key(spec): spec.gb for spec in specs(manifest, request)}
    return sum(sizes.values())


def mode_key(
    mode: str, controls: list[Control] | list[ControlChoice] | None, reference: bool = False
) -> str:
    """A mode as compile and novelty tell graphs apart: a controlled denoise is another graph
    (the ControlNet's residuals are inputs of the denoiser's), and so is one with a reference
    (the IP-Adapter's attention processors are in it)."""
    controlled = f"{mode}+control" if controls else mode
    return f"{controlled}+reference" if reference else controlled


def _key(spec: ControlNetSpec) -> str:
    return "/".join(part for part in (spec.source, spec.subfolder) if part)


# -- loading beside the pipeline -------------------------------------------------------------


def attach(
    loaded: LoadedPipeline, controls: list[Control], info: DeviceInfo, models_dir: Path
) -> list[torch.nn.Module]:
    """The job's ControlNet models, in its controls' order: those the pipeline holds already,
    the rest read from disk (or the hub) in the pipeline's precision and placed on its rung.
    Their bytes on the device count in the pipeline's (LoadedPipeline.device_bytes)."""
    import diffusers

    from worker.memory import device as dev
    from worker.memory.peaks import module_bytes

    family = loaded.spec.control
    assert family is not None, "resolve_request refuses controls on a family without them"
    model_cls = getattr(diffusers, family.model_class)
    row = loaded.rung_spec
    modules = []
    for control in controls:
        key = _key(control.spec)
        module = loaded.controlnets.get(key)
        if module is None:
            marker = config_marker(control.spec.subfolder)
            source = weights_source(
                loaded.manifest, models_dir, source=control.spec.source, marker=marker
            )
            options: dict[str, Any] = {"dtype": loaded.dtype}
            if control.spec.revision:
                options["revision"] = control.spec.revision
            if control.spec.subfolder:
                options["subfolder"] = control.spec.subfolder
            before = dev.allocated_bytes(info)
            module = model_cls.from_pretrained(source.location, **options).eval()
            target = loaded.execution_device
            row.place_beside(module, target, target.type == "cuda" and info.streams)
            if info.torch_device == "cpu":
                loaded.device_bytes += module_bytes(module)
            else:
                loaded.device_bytes += max(dev.allocated_bytes(info) - before, 0)
            loaded.controlnets[key] = module
            log.info("controlnet %s loaded beside %s at %s", key, loaded.manifest.id, row.name)
        modules.append(module)
    return modules


def control_pipe(loaded: LoadedPipeline, mode: str, modules: list[torch.nn.Module]) -> Any:
    """The family's control pipeline for mode on the resident pipeline's own modules and these
    ControlNets (a list of two makes diffusers' multi-ControlNet), kept for the next job with
    the same ones (LoadedPipeline.pipe_for's rule: nothing cast, nothing placed again)."""
    import diffusers

    family = loaded.spec.control
    assert family is not None
    key = f"{mode}+control:{','.join(str(id(m)) for m in modules)}"
    derived = loaded.mode_pipes.get(key)
    if derived is None:
        pipeline_cls = getattr(diffusers, family.pipelines[mode])
        names, options = pipeline_cls._get_signature_keys(pipeline_cls)
        parts = {k: v for k, v in loaded.pipe.components.items() if k in names}
        parts.update({k: v for k, v in loaded.pipe.config.items() if k in options})
        parts.update({k: None for k in names if k not in parts})  # image_encoder and the like
        parts["controlnet"] = modules[0] if len(modules) == 1 else list(modules)
        derived = pipeline_cls(**parts)
        derived.set_progress_bar_config(disable=True)
        loaded.mode_pipes[key] = derived
    return derived


def call_arguments(pipe: Any, controls: list[Control]) -> dict[str, Any]:
    """What the control pipeline's call takes for these controls: the control images (`image` in
    SD's txt2img, `control_image` where `image` is img2img's input), each one's strength, the
    share of steps it applies over where the call takes one (Z-Image's applies over every step:
    resolve_controls holds start and end to 0 and 1 there), and a union checkpoint's mode index."""
    params = inspect.signature(type(pipe).__call__).parameters
    one = len(controls) == 1

    def each(values: list[Any]) -> Any:
        return values[0] if one else values

    image_arg = "control_image" if "control_image" in params else "image"
    call: dict[str, Any] = {
        image_arg: each([c.image for c in controls]),
        "controlnet_conditioning_scale": each([float(c.choice.strength or 0.0) for c in controls]),
    }
    if "control_guidance_start" in params:
        call["control_guidance_start"] = each([float(c.choice.start or 0.0) for c in controls])
        call["control_guidance_end"] = each(
            [1.0 if c.choice.end is None else float(c.choice.end) for c in controls]
        )
    modes = [c.spec.union_mode for c in controls]
    if "control_mode" in params and any(mode is not None for mode in modes):
        call["control_mode"] = each(modes)
    return call


def initial_latents(
    loaded: LoadedPipeline,
    embeds: dict[str, Any],
    count: int,
    width: int,
    height: int,
    generators: list[torch.Generator],
) -> torch.Tensor:
    """The starting noise as the family's own txt2img pipeline draws it from the job's
    generators, for a control pipeline that draws from them first (FLUX.1's and Qwen-Image's
    VAE-sample their control image from them): handed in, the noise is the same with or without
    a control."""
    pipe = loaded.pipe
    channels = pipe.transformer.config.in_channels // 4
    dtype = embeds["prompt_embeds"].dtype
    drawn = pipe.prepare_latents(
        count, channels, height, width, dtype, loaded.execution_device, generators
    )
    # FLUX.1's returns the packed latents with their position ids; Qwen-Image's, the latents.
    latents: torch.Tensor = drawn[0] if isinstance(drawn, tuple) else drawn
    return latents


@contextmanager
def seeded_call(loaded: LoadedPipeline, controls: list[Control], seed: int) -> Iterator[None]:
    """Around a controlled call whose pipeline VAE-samples its control image from torch's global
    RNG (FamilySpec.control.global_rng: SD3's passes no generator), that RNG seeded from the
    job's seed, so the job renders the same pixels each time on a device; the caller's RNG state
    (the host's and the device's) is back as it was after. Elsewhere nothing."""
    import torch

    family = loaded.spec.control
    if not controls or family is None or not family.global_rng:
        yield
        return
    device = loaded.execution_device
    on_host = device.type == "cpu"
    # The VAE samples where the control image is: from the host's generator or the device's,
    # and only that card's (torch.manual_seed would reseed every card's, fork_rng restore one).
    forked = [] if on_host else [device]
    with torch.random.fork_rng(devices=forked, device_type="cuda" if on_host else device.type):
        torch.default_generator.manual_seed(seed)
        if not on_host:
            module = torch.get_device_module(device.type)
            with module.device(device) if device.type == "cuda" else nullcontext():
                module.manual_seed(seed)  # the current device's; MPS has one
        yield


# -- the worker's preprocessor ---------------------------------------------------------------


def preprocess(image: Image.Image, how: str | None) -> Image.Image:
    """The control image as its ControlNet reads it: as given, or its Canny edges."""
    return canny(image) if how == "canny" else image


def canny(image: Image.Image, low: float = CANNY_LOW, high: float = CANNY_HIGH) -> Image.Image:
    """Canny edges as OpenCV's Canny(image, low, high) finds them on the grey image: 3x3 Sobel
    gradients (L1 magnitude), thinned to their local maxima across the edge, kept above high and
    where they connect to such an edge above low; white on black, RGB, the image's size."""
    import numpy
    import torch
    import torch.nn.functional as F
    from PIL import Image

    grey = torch.from_numpy(numpy.asarray(image.convert("L"), dtype=numpy.float32))[None, None]
    sobel = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
    padded = F.pad(grey, (1, 1, 1, 1), mode="replicate")
    gx = F.conv2d(padded, sobel[None, None])[0, 0]
    gy = F.conv2d(padded, sobel.t()[None, None])[0, 0]
    magnitude = gx.abs() + gy.abs()
    # The gradient's direction in four bins (0, 45, 90, 135 degrees); an edge point must be a
    # maximum against its two neighbours along it.
    angle = torch.rad2deg(torch.atan2(gy, gx)) % 180
    bins = (((angle + 22.5) // 45) % 4).long()
    around = F.pad(magnitude[None, None], (1, 1, 1, 1))[0, 0]
    h, w = magnitude.shape

    def shifted(dy: int, dx: int) -> torch.Tensor:
        return around[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w]

    # Image rows grow downwards: a 45-degree gradient points to (+1, +1) in (row, column).
    pairs = [((0, 1), (0, -1)), ((1, 1), (-1, -1)), ((1, 0), (-1, 0)), ((1, -1), (-1, 1))]
    peak = torch.zeros_like(magnitude, dtype=torch.bool)
    for index, (ahead, behind) in enumerate(pairs):
        local = (magnitude > shifted(*ahead)) & (magnitude >= shifted(*behind))
        peak |= (bins == index) & local
    strong = peak & (magnitude >= high)
    weak = peak & (magnitude >= low)
    edges = strong
    while True:  # hysteresis: grow the strong edges through weak ones they touch
        grown = F.max_pool2d(edges[None, None].float(), 3, stride=1, padding=1)[0, 0] > 0
        grown &= weak
        if torch.equal(grown, edges):
            break
        edges = grown
    pixels = (edges.numpy().astype(numpy.uint8)) * 255
    return Image.fromarray(pixels, "L").convert("RGB")
