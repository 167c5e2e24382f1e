"""A request against its manifest: defaults filled in, every limit checked, the worker's
servable models; shared by the client (before enqueueing) and the worker (never trust the queue).
Each rule names its field, value and limit in its own words (RequestRejected)."""

from __future__ import annotations

import math
import random

from api_client.controls import resolve_controls
from api_client.errors import Problem, RequestRejected, short
from api_client.families import families_with
from api_client.loras import resolve_loras
from api_client.manifest import DEFAULT_STRENGTH, Manifest
from api_client.references import resolve_reference
from api_client.schema import (
    IMAGE_FORMATS,
    MAX_FPS,
    MAX_IMAGES,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    VIDEO_FORMATS,
    VIDEO_MODES,
    HiresRequest,
    Mode,
    OutputFormat,
    RenderRequest,
)
from api_client.step_caches import partway_refusal


def resolve_request(request: RenderRequest, manifest: Manifest) -> RenderRequest:
    """Fill defaults from the manifest and check every limit; RequestRejected names each break.

    Nothing is clamped: a value over its limit is an error, not a quietly smaller job.
    """
    if request.model != manifest.id:
        raise RequestRejected(
            [Problem("model", request.model, f"does not match manifest {manifest.id!r}")]
        )
    if not manifest.family_row.prompted:
        return _resolve_upscale(request, manifest)
    problems: list[Problem] = []
    steps = manifest.steps.default if request.steps is None else request.steps
    guidance = manifest.guidance.default if request.guidance is None else request.guidance
    default_w, default_h = manifest.default_size
    width = default_w if request.width is None else request.width
    height = default_h if request.height is None else request.height
    seed = random.randint(0, MAX_SEED) if request.seed is None else request.seed

    if not request.prompt.strip():
        problems.append(Problem("prompt", request.prompt, "must not be empty"))
    for field in ("prompt", "negative_prompt"):
        text: str = getattr(request, field)
        if len(text) > MAX_PROMPT_CHARS:
            problems.append(
                Problem(field, f"<{len(text)} chars>", f"exceeds {MAX_PROMPT_CHARS} characters")
            )
        elif "\x00" in text:
            problems.append(Problem(field, text[:40], "must not contain NUL characters"))
    if not 1 <= steps <= manifest.steps.max:
        problems.append(
            Problem("steps", steps, f"must be between 1 and {manifest.steps.max} (manifest max)")
        )
    if not math.isfinite(guidance) or not 0 <= guidance <= manifest.guidance.max:
        hint = "; its CFG is true_cfg" if manifest.true_cfg is not None else ""
        problems.append(
            Problem(
                "guidance",
                guidance,
                f"must be between 0 and {manifest.guidance.max} (manifest cap{hint})",
            )
        )
    true_cfg = _true_cfg(request, manifest, problems)
    problems += _negative_prompt_problems(request, manifest, guidance, true_cfg)
    mode, strength = _mode(request, manifest, steps, problems)
    if (width, height) not in {tuple(size) for size in manifest.resolutions}:
        allowed = ", ".join(f"{w}x{h}" for w, h in manifest.resolutions)
        problems.append(Problem("width x height", f"{width}x{height}", f"must be one of {allowed}"))
    if not 0 <= seed <= MAX_SEED:
        problems.append(Problem("seed", seed, f"must be between 0 and {MAX_SEED}"))
    if not 1 <= request.num_images <= MAX_IMAGES:
        problems.append(
            Problem("num_images", request.num_images, f"must be between 1 and {MAX_IMAGES}")
        )
    problems += _pin_problems(request, manifest)
    if request.step_cache:
        spec = manifest.step_cache
        why = "its manifest declares no step_cache" if spec is None else partway_refusal(spec, mode)
        if why is not None:
            problems.append(Problem("step_cache", True, f"model {manifest.id}: {why}"))
    loras = resolve_loras(request.loras, manifest.loras, manifest.id, problems)
    controls = resolve_controls(
        request.controls, manifest.controlnets, manifest.id, manifest.family, mode, problems
    )
    reference = resolve_reference(
        request.reference, manifest.ip_adapter, manifest.id, manifest.family, mode, problems
    )
    hires = _hires(request, manifest, mode, (width, height), problems)
    frames, fps, output_format = _video(request, manifest, problems)
    problems += _sampler_problems(request, manifest, mode)
    if problems:
        raise RequestRejected(problems, model=manifest.id)
    return request.model_copy(
        update={
            "steps": steps,
            "guidance": float(guidance),
            "true_cfg": true_cfg,
            # txt2img stays unset, so a prompt-only request reads as it did before modes.
            "mode": None if mode == "txt2img" else mode,
            "strength": strength,
            "loras": loras,
            "controls": controls,
            "reference": reference,
            "hires": hires,
            "width": width,
            "height": height,
            "seed": seed,
            "frames": frames,
            "fps": fps,
            "output_format": output_format,
        }
    )


def _mode(
    request: RenderRequest, manifest: Manifest, steps: int, problems: list[Problem]
) -> tuple[str, float | None]:
    """The request's mode (by default from its image and mask), what it needs given, and its
    strength; problems name each break. The references' own form is checked here too, without
    reading them (api_client.inputs.parse_ref): that needs Redis or the store."""
    from api_client.inputs import InputRefused, parse_ref

    image, mask = request.image, request.mask
    # An edit model's image is an edit's: it serves no img2img; a video model's, a first frame.
    video = manifest.family_row.video
    given = "edit" if "edit" in manifest.modes else "img2video" if video else "img2img"
    mode = request.mode or ("inpaint" if mask else given if image else _from_prompt(manifest))
    if mode not in manifest.modes:
        rule = f"must be one of {', '.join(manifest.modes)} (manifest {manifest.id}'s modes)"
        problems.append(Problem("mode", mode, rule))
    needs = {
        "img2img": ("image",),
        "inpaint": ("image", "mask"),
        "edit": ("image",),
        "img2video": ("image",),
    }.get(mode, ())
    for field, value in (("image", image), ("mask", mask)):
        if value is None and field in needs:
            problems.append(
                Problem(
                    field, None, f"mode {mode} needs {'an' if field == 'image' else 'a'} {field}"
                )
            )
        elif value is not None and field not in needs:
            problems.append(Problem(field, short(value, 60), f"mode {mode} takes no {field}"))
        elif value is not None:
            try:
                parse_ref(value, field)
            except InputRefused as exc:
                problems.append(exc.problem)
    if mode in ("txt2img", "edit", *VIDEO_MODES):
        # The edit and video pipelines denoise from noise with the image as context (img2video's
        # is its first frame): nothing to re-noise.
        if request.strength is not None:
            problems.append(Problem("strength", request.strength, f"mode {mode} takes none"))
        return mode, None
    strength = DEFAULT_STRENGTH if request.strength is None else request.strength
    if not math.isfinite(strength) or not 0 < strength <= 1:
        problems.append(Problem("strength", strength, "must be above 0 and at most 1"))
    elif int(steps * strength) < 1:
        rule = f"with {steps} steps re-noises {steps * strength:g} of them; needs at least 1"
        problems.append(Problem("strength", strength, rule))
    return mode, float(strength)


def _from_prompt(manifest: Manifest) -> Mode:
    return "txt2video" if manifest.family_row.video else "txt2img"


def _video(
    request: RenderRequest, manifest: Manifest, problems: list[Problem]
) -> tuple[int | None, int | None, OutputFormat]:
    """A video model's frames, fps and container (mp4 unless the request names one); an image
    model's format. A field of the other kind is refused, naming it."""
    row, fmt = manifest.family_row, request.output_format
    if not row.video:
        for field in ("frames", "fps"):
            if getattr(request, field) is not None:
                why = f"model {manifest.id} makes images; {field} is a video model's"
                problems.append(Problem(field, getattr(request, field), why))
        if fmt not in IMAGE_FORMATS:
            rule = f"model {manifest.id} makes images: {', '.join(IMAGE_FORMATS)}"
            problems.append(Problem("output_format", fmt, rule))
        return None, None, fmt
    assert manifest.frames is not None and manifest.fps is not None  # the manifest's rule
    frames = manifest.frames.default if request.frames is None else request.frames
    off_rule = row.frames_refusal(frames)
    if off_rule is not None:
        problems.append(Problem("frames", frames, off_rule))
    elif not 1 <= frames <= manifest.frames.max:
        problems.append(
            Problem("frames", frames, f"must be at most {manifest.frames.max} (manifest max)")
        )
    fps = manifest.fps if request.fps is None else request.fps
    if not 1 <= fps <= MAX_FPS:
        problems.append(Problem("fps", fps, f"must be between 1 and {MAX_FPS}"))
    if "output_format" not in request.model_fields_set:
        fmt = "mp4"
    elif fmt not in VIDEO_FORMATS:
        rule = f"model {manifest.id} makes videos: {', '.join(VIDEO_FORMATS)}"
        problems.append(Problem("output_format", fmt, rule))
    if request.num_images != 1:
        why = f"model {manifest.id} makes one video a job; submit one job a video"
        problems.append(Problem("num_images", request.num_images, why))
    return frames, fps, fmt


MAX_HIRES_SCALE = 4.0
# The contract's defaults (docs/contract.md): strength 0.35 keeps the first pass's composition
# (A1111's own default is 0.7), over half the model's default steps.
DEFAULT_HIRES_STRENGTH = 0.35
MAX_UPSCALED = 8192 * 8192  # pixels an upscale makes: 1 GB of float RGB and weights on the device


def _hires(
    request: RenderRequest,
    manifest: Manifest,
    mode: str,
    size: tuple[int, int],
    problems: list[Problem],
) -> HiresRequest | None:
    """The hires pass with its defaults filled in; problems name each break. Whether a named
    upscaler is served is check_upscaler's (it needs every manifest)."""
    hires = request.hires
    if hires is None:
        return None
    if mode != "txt2img":
        problems.append(Problem("hires", f"mode {mode}", "a hires pass follows txt2img only"))
        return None
    if "img2img" not in manifest.modes:
        rule = f"its second pass is img2img, which model {manifest.id}'s modes do not list"
        problems.append(Problem("hires", manifest.id, rule))
        return None
    before = len(problems)
    row = manifest.family_row
    scale, grid = hires.scale, row.grid
    if not math.isfinite(scale) or not 1 < scale <= MAX_HIRES_SCALE:
        rule = f"must be above 1 and at most {MAX_HIRES_SCALE:g}"
        problems.append(Problem("hires.scale", scale, rule))
    else:
        final = [side * scale for side in size]
        if any(not side.is_integer() or side % grid for side in final):
            rule = (
                f"{size[0]}x{size[1]} times {scale:g} is {final[0]:g}x{final[1]:g}; both sides"
                f" must land on the {manifest.family} grid of {grid} px"
            )
            problems.append(Problem("hires.scale", scale, rule))
    strength = DEFAULT_HIRES_STRENGTH if hires.strength is None else hires.strength
    # Default: half the model's default steps, and at least enough to re-noise one at strength.
    fewest = math.ceil(1 / strength) if math.isfinite(strength) and 0 < strength <= 1 else 1
    least = max(manifest.steps.default // 2, fewest)
    second = least if hires.steps is None else hires.steps
    if not math.isfinite(strength) or not 0 < strength <= 1:
        problems.append(Problem("hires.strength", strength, "must be above 0 and at most 1"))
    elif not 1 <= second <= manifest.steps.max:
        rule = f"must be between 1 and {manifest.steps.max} (manifest max)"
        problems.append(Problem("hires.steps", second, rule))
    elif int(second * strength) < 1:
        rule = f"with {second} steps re-noises {second * strength:g} of them; needs at least 1"
        problems.append(Problem("hires.strength", strength, rule))
    upscaler = hires.upscaler or "latent"
    if upscaler == "latent" and not row.latent_hires:
        rule = (
            f"family {manifest.family}'s img2img takes no latents; name an upscaler manifest"
            f" (latent upscaling: {', '.join(families_with('latent_hires'))})"
        )
        problems.append(Problem("hires.upscaler", upscaler, rule))
    if len(problems) > before:
        return None
    return HiresRequest(
        scale=float(scale), strength=float(strength), steps=second, upscaler=upscaler
    )


def hires_size(request: RenderRequest) -> tuple[int, int]:
    """A resolved hires request's final size (its scale of the request's, on the grid)."""
    assert request.hires is not None and request.width and request.height
    scale = request.hires.scale
    return round(request.width * scale), round(request.height * scale)


def check_upscaler(request: RenderRequest, manifests: dict[str, Manifest]) -> None:
    """RequestRejected unless a hires pass's named upscaler is an upscaler manifest here (one
    that serves mode upscale)."""
    upscaler = request.hires.upscaler if request.hires is not None else None
    if upscaler in (None, "latent"):
        return
    found = manifests.get(upscaler or "")
    if found is None or "upscale" not in found.modes:
        known = sorted(m.id for m in manifests.values() if "upscale" in m.modes)
        rule = f"must be latent or an upscaler manifest: {', '.join(known) or 'none served'}"
        raise RequestRejected([Problem("hires.upscaler", upscaler, rule)], model=request.model)


def _resolve_upscale(request: RenderRequest, manifest: Manifest) -> RenderRequest:
    """An upscaler's request: its image, at the image's size, one image out, and nothing a
    diffusion request sets (a replay's pins excepted: rung full, compile and step cache off)."""
    from api_client.inputs import InputRefused, parse_ref

    problems: list[Problem] = []
    mode = request.mode or "upscale"
    if mode != "upscale":
        rule = f"must be upscale (model {manifest.id} is an upscaler)"
        problems.append(Problem("mode", mode, rule))
    if request.image is None:
        problems.append(Problem("image", None, "mode upscale needs an image"))
    else:
        try:
            parse_ref(request.image, "image")
        except InputRefused as exc:
            problems.append(exc.problem)
    unused = {
        "prompt": bool(request.prompt),
        "negative_prompt": bool(request.negative_prompt),
        "steps": request.steps not in (None, manifest.steps.default),
        "guidance": request.guidance not in (None, manifest.guidance.default),
        "true_cfg": request.true_cfg is not None,
        "mask": request.mask is not None,
        "strength": request.strength is not None,
        "loras": bool(request.loras),
        "controls": bool(request.controls),
        "reference": request.reference is not None,
        "hires": request.hires is not None,
        "previews": request.previews,
        "rung": request.rung not in (None, "full"),
        "compile": bool(request.compile),
        "step_cache": bool(request.step_cache),
        "sampler": request.sampler is not None,
        "sigmas": request.sigmas is not None,
    }
    for field, given in unused.items():
        if given:
            value = short(getattr(request, field), 60)
            problems.append(Problem(field, value, f"mode upscale takes no {field}"))
    width, height = request.width, request.height
    if width is None or height is None:
        rule = "mode upscale needs the image's size (the client reads it from the image)"
        problems.append(Problem("width x height", f"{width}x{height}", rule))
    elif width < 1 or height < 1 or width * height * (manifest.scale or 1) ** 2 > MAX_UPSCALED:
        side = math.isqrt(MAX_UPSCALED)
        rule = (
            f"makes {width * (manifest.scale or 1)}x{height * (manifest.scale or 1)}; an upscale"
            f" makes at most {side}x{side} pixels (its output is held whole on the device)"
        )
        problems.append(Problem("width x height", f"{width}x{height}", rule))
    if request.num_images != 1:
        rule = "must be 1: an upscale makes one image of one"
        problems.append(Problem("num_images", request.num_images, rule))
    if problems:
        raise RequestRejected(problems, model=manifest.id)
    return request.model_copy(
        update={
            "mode": "upscale",
            "steps": manifest.steps.default,
            "guidance": manifest.guidance.default,
            "seed": 0,  # an upscaler draws no noise
        }
    )


def _sampler_problems(request: RenderRequest, manifest: Manifest, mode: str) -> list[Problem]:
    """The request's sampler against those its manifest takes (its family's, or fewer), its
    sigmas against those the sampler takes on the family, and a sampler that runs from noise
    only against a mode or a hires pass that starts part-way (api_client.samplers)."""
    sampler, sigmas, row = request.sampler, request.sigmas, manifest.family_row
    if sampler is None:
        if sigmas is None:
            return []
        rule = "a sigma schedule is a sampler's: name the sampler too"
        return [Problem("sigmas", sigmas, f"{rule} ({_samplers_taken(manifest)})")]
    if sampler not in manifest.samplers:
        return [Problem("sampler", sampler, _samplers_taken(manifest))]
    problems = []
    if sigmas is not None and sigmas not in row.sigmas_for(sampler):
        rule = f"sampler {sampler} on {manifest.family} takes {', '.join(row.sigmas_for(sampler))}"
        problems.append(Problem("sigmas", sigmas, rule))
    partway = "a hires pass" if request.hires is not None else mode
    if sampler in row.txt2img_only and partway in ("img2img", "inpaint", "a hires pass"):
        rule = f"runs from noise only on {manifest.family}, and {partway} starts part-way:"
        problems.append(Problem("sampler", sampler, f"{rule} {row.txt2img_only[sampler]}"))
    return problems


def _samplers_taken(manifest: Manifest) -> str:
    """The samplers a model takes, in words for a refusal."""
    if not manifest.samplers:
        return f"model {manifest.id} takes no sampler"
    return f"model {manifest.id} takes {', '.join(manifest.samplers)}"


def _true_cfg(request: RenderRequest, manifest: Manifest, problems: list[Problem]) -> float | None:
    """The request's true CFG scale, the manifest's default, or None where the model has none."""
    allowed = manifest.true_cfg
    if allowed is None:
        if request.true_cfg is not None:
            problems.append(
                Problem("true_cfg", request.true_cfg, f"model {manifest.id} has no true CFG")
            )
        return None
    value = allowed.default if request.true_cfg is None else request.true_cfg
    if not math.isfinite(value) or not 1 <= value <= allowed.max:
        problems.append(
            Problem(
                "true_cfg",
                value,
                f"must be between 1 (off) and {allowed.max} (manifest cap)",
            )
        )
    return float(value)


def _negative_prompt_problems(
    request: RenderRequest, manifest: Manifest, guidance: float, true_cfg: float | None
) -> list[Problem]:
    """A negative prompt steers only through the family's CFG; without it, it would be ignored."""
    if not request.negative_prompt.strip():
        return []
    rule = manifest.family_row.cfg
    value = guidance if rule.field == "guidance" else true_cfg
    if value is not None and value > rule.above:
        return []
    if value is None:
        why = f"model {manifest.id} has no true CFG (its manifest allows no true_cfg)"
    else:
        why = f"{rule.field} is {value:g}; the negative prompt needs {rule.field} above"
        why += f" {rule.above:g} on {manifest.id}, or it has no effect"
    return [Problem("negative_prompt", request.negative_prompt[:40], why)]


def _pin_problems(request: RenderRequest, manifest: Manifest) -> list[Problem]:
    """A replay's compile pin against its rung and the manifest: torch.compile runs only at full
    (offload hooks and Inductor conflict), never where the manifest switches it off, and always
    where the manifest requires it at full."""
    if request.compile is True and request.rung not in (None, "full"):
        why = f"compile runs only at rung full, and the request pins rung {request.rung}"
        return [Problem("compile", True, why)]
    if request.compile is True and manifest.compile == "off":
        return [Problem("compile", True, f"model {manifest.id}'s manifest switches compile off")]
    if request.compile is False and request.rung == "full" and manifest.compile == "required":
        why = f"model {manifest.id}'s manifest requires compile at rung full (compile: required)"
        return [Problem("compile", False, why)]
    return []


def check_servable(request: RenderRequest, manifests: dict[str, Manifest]) -> Manifest:
    """The manifest a normal job may use, or RequestRejected naming the model."""
    manifest = manifests.get(request.model)
    if manifest is None:
        known = ", ".join(sorted(manifests)) or (
            "none published (publish them with `kiln manifests publish`, or start a worker)"
        )
        raise RequestRejected([Problem("model", request.model, f"unknown model; known: {known}")])
    if manifest.benchmark_only:
        raise RequestRejected(
            [
                Problem(
                    "model",
                    request.model,
                    "is benchmark_only: listed for `kiln bench`, refused for jobs",
                )
            ]
        )
    return manifest
