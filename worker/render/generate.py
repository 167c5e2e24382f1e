"""One try at generating a job's images on a loaded pipeline: text encode, denoise to latents,
decode, each in its own timed phase, with progress, previews and stop requests at each step.

Rendering runs in three calls instead of one pipeline call so each phase is timed,
fault-injected and retried on its own: out of memory in decode retries the decode alone on the
latents already denoised (the ladder's decode rules, handed in as DecodeRules)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from api_client.resolve import hires_size
from api_client.schema import RenderRequest
from worker.errors import JobStopped
from worker.files.store import Store
from worker.memory import device as dev
from worker.memory.device import DeviceInfo
from worker.memory.faults import FaultPlan, crash_point
from worker.pipelines import control, reference
from worker.pipelines.adapters import AdapterRefused
from worker.pipelines.families import Prompt, cfg_active, decode_preview
from worker.pipelines.resident import LoadedPipeline
from worker.pipelines.step_cache import StepCache, StepCacheDecision
from worker.pipelines.switches import preview_steps
from worker.pipelines.vae import tiled
from worker.render.context import JobContext
from worker.render.inputs import JobInputs
from worker.render.timings import PartialBlocks, Stopwatch, TimingRecord

log = logging.getLogger(__name__)

# A hires pass's upscaler model: the first pass's images at the hires size (width, height).
HiresUpscaler = Callable[[list[Image.Image], tuple[int, int]], list[Image.Image]]
# The IP-Adapter a pipeline holds for the job's reference image (read at the first use), or
# None for a job without one.
ReferenceFor = Callable[[LoadedPipeline], "reference.ReferenceAdapter | None"]
StepCallback = Callable[[Any, int, Any, dict[str, Any]], dict[str, Any]]
# One decode of the kept latents on a pipeline, tiled or not: (images, how it decoded).
DecodeTry = Callable[[LoadedPipeline, bool], tuple[list[Image.Image], str]]
# The ladder's decode rules (Ladder.decode with this job's reclaim and reload bound): the images
# and the pipeline that decoded them, which is a lower rung's after a descent.
DecodeRules = Callable[[LoadedPipeline, DecodeTry], tuple[list[Image.Image], LoadedPipeline]]


def decode_once(
    loaded: LoadedPipeline, tile: DecodeTry
) -> tuple[list[Image.Image], LoadedPipeline]:
    """No decode rules: one untiled decode, out of memory left to the caller."""
    return tile(loaded, False)[0], loaded


@torch.inference_mode()
def generate(
    loaded: LoadedPipeline,
    request: RenderRequest,
    ctx: JobContext,
    watch: Stopwatch,
    record: TimingRecord,
    *,
    info: DeviceInfo,
    faults: FaultPlan,
    store: Store,
    inputs: JobInputs | None = None,
    decode: DecodeRules = decode_once,
    step_cache: StepCacheDecision | None = None,
    controlnets: list[torch.nn.Module] | None = None,
    references: ReferenceFor = lambda _loaded: None,
    upscaler: HiresUpscaler | None = None,
) -> tuple[list[Image.Image], LoadedPipeline]:
    """inputs: img2img's, inpaint's and edit's images as the pipeline takes them (image,
    mask_image), the job's controls, whose ControlNets (control.attach) are controlnets, and its
    reference image, whose IP-Adapter a pipeline holds is references' (reference.attach);
    step_cache: the job's (worker.pipelines.step_cache), None for none; upscaler: a hires
    pass's upscaler model (None: latent upscaling, or no hires pass). Returns the images and
    the pipeline that decoded them (decode's)."""
    mode, rung = request.mode or "txt2img", loaded.rung
    inputs = inputs or JobInputs()
    sources, controls, beside = inputs.sources, inputs.controls, controlnets or []
    adapter = references(loaded)
    pipe = control.control_pipe(loaded, mode, beside) if controls else loaded.pipe_for(mode)
    family = loaded.spec
    steps, guidance = denoising_steps(request), float(request.guidance or 0.0)
    count, seed = request.num_images, int(request.seed or 0)
    shape = (request.width or 0, request.height or 0, count)
    record.cold = record.cold or shape not in loaded.warm_shapes
    split, record.partial_blocks = loaded.partial, None
    if split is not None:
        record.partial_blocks = PartialBlocks(resident=split.resident, streamed=split.streamed)
    # Generators live on the CPU so a seed gives the same image on every device.
    generators = [torch.Generator("cpu").manual_seed(seed + i) for i in range(count)]
    dev.reset_peak(info)

    # 1. Text encode
    with watch.phase("text_encode"):
        ctx.progress("text_encode", 0, steps)
        faults.check("text_encode", rung)
        cfg = cfg_active(loaded.manifest.family, guidance, request.true_cfg)
        edited = sources.get("image") if mode == "edit" else None
        prompt = Prompt(
            request.prompt,
            request.negative_prompt,
            count,
            cfg,
            loaded.manifest.max_sequence_length,
            image=edited,
        )
        embeds = family.encode(pipe, loaded.execution_device, prompt)
        if adapter is not None and inputs.reference is not None:
            embeds["ip_adapter_image_embeds"] = reference.image_embeds(
                loaded, adapter, inputs.reference, count, cfg
            )

    # 2. Denoise to latents; the step callback reports progress (with a TAESD preview at each
    #    quarter when the request asks and the model has TAESD) and honours a stop request.
    wanted = request.previews and loaded.preview_vae is not None
    previews = preview_steps(steps) if wanted else set()

    spec = step_cache.spec if step_cache is not None else None
    cache = StepCache(loaded.denoiser, spec, pipe, steps) if spec is not None else None

    def stepper(total: int, previews: set[int]) -> StepCallback:
        """The step callback of a pass of total steps."""

        def on_step(_pipe: Any, step: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            record.steps_denoised += 1
            if cache is not None:
                cache.step_ended()
            preview = None
            if step + 1 in previews:
                preview = _preview(loaded, tensors["latents"], ctx, record, store)
            ctx.progress("denoise", step + 1, total, preview)
            crash_point("denoise")
            if ctx.stop_requested():
                raise JobStopped(f"job {ctx.job_id} stopped at step {step + 1}/{total} on request")
            return tensors

        return on_step

    with watch.phase("denoise"):
        ctx.progress("denoise", 0, steps)
        faults.check("denoise", rung)
        call = {
            **embeds,
            **family.guidance(guidance, request.true_cfg),
            "num_inference_steps": int(request.steps or 1),
            "width": request.width,
            "height": request.height,
            "generator": generators,
            "output_type": "latent",
            "callback_on_step_end": stepper(steps, previews),
            **family.call(*shape[:2]),
        }
        call.update(sources)
        if request.strength is not None:  # img2img and inpaint; edit has none
            call["strength"] = request.strength
        if controls:
            call.update(control.call_arguments(pipe, controls))
            if family.control is not None and family.control.noise_first:
                call["latents"] = control.initial_latents(
                    loaded, embeds, count, *shape[:2], generators
                )
        with (
            cache if cache is not None else nullcontext(),
            loaded.rung_spec.onloaded(beside, loaded.execution_device),
            control.seeded_call(loaded, controls, seed),
            reference.engaged(loaded, adapter, _strength(request)),
        ):
            latents = pipe(**_accepted(pipe, call)).images
        if pipe is not loaded.pipe:
            # Offload hooks belong to the resident pipeline: it moves every module back off the
            # device and re-arms them, as its own call does at the end (a no-op at full).
            loaded.pipe.maybe_free_model_hooks()

    loaded.warm_shapes.add(shape)  # the denoiser has run this shape, whatever decode does
    loaded.cfg_seen.add(cfg)
    loaded.modes_seen.add(control.mode_key(mode, controls, adapter is not None))

    # 3. Decode latents to pixels; out of memory keeps the latents for the decode rules.
    def decode_on(on: LoadedPipeline, tile: bool) -> tuple[list[Image.Image], str]:
        with watch.phase("decode"):
            ctx.progress("decode", steps, steps)
            crash_point("decode")
            faults.check("decode", on.rung)
            view = on.pipe_for(mode)
            with tiled(view.vae) if tile else nullcontext("untiled") as how:
                return family.decode(view, latents, *shape[:2]), how

    images, decoded = decode(loaded, decode_on)
    record.per_step_s = watch.seconds.get("denoise", 0.0) / steps  # the first pass's
    if request.hires is not None:
        # 4. A hires pass: larger, then img2img at that size on the pipeline that decoded.
        second = Pass(decoded, embeds, latents, images, (cfg, guidance), stepper)
        adapter = references(decoded)  # a lower rung's own after a decode descent
        rules = (decode, upscaler, adapter)
        images, decoded = _hires(second, request, ctx, watch, record, faults, *rules)
    record.ran_on(decoded)  # a lower rung's after a decode descent, as the result will say
    if step_cache is not None:
        record.settings = record.settings.model_copy(deep=True)  # the job's note, not the load's
        record.settings.add(step_cache.kind, "step_cache", step_cache.reason)
    record.step_cache = cache.report() if cache is not None else None
    record.peak_memory_bytes = dev.peak_bytes(info)
    return images, decoded


@dataclass(frozen=True)
class Pass:
    """What a hires pass takes from the first: the pipeline that decoded it, the text (and
    reference) embeddings, its latents and images, (whether CFG runs, the guidance), and its
    step callback's maker."""

    loaded: LoadedPipeline
    embeds: dict[str, Any]
    latents: torch.Tensor
    images: list[Image.Image]
    guidance: tuple[bool, float]
    stepper: Callable[[int, set[int]], StepCallback]


def _hires(
    first: Pass,
    request: RenderRequest,
    ctx: JobContext,
    watch: Stopwatch,
    record: TimingRecord,
    faults: FaultPlan,
    decode: DecodeRules,
    upscaler: HiresUpscaler | None,
    adapter: reference.ReferenceAdapter | None,
) -> tuple[list[Image.Image], LoadedPipeline]:
    """The first pass's result made hires.scale times larger (an upscaler model's pixels, or its
    latents), then img2img at that size with the pass's strength and steps, on the same
    resident pipeline, the same seeds and the same text embeddings; then decoded."""
    hires, loaded = request.hires, first.loaded
    assert hires is not None and hires.strength is not None and hires.steps is not None
    family, (cfg, guidance) = loaded.spec, first.guidance
    base = (request.width or 0, request.height or 0)
    size = hires_size(request)
    if upscaler is None:  # "latent": the latents themselves, bilinear, as A1111's Latent
        with watch.phase("upscale"):
            start: Any = hires_latents(loaded, first.latents, base, size)
    else:
        start = upscaler(first.images, size)
    steps = max(hires.steps - int(hires.steps - hires.steps * hires.strength), 1)
    pipe = loaded.pipe_for("img2img")
    seed, count = int(request.seed or 0), request.num_images
    with watch.phase("denoise"):
        ctx.progress("denoise", 0, steps)
        faults.check("denoise", loaded.rung)
        call = {
            **first.embeds,
            **family.guidance(guidance, request.true_cfg),
            "image": start,
            "strength": hires.strength,
            "num_inference_steps": hires.steps,
            "width": size[0],
            "height": size[1],
            "generator": [torch.Generator("cpu").manual_seed(seed + i) for i in range(count)],
            "output_type": "latent",
            "callback_on_step_end": first.stepper(steps, set()),
        }
        with reference.engaged(loaded, adapter, _strength(request)):
            latents = pipe(**_accepted(pipe, call)).images
        loaded.pipe.maybe_free_model_hooks()  # the derived pipeline's hooks are the resident's
    loaded.warm_shapes.add((*size, count))
    loaded.modes_seen.add(control.mode_key("img2img", None, adapter is not None))
    loaded.cfg_seen.add(cfg)

    def decode_on(on: LoadedPipeline, tile: bool) -> tuple[list[Image.Image], str]:
        with watch.phase("decode"):
            ctx.progress("decode", steps, steps)
            faults.check("decode", on.rung)
            view = on.pipe_for("img2img")
            with tiled(view.vae) if tile else nullcontext("untiled") as how:
                return family.decode(view, latents, *size), how

    record.passes = 2
    return decode(loaded, decode_on)


def hires_latents(
    loaded: LoadedPipeline, latents: torch.Tensor, base: tuple[int, int], size: tuple[int, int]
) -> torch.Tensor:
    """The first pass's latents at the hires size, as the family's img2img takes them for its
    image: (B, C, H, W), FLUX.1's unpacked from their 2x2 patch tokens first."""
    import torch.nn.functional as F

    pipe = loaded.pipe
    if latents.ndim == 3:  # packed tokens (FLUX.1)
        latents = pipe._unpack_latents(latents, base[1], base[0], pipe.vae_scale_factor)
    scale = pipe.vae_scale_factor
    cells = (size[1] // scale, size[0] // scale)
    return F.interpolate(latents.float(), size=cells, mode="bilinear").to(latents.dtype)


def _strength(request: RenderRequest) -> float:
    """The reference's IP-Adapter strength (resolve_request fills it in)."""
    return float(request.reference.strength or 0.0) if request.reference is not None else 0.0


def denoising_steps(request: RenderRequest) -> int:
    """Steps the denoiser runs: all of them for txt2img; img2img and inpaint start part-way,
    skipping what their strength keeps of the input (diffusers' get_timesteps)."""
    steps = int(request.steps or 1)
    if request.strength is None:
        return steps
    return max(steps - int(steps - steps * request.strength), 1)


def _accepted(pipe: Any, call: dict[str, Any]) -> dict[str, Any]:
    """The call without width and height where the pipeline takes no size (SD's and SDXL's
    img2img render at the input's size, which validation holds to the job's)."""
    params = inspect.signature(type(pipe).__call__).parameters
    return {k: v for k, v in call.items() if k in params or k not in ("width", "height")}


def _preview(
    loaded: LoadedPipeline,
    latents: torch.Tensor,
    ctx: JobContext,
    record: TimingRecord,
    store: Store,
) -> str | None:
    """Decode and store a preview (its uri); one that fails is logged and skipped, never fatal."""
    try:
        image = decode_preview(loaded.pipe, loaded.preview_vae, latents)
        uri = store.save_preview(ctx.job_id, image)
    except Exception as exc:
        log.warning("preview failed for job %s: %s", ctx.job_id, exc)
        return None
    record.previews += 1
    return uri


def apply_loras(
    loaded: LoadedPipeline,
    request: RenderRequest,
    watch: Stopwatch,
    record: TimingRecord,
    streams: bool,
) -> frozenset[str]:
    """The request's adapters into the pipeline's slots at their weights (the load phase:
    it is the adapters' load), every slot the job does not use at 0."""
    choices = request.loras or []
    record.loras = list(choices)
    slots = loaded.adapters
    if slots is None:
        if choices:  # the manifest allowed none, and resolve_request said so at submit
            raise AdapterRefused(f"model {loaded.manifest.id}: this pipeline has no adapters")
        return frozenset()
    if choices and loaded.rung_spec.pinned_streams and streams:
        raise AdapterRefused(
            f"model {loaded.manifest.id}: loras at rung {loaded.rung} with CUDA streams:"
            " the offload keeps pinned copies of the weights it streams, which a hotswap"
            " would not reach; pin rung model_offload (KILN_MEMORY_MODE) to serve loras on"
            " this card"
        )
    if slots.differs(choices):
        with watch.phase("load"):
            slots.apply(choices)
    return frozenset(c.name for c in choices)
