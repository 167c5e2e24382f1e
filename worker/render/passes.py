"""A pass of a job on a loaded pipeline, denoise then decode (run_pass), and the two passes a
job can run: its first at its own size (first_pass) and, for hires, a second at the larger size
from the first's result (hires_pass), with the same seeds and text embeddings.

The denoise and the decode are separate calls, each its own timed phase, fault-injected and
retried on its own: out of memory in decode retries the decode alone on the latents already
denoised (the ladder's decode rules, handed in as DecodeRules)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from api_client.resolve import hires_size
from api_client.schema import RenderRequest
from worker.crashes import crash_point
from worker.memory.faults import FaultPlan
from worker.pipelines import control, samplers
from worker.pipelines.resident import LoadedPipeline
from worker.pipelines.vae import tiled
from worker.render.job_run import JobRun

# A pipeline's callback_on_step_end: (pipeline, step, timestep, tensors) -> tensors.
StepCallback = Callable[[Any, int, Any, dict[str, Any]], dict[str, Any]]
# The step callback of a pass on a pipeline: (loaded, its steps, the steps that preview).
Stepper = Callable[[LoadedPipeline, int, set[int]], StepCallback]
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


@dataclass(frozen=True)
class TextEmbeds:
    """The job's encoded prompt, which both passes take: the pipeline's embedding arguments
    (with the reference's IP-Adapter embeddings), whether CFG runs, and the guidance."""

    embeds: dict[str, Any]
    cfg: bool
    guidance: float


@dataclass(frozen=True)
class Pass:
    """One pass of a job, denoise then decode (run_pass): the first pass, or a hires pass."""

    number: int  # 1, or 2 for a hires pass (the record's passes)
    pipe: Any  # the pipeline that denoises
    mode: str  # the mode whose pipeline decodes (LoadedPipeline.pipe_for)
    seen_as: str  # the mode as compile and novelty tell graphs apart (control.mode_key)
    size: tuple[int, int]  # (width, height) it renders at
    steps: int  # the steps it denoises: its progress's total
    cfg: bool  # whether CFG runs
    arguments: Callable[[], dict[str, Any]]  # the denoise call's, built in its denoise phase
    on_step: StepCallback
    # Drills count the first pass's decode tries as crash@decode points, not a hires pass's.
    crash_drill: bool = False


def run_pass(
    p: Pass,
    loaded: LoadedPipeline,
    job: JobRun,
    faults: FaultPlan,
    decode: DecodeRules,
    engaged: Callable[[], AbstractContextManager[Any]],
) -> tuple[torch.Tensor, list[Image.Image], LoadedPipeline]:
    """p on loaded: its denoise to latents in the denoise phase, the call inside engaged()
    (what it engages on the pipeline while it runs), then its decode under the decode rules.
    Returns its latents, its images and the pipeline that decoded them."""
    ctx, watch, family = job.ctx, job.watch, loaded.spec
    with watch.phase("denoise"):
        ctx.progress("denoise", 0, p.steps)
        faults.check("denoise", loaded.rung)
        call = {**p.arguments(), "callback_on_step_end": p.on_step}
        with engaged(), sampler_of(job, loaded, p.pipe):
            # The output's first field: images, or a video pipeline's frames.
            latents = p.pipe(**_accepted(p.pipe, call))[0]
        if p.pipe is not loaded.pipe:
            # Offload hooks belong to the resident pipeline: it moves every module back off the
            # device and re-arms them, as its own call does at the end (a no-op at full).
            loaded.pipe.maybe_free_model_hooks()
    loaded.warm_shapes.add((*p.size, job.request.num_images))  # whatever decode does
    loaded.cfg_seen.add(p.cfg)
    loaded.modes_seen.add(p.seen_as)

    def decode_on(on: LoadedPipeline, tile: bool) -> tuple[list[Image.Image], str]:
        with watch.phase("decode"):
            ctx.progress("decode", p.steps, p.steps)
            if p.crash_drill:
                crash_point("decode")
            faults.check("decode", on.rung)
            view = on.pipe_for(p.mode)
            with tiled(view.vae) if tile else nullcontext("untiled") as how:
                return family.decode(view, latents, *p.size), how

    job.record.passes = p.number
    images, decoded = decode(loaded, decode_on)
    return latents, images, decoded


def sampler_of(job: JobRun, loaded: LoadedPipeline, pipe: Any) -> AbstractContextManager[None]:
    """The job's sampler on the pipeline a pass calls (the resident one, or its img2img, inpaint
    or control view), its own scheduler put back when the call ends (worker.pipelines.samplers):
    a hires pass runs the same sampler as the first."""
    request = job.request
    return samplers.swapped(
        pipe, loaded.manifest.family_row, loaded.scheduler_config, request.sampler, request.sigmas
    )


def first_pass(
    loaded: LoadedPipeline,
    pipe: Any,
    job: JobRun,
    text: TextEmbeds,
    on_step: StepCallback,
    referenced: bool,
) -> Pass:
    """The job's own pass at its size, with its mode's inputs and its controls."""
    request, inputs = job.request, job.inputs
    family, controls, mode = loaded.spec, inputs.controls, request.mode or "txt2img"
    size, count = (request.width or 0, request.height or 0), request.num_images

    def arguments() -> dict[str, Any]:
        generators = _generators(job)
        call = {
            **text.embeds,
            **family.guidance(text.guidance, request.true_cfg),
            "num_inference_steps": int(request.steps or 1),
            "width": request.width,
            "height": request.height,
            "generator": generators,
            "output_type": "latent",
            **family.call(*size),
        }
        if request.frames is not None and request.fps is not None:  # a video model's
            call.update(family.video_call(request.frames, request.fps))
        call.update(inputs.sources)
        if request.strength is not None:  # img2img and inpaint; edit has none
            call["strength"] = request.strength
        if controls:
            call.update(control.call_arguments(pipe, controls))
            if family.control is not None and family.control.noise_first:
                call["latents"] = control.initial_latents(
                    loaded, text.embeds, count, *size, generators
                )
        return call

    seen_as = control.mode_key(mode, controls, referenced)
    steps = denoising_steps(request)
    return Pass(1, pipe, mode, seen_as, size, steps, text.cfg, arguments, on_step, True)


def hires_pass(
    loaded: LoadedPipeline,
    job: JobRun,
    text: TextEmbeds,
    start: Any,
    stepper: Stepper,
    referenced: bool,
) -> Pass:
    """img2img from start (the first pass's result made larger: generate.hires_start) at the hires
    size with the pass's strength and steps, on the pipeline that decoded the first pass, the
    same seeds and the same text embeddings."""
    request, hires = job.request, job.request.hires
    assert hires is not None and hires.strength is not None and hires.steps is not None
    family, size = loaded.spec, hires_size(request)
    steps = max(hires.steps - int(hires.steps - hires.steps * hires.strength), 1)

    def arguments() -> dict[str, Any]:
        return {
            **text.embeds,
            **family.guidance(text.guidance, request.true_cfg),
            "image": start,
            "strength": hires.strength,
            "num_inference_steps": hires.steps,
            "width": size[0],
            "height": size[1],
            "generator": _generators(job),
            "output_type": "latent",
        }

    pipe, seen_as = loaded.pipe_for("img2img"), control.mode_key("img2img", None, referenced)
    on_step = stepper(loaded, steps, set())
    return Pass(2, pipe, "img2img", seen_as, size, steps, text.cfg, arguments, on_step)


def _generators(job: JobRun) -> list[torch.Generator]:
    """One per image, on the CPU so a seed gives the same image on every device."""
    seed = int(job.request.seed or 0)
    return [torch.Generator("cpu").manual_seed(seed + i) for i in range(job.request.num_images)]


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
