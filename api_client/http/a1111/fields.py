"""AUTOMATIC1111's txt2img and img2img bodies read onto a kiln RenderRequest (docs/contract.md,
"AUTOMATIC1111"). Each A1111 field is one of three kinds:

- mapped: prompt (its `<lora:name:weight>` tags become loras), negative_prompt, seed (-1:
  random), steps, cfg_scale (guidance), width, height, batch_size x n_iter (images),
  sampler_name / sampler_index and scheduler (api_client.samplers), the hires fields with
  enable_hr, override_settings.sd_model_checkpoint (the model), and img2img's init_images,
  mask, inpainting_mask_invert and denoising_strength;
- neutral: read as absent at A1111's neutral value (webuiapi sends every one of them on every
  call), refused by name at any other (NEUTRAL);
- kiln's own: any RenderRequest field may ride in the body and wins over the mapping.

Anything else is ignored, as A1111 itself ignores a field it does not know (forks such as Forge
add their own, and SillyTavern sends some). Refusals name A1111's field (cfg_scale, not
guidance)."""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from api_client.http.dialect import Refused
from api_client.manifest import Manifest
from api_client.samplers import A1111_SCHEDULERS, from_a1111
from api_client.schema import RenderRequest

KILN_FIELDS = frozenset(RenderRequest.model_fields)
# kiln's field -> A1111's name for it, for refusals (a kiln problem on `guidance` names cfg_scale)
A1111_NAMES = {
    "guidance": "cfg_scale",
    "num_images": "batch_size",
    "strength": "denoising_strength",
    "image": "init_images",
    "hires.scale": "hr_scale",
    "hires.strength": "denoising_strength",
    "hires.steps": "hr_second_pass_steps",
    "hires.upscaler": "hr_upscaler",
    "sampler": "sampler_name",
    "sigmas": "scheduler",
    "model": "sd_model_checkpoint",
}
LATENT = "Latent"  # A1111's latent hires upscaler; kiln's "latent"


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == v for v in values)


def _empty(value: Any) -> bool:
    return value is None or value in ([], {}, "")


_ZERO = _is(None, 0)
_FALSE = _is(None, False)
_NONE = _is(None, "", "None")
# Read as absent at these values; refused naming the field at any other.
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "eta": _is(None, 0, 1),
    "s_churn": _ZERO,
    "s_tmin": _ZERO,
    "s_tmax": _ZERO,
    "s_noise": _is(None, 1),
    "s_min_uncond": _ZERO,
    "subseed_strength": _ZERO,  # with it at 0, subseed is inert
    "seed_resize_from_h": _is(None, 0, -1),
    "seed_resize_from_w": _is(None, 0, -1),
    "restore_faces": _FALSE,
    "tiling": _FALSE,
    "styles": _empty,
    "script_name": _NONE,
    "script_args": _empty,
    "alwayson_scripts": _empty,
    "infotext": _NONE,
    "firstpass_image": _NONE,
    "refiner_checkpoint": _NONE,
    "refiner_switch_at": _is(None, 0, 1),
    "firstphase_width": _ZERO,
    "firstphase_height": _ZERO,
    "resize_mode": _ZERO,
    "initial_noise_multiplier": _is(None, 1),
    "latent_mask": _NONE,
}
# Read only with enable_hr; each at A1111's "the same as the first pass" when it is on.
HIRES_SAME: dict[str, Callable[[Any], bool]] = {
    "hr_resize_x": _ZERO,
    "hr_resize_y": _ZERO,
    "hr_checkpoint_name": _is(None, "", "Use same checkpoint"),
    "hr_sampler_name": _is(None, "", "Use same sampler"),
    "hr_scheduler": _is(None, "", "Use same scheduler"),
    "hr_additional_modules": lambda v: _empty(v) or v == ["Use same choices"],
    "hr_cfg": _is(None, 1),
    "hr_distilled_cfg": _is(None, 3.5),
}
HIRES = frozenset({"enable_hr", "hr_scale", "hr_upscaler", "hr_second_pass_steps", *HIRES_SAME})
HIRES_TEXT = ("hr_prompt", "hr_negative_prompt")  # empty or the first pass's: the same prompt
MAPPED = frozenset(
    {
        "prompt",
        "negative_prompt",
        "seed",
        "steps",
        "cfg_scale",
        "width",
        "height",
        "batch_size",
        "n_iter",
        "sampler_name",
        "scheduler",
        "override_settings",
        "init_images",
        "mask",
        "inpainting_mask_invert",
        *HIRES_TEXT,
    }
)
# override_settings a call may carry: the model, and two settings at the value kiln renders with.
OVERRIDES: dict[str, Callable[[Any], bool]] = {
    "CLIP_stop_at_last_layers": _is(None, 1),
    "sd_vae": _is(None, "Automatic", "None"),
}
LORA_TAG = re.compile(r"<lora:([^:>]+)(?::([-+]?\d*\.?\d+))?>")


@dataclass
class Reading:
    """A body read: the RenderRequest's fields, and what A1111's answer reports back."""

    mapped: dict[str, Any]
    sampler_name: str | None  # as the call named it (A1111's name), None: the model's default
    scheduler: str  # A1111's, "automatic" when the call named none
    image: bytes | None = None  # img2img's init image, decoded
    mask: bytes | None = None


def refuse(field: str, message: str, status: int = 422) -> Refused:
    return Refused(status, f"{field}: {message}", field, "invalid_field")


def model_of(body: dict[str, Any]) -> str | None:
    """The model the call names: kiln's `model`, else override_settings.sd_model_checkpoint."""
    if isinstance(body.get("model"), str):
        return str(body["model"])
    overrides = body.get("override_settings")
    named = overrides.get("sd_model_checkpoint") if isinstance(overrides, dict) else None
    return checkpoint(named) if isinstance(named, str) and named else None


def checkpoint(title: str) -> str:
    """A manifest id from an A1111 checkpoint title ("name [hash]" names the same model)."""
    return re.sub(r"\s*\[[0-9a-fA-F]*\]$", "", title.strip())


def read(body: dict[str, Any], manifest: Manifest, img2img: bool) -> Reading:
    """The body's fields onto a RenderRequest's (Refused naming the first field kiln cannot
    honour or does not know)."""
    _check_fields(body, img2img)
    mapped: dict[str, Any] = {"model": manifest.id}
    mapped.update(_text(body))
    for ours, theirs in (("steps", "steps"), ("guidance", "cfg_scale")):
        if body.get(theirs) is not None:
            mapped[ours] = body[theirs]
    if not img2img:
        mapped.update({k: body[k] for k in ("width", "height") if body.get(k) is not None})
    if body.get("seed") not in (None, -1):
        mapped["seed"] = body["seed"]
    mapped["num_images"] = _count(body, "batch_size") * _count(body, "n_iter")
    sampler_name, scheduler = _sampler(body, mapped)
    if body.get("enable_hr") is True and not img2img:
        mapped["hires"] = _hires(body)
    elif body.get("enable_hr") not in (None, False):
        raise refuse("enable_hr", f"{body['enable_hr']!r}: must be true or false (txt2img only)")
    if manifest.taesd:
        mapped["previews"] = True  # /progress shows the live preview as current_image
    mapped.update({k: v for k, v in body.items() if k in KILN_FIELDS and k not in MAPPED})
    if mapped.get("output_format", "png") != "png":
        raise refuse("output_format", "A1111's API answers PNG images: leave it out")
    reading = Reading(mapped, sampler_name, scheduler)
    if img2img:
        _img2img(body, reading)
    return reading


def _check_fields(body: dict[str, Any], img2img: bool) -> None:
    for name, value in body.items():
        if name in NEUTRAL and not NEUTRAL[name](value):
            rule = "kiln has no such setting; leave it out or at A1111's default"
            raise refuse(name, f"{str(value)[:60]!r}: {rule}")
        if not img2img and name in ("init_images", "mask", "inpainting_mask_invert"):
            raise refuse(name, "txt2img takes no input image: POST it to /sdapi/v1/img2img")
    overrides = body.get("override_settings")
    if overrides is not None and not isinstance(overrides, dict):
        raise refuse("override_settings", "must be an object")
    for key, value in (overrides or {}).items():
        if key != "sd_model_checkpoint" and not OVERRIDES.get(key, _is())(value):
            raise refuse(f"override_settings.{key}", f"{str(value)[:60]!r}: kiln cannot apply it")


def _text(body: dict[str, Any]) -> dict[str, Any]:
    """prompt and negative_prompt; the prompt's <lora:name:weight> tags as kiln's loras (unless
    disable_extra_networks), the tags themselves out of the text the encoder reads."""
    prompt, negative = body.get("prompt"), body.get("negative_prompt")
    out: dict[str, Any] = {}
    if prompt is not None:
        out["prompt"] = prompt
    if negative is not None:
        out["negative_prompt"] = negative
    if not isinstance(prompt, str) or body.get("disable_extra_networks") is True:
        return out
    tags = LORA_TAG.findall(prompt)
    if tags:
        out["prompt"] = LORA_TAG.sub("", prompt).strip()
        out["loras"] = [
            {"name": name.strip(), **({"weight": float(weight)} if weight else {})}
            for name, weight in tags
        ]
    return out


def _count(body: dict[str, Any], field: str) -> int:
    value = body.get(field)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise refuse(field, f"{str(value)[:40]!r}: must be a whole number of at least 1")
    return value


def _sampler(body: dict[str, Any], mapped: dict[str, Any]) -> tuple[str | None, str]:
    """kiln's sampler and sigmas from A1111's sampler_name (or sampler_index) and scheduler;
    (the sampler's A1111 name, the scheduler's)."""
    name = body.get("sampler_name") or body.get("sampler_index") or None
    scheduler = body.get("scheduler") or "automatic"
    for field, value in (("sampler_name", name), ("scheduler", scheduler)):
        if value is not None and not isinstance(value, str):
            raise refuse(field, f"{str(value)[:40]!r}: must be a name")
    if name is None:
        sigmas = A1111_SCHEDULERS.get(scheduler.lower(), "unknown")
        if sigmas == "unknown":
            known = ", ".join(repr(k) for k in A1111_SCHEDULERS)
            raise refuse("scheduler", f"{scheduler!r} is not one kiln runs; it runs {known}")
        if sigmas is not None:
            mapped["sigmas"] = sigmas
        return None, scheduler
    try:
        sampler, sigmas = from_a1111(name, scheduler)
    except ValueError as exc:
        field = "scheduler" if str(exc).startswith("scheduler") else "sampler_name"
        raise Refused(422, str(exc), field, "invalid_field") from None
    mapped["sampler"] = sampler
    if sigmas is not None:
        mapped["sigmas"] = sigmas
    return name, scheduler


def _hires(body: dict[str, Any]) -> dict[str, Any]:
    """enable_hr's fields as kiln's hires pass: hr_scale, denoising_strength, hr_second_pass_steps
    (0: kiln's default) and hr_upscaler (Latent, or an upscaler manifest's id)."""
    for name, same in HIRES_SAME.items():
        if name in body and not same(body[name]):
            raise refuse(name, f"{str(body[name])[:60]!r}: kiln's hires pass has no such setting")
    for name, first in zip(HIRES_TEXT, ("prompt", "negative_prompt"), strict=True):
        if body.get(name) not in (None, "", body.get(first)):
            raise refuse(name, "kiln's hires pass reads the first pass's prompt: leave it empty")
    scale = body.get("hr_scale")
    hires: dict[str, Any] = {"scale": 2.0 if scale is None else scale}  # A1111's default
    if body.get("denoising_strength") is not None:
        hires["strength"] = body["denoising_strength"]
    if body.get("hr_second_pass_steps"):
        hires["steps"] = body["hr_second_pass_steps"]
    upscaler = body.get("hr_upscaler") or LATENT
    # Latent, or an upscaler manifest's id: kiln's check names any other (R-ESRGAN 4x+, None).
    hires["upscaler"] = "latent" if upscaler == LATENT else upscaler
    return hires


def _img2img(body: dict[str, Any], reading: Reading) -> None:
    """init_images[0] and mask decoded (base64 or a data: URL), the mode and strength."""
    images = body.get("init_images")
    if not isinstance(images, list) or len(images) != 1:
        count = len(images) if isinstance(images, list) else 0
        raise refuse("init_images", f"give exactly one image (got {count}): kiln renders from one")
    reading.image = decode(images[0], "init_images")
    mapped = reading.mapped
    if body.get("denoising_strength") is not None and "strength" not in body:
        mapped["strength"] = body["denoising_strength"]
    if body.get("mask"):
        reading.mask = decode(body["mask"], "mask")
        invert = body.get("inpainting_mask_invert") or 0
        if invert not in (0, 1):
            raise refuse("inpainting_mask_invert", f"{invert!r}: must be 0 or 1")
        if invert:
            reading.mask = inverted(reading.mask)


def decode(value: Any, field: str) -> bytes:
    """An image as A1111 takes one: base64, bare or in a data: URL (never a URL to fetch)."""
    if not isinstance(value, str) or not value:
        raise refuse(field, "must be a base64 image or a data: URL")
    if value.startswith(("http://", "https://")):
        raise refuse(field, "kiln fetches no URL: send the image as base64 or a data: URL")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    try:  # base64 wrapped in lines, as some clients send it, is the same image
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError):
        raise refuse(field, "is not valid base64") from None


def inverted(mask: bytes) -> bytes:
    """inpainting_mask_invert 1: A1111 repaints the mask's black; kiln repaints white."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(mask)) as image:
            flipped = ImageOps.invert(image.convert("L"))
    except (UnidentifiedImageError, OSError, ValueError):
        return mask  # the upload's own check names what is wrong with it
    out = io.BytesIO()
    flipped.save(out, format="PNG")
    return out.getvalue()
