"""One try at generating a job's images on a loaded pipeline: its prompt encoded once, then its
passes (worker.render.passes: the first, and a hires pass when asked), each a denoise and a
decode in their own timed phases, with progress, previews and stop requests at each step.

Rendering runs in three calls instead of one pipeline call so each phase is timed,
fault-injected and retried on its own: out of memory in decode retries the decode alone on the
latents already denoised (the ladder's decode rules, handed in as DecodeRules)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from api_client.resolve import hires_size
from api_client.schema import RenderRequest
from worker.crashes import crash_point
from worker.errors import JobStopped
from worker.files.store import Store
from worker.memory import device as dev
from worker.memory.device import DeviceInfo
from worker.memory.faults import FaultPlan
from worker.pipelines import control, latent_preview, reference
from worker.pipelines.adapters import AdapterRefused
from worker.pipelines.families import cfg_active, decode_preview
from worker.pipelines.prompt import Prompt
from worker.pipelines.resident import LoadedPipeline
from worker.pipelines.step_cache import StepCache
from worker.pipelines.switches import preview_steps
from worker.render.job_run import JobRun
from worker.render.passes import (
    DecodeRules,
    StepCallback,
    TextEmbeds,
    decode_once,
    denoising_steps,
    first_pass,
    hires_pass,
    run_pass,
)
from worker.render.timings import PartialBlocks

log = logging.getLogger(__name__)

# A hires pass's upscaler model: the first pass's images at the hires size (width, height).
HiresUpscaler = Callable[[list[Image.Image], tuple[int, int]], list[Image.Image]]
# The IP-Adapter a pipeline holds for the job's reference image (read at the first use), or
# None for a job without one.
ReferenceFor = Callable[[LoadedPipeline], "reference.ReferenceAdapter | None"]


@torch.inference_mode()
def generate(
    loaded: LoadedPipeline,
    job: JobRun,
    *,
    info: DeviceInfo,
    faults: FaultPlan,
    store: Store,
    decode: DecodeRules = decode_once,
    controlnets: list[torch.nn.Module] | None = None,
    references: ReferenceFor = lambda _loaded: None,
    upscaler: HiresUpscaler | None = None,
) -> tuple[list[Image.Image], LoadedPipeline]:
    """The job's images on loaded: its prompt encoded, its first pass, then a hires pass when
    the request asks one. Its inputs (job.inputs) are img2img's, inpaint's and edit's images as
    the pipeline takes them (image, mask_image), its controls, whose ControlNets
    (control.attach) are controlnets, and its reference image, whose IP-Adapter a pipeline holds
    is references' (reference.attach); its step cache is its plan's; upscaler: a hires pass's
    upscaler model (None: latent upscaling, or no hires pass). Returns the images and the
    pipeline that decoded them (decode's)."""
    request, record, decision = job.request, job.record, job.plan.step_cache
    mode = request.mode or "txt2img"
    controls, beside = job.inputs.controls, controlnets or []
    adapter = references(loaded)
    pipe = control.control_pipe(loaded, mode, beside) if controls else loaded.pipe_for(mode)
    steps = denoising_steps(request)
    shape = (request.width or 0, request.height or 0, request.num_images)
    record.cold = record.cold or shape not in loaded.warm_shapes
    split, record.partial_blocks = loaded.partial, None
    if split is not None:
        record.partial_blocks = PartialBlocks(resident=split.resident, streamed=split.streamed)
    dev.reset_peak(info)

    # 1. Text encode
    with job.watch.phase("text_encode"):
        job.ctx.progress("text_encode", 0, steps)
        faults.check("text_encode", loaded.rung)
        text = _encode(loaded, pipe, job, adapter)

    # 2. The first pass: denoise to latents, then decode them. The step callback reports
    #    progress (with a preview at each quarter when the request asks and the model has TAESD,
    #    or is a video family whose latents project to RGB: _preview_image) and honours a stop
    #    request; out of memory in decode keeps the latents for the decode rules.
    wanted = request.previews and (
        loaded.preview_vae is not None or latent_preview.previews(loaded)
    )
    previews = preview_steps(steps) if wanted else set()
    spec = decision.spec
    cache = StepCache(loaded.denoiser, spec, pipe, steps) if spec is not None else None
    reporter = StepReporter(job, store, cache)
    engaged = functools.partial(_engaged, loaded, job, cache, beside, adapter)
    on_step = reporter.callback(loaded, steps, previews)
    first = first_pass(loaded, pipe, job, text, on_step, adapter is not None)
    latents, images, decoded = run_pass(first, loaded, job, faults, decode, engaged)
    record.per_step_s = job.watch.seconds.get("denoise", 0.0) / steps  # the first pass's
    if request.hires is not None:
        # 3. A hires pass: larger, then img2img at that size on the pipeline that decoded.
        adapter = references(decoded)  # a lower rung's own after a decode descent
        start = hires_start(decoded, job, latents, images, upscaler)
        second = hires_pass(decoded, job, text, start, reporter.callback, adapter is not None)
        engaged = functools.partial(reference.engaged, decoded, adapter, _strength(request))
        _latents, images, decoded = run_pass(second, decoded, job, faults, decode, engaged)
    record.ran_on(decoded)  # a lower rung's after a decode descent, as the result will say
    record.settings = record.settings.model_copy(deep=True)  # the job's note, not the load's
    record.settings.add(decision.kind, "step_cache", decision.reason)
    record.step_cache = cache.report() if cache is not None else None
    record.peak_memory_bytes = dev.peak_bytes(info)
    return images, decoded


def _encode(
    loaded: LoadedPipeline, pipe: Any, job: JobRun, adapter: reference.ReferenceAdapter | None
) -> TextEmbeds:
    """The prompt (and an edit's image) as the family's pipeline takes them, with the reference
    image's IP-Adapter embeddings when the job has one."""
    request, sources = job.request, job.inputs.sources
    count, guidance = request.num_images, float(request.guidance or 0.0)
    cfg = cfg_active(loaded.manifest.family, guidance, request.true_cfg)
    edited = sources.get("image") if request.mode == "edit" else None
    prompt = Prompt(
        request.prompt,
        request.negative_prompt,
        count,
        cfg,
        loaded.manifest.max_sequence_length,
        image=edited,
    )
    embeds = loaded.spec.encode(pipe, loaded.execution_device, prompt)
    if adapter is not None and job.inputs.reference is not None:
        embeds["ip_adapter_image_embeds"] = reference.image_embeds(
            loaded, adapter, job.inputs.reference, count, cfg
        )
    return TextEmbeds(embeds, cfg, guidance)


@contextmanager
def _engaged(
    loaded: LoadedPipeline,
    job: JobRun,
    cache: StepCache | None,
    nets: list[torch.nn.Module],
    adapter: reference.ReferenceAdapter | None,
) -> Iterator[None]:
    """Around the first pass's denoise: the step cache, the ControlNets on the device where the
    rung onloads, the controls' seeded RNG, the reference's IP-Adapter."""
    with (
        cache if cache is not None else nullcontext(),
        loaded.rung_spec.onloaded(nets, loaded.execution_device),
        control.seeded_call(loaded, job.inputs.controls, int(job.request.seed or 0)),
        reference.engaged(loaded, adapter, _strength(job.request)),
    ):
        yield


@dataclass(frozen=True)
class StepReporter:
    """What a pass's step callback reports to: the job (its record, progress and stop
    requests), the store its previews go to, the step cache it tells of each step's end."""

    job: JobRun
    store: Store
    cache: StepCache | None

    def callback(self, loaded: LoadedPipeline, total: int, previews: set[int]) -> StepCallback:
        """The step callback of a pass of total steps on loaded, previewing at previews."""

        def on_step(_pipe: Any, step: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            ctx, record = self.job.ctx, self.job.record
            record.steps_denoised += 1
            if self.cache is not None:
                self.cache.step_ended()
            preview = None
            if step + 1 in previews:
                preview = _preview(loaded, tensors["latents"], self.job, self.store)
            shown = total
            if self.job.request.sampler is not None:
                # A second-order sampler (heun, dpmpp_sde) calls back at each of its model
                # evaluations: the pipeline's timesteps, not the request's steps.
                shown = max(int(getattr(_pipe, "_num_timesteps", 0) or 0), total)
            done = min(step + 1, shown)  # PNDM calls back 51 times for 50 steps
            ctx.progress("denoise", done, shown, preview)
            crash_point("denoise")
            if ctx.stop_requested():
                raise JobStopped(f"job {ctx.job_id} stopped at step {done}/{shown} on request")
            return tensors

        return on_step


def hires_start(
    loaded: LoadedPipeline,
    job: JobRun,
    latents: torch.Tensor,
    images: list[Image.Image],
    upscaler: HiresUpscaler | None,
) -> Any:
    """The first pass's result made hires.scale times larger: an upscaler model's pixels, or
    its latents (upscaler None: "latent", bilinear, as A1111's Latent), in the upscale phase."""
    request = job.request
    size = hires_size(request)
    if upscaler is not None:
        return upscaler(images, size)
    with job.watch.phase("upscale"):
        return hires_latents(loaded, latents, (request.width or 0, request.height or 0), size)


def hires_latents(
    loaded: LoadedPipeline, latents: torch.Tensor, base: tuple[int, int], size: tuple[int, int]
) -> torch.Tensor:
    """The first pass's latents at the hires size, as the family's img2img takes them for its
    image: (B, C, H, W), FLUX.1's unpacked from their 2x2 patch tokens first."""
    import torch.nn.functional as F

    pipe = loaded.pipe
    if loaded.manifest.family_row.packed_latents:  # 2x2 patch tokens (FLUX.1)
        latents = pipe._unpack_latents(latents, base[1], base[0], pipe.vae_scale_factor)
    scale = pipe.vae_scale_factor
    cells = (size[1] // scale, size[0] // scale)
    return F.interpolate(latents.float(), size=cells, mode="bilinear").to(latents.dtype)


def _strength(request: RenderRequest) -> float:
    """The reference's IP-Adapter strength (resolve_request fills it in)."""
    return float(request.reference.strength or 0.0) if request.reference is not None else 0.0


def _preview(
    loaded: LoadedPipeline, latents: torch.Tensor, job: JobRun, store: Store
) -> str | None:
    """Decode and store a preview (its uri); one that fails is logged and skipped, never fatal."""
    try:
        image = _preview_image(loaded, latents, job.request)
        uri = store.save_preview(job.ctx.job_id, image)
    except Exception as exc:
        log.warning("preview failed for job %s: %s", job.ctx.job_id, exc)
        return None
    job.record.previews += 1
    return uri


def _preview_image(
    loaded: LoadedPipeline, latents: torch.Tensor, request: RenderRequest
) -> Image.Image:
    """TAESD's decode where the model has one, else a video family's latents projected to RGB
    at the job's size (no TAESD exists for its VAE in kiln)."""
    if loaded.preview_vae is not None:
        return decode_preview(loaded.pipe, loaded.preview_vae, latents)
    size = (request.width or 0, request.height or 0)
    return latent_preview.project(loaded.pipe, latents, *size, request.frames or 1)


def apply_loras(loaded: LoadedPipeline, job: JobRun, streams: bool) -> frozenset[str]:
    """The request's adapters into the pipeline's slots at their weights (the load phase:
    it is the adapters' load), every slot the job does not use at 0."""
    choices = job.request.loras or []
    job.record.loras = list(choices)
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
        with job.watch.phase("load"):
            slots.apply(choices)
    return frozenset(c.name for c in choices)
