"""The shapes AUTOMATIC1111's clients parse: a render's answer ({images, parameters, info},
info a JSON *string* whose infotexts are the "parameters" text each PNG carries, what A1111's
PNG Info reads) and its error object {"error", "detail", "body", "errors"}."""

from __future__ import annotations

import base64
import io
import json
import re
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from api_client.client import KilnClient
from api_client.errors import Problem
from api_client.http import dialect, tenancy
from api_client.http.a1111.fields import A1111_NAMES, Reading
from api_client.http.tokens import Caller
from api_client.schema import JobEvent, RenderResult

PREFIX = "/sdapi/v1"
NO_STORE = {"Cache-Control": "no-store"}


def speaks(request: Request) -> bool:
    """Whether a request is this dialect's: its errors leave in A1111's shape."""
    path: str = request.scope.get("path", "")
    return path == PREFIX or path.startswith(PREFIX + "/")


def named(field: str) -> str:
    """A kiln request field as A1111 names it (guidance -> cfg_scale)."""
    return A1111_NAMES.get(field, field)


def error(
    status: int,
    title: str,
    detail: str,
    problems: list[Problem] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A1111's error object: error (what kind), detail (the message, naming the field), body
    (the request body A1111 echoes; kiln echoes none: it may be megabytes of base64) and errors
    (each field broken, in A1111's names, and its rule)."""
    errors = "; ".join(f"{named(p.field)}: {p.rule}" for p in problems or []) or detail
    body = {"error": title, "detail": detail, "body": "", "errors": errors}
    return JSONResponse(body, status_code=status, headers=headers or None)


@dataclass
class Call:
    """One accepted txt2img or img2img call: its job, and the body as it was read."""

    job_id: str
    body: dict[str, Any]
    reading: Reading


def rendered(request: Request, who: Caller, call: Call, end: JobEvent) -> dict[str, Any]:
    """The answer to a call whose job ended: its PNGs (base64) and info; a job stopped by
    /interrupt or /skip answers no images, as A1111 answers an interrupted batch with what it
    finished; a failed job is a 500 with the worker's message (a tenant's without store paths)."""
    client: KilnClient = request.app.state.client
    if end.kind == "done" and end.result is not None:
        pngs = [dialect.image_bytes(call.job_id, n, i) for n, i in enumerate(end.result.images)]
        texts = [_parameters(png) for png in pngs]
        shown = pngs if call.body.get("send_images", True) is not False else []
        return {
            "images": [base64.b64encode(png).decode() for png in shown],
            "parameters": _parameters_echo(call.body),
            "info": json.dumps(info(call, end.result, texts)),
        }
    if end.kind == "stopped":
        queued = client.job(call.job_id).snapshot(eta=False).request
        stopped: dict[str, Any] = {
            "prompt": queued.prompt if queued else "",
            "negative_prompt": queued.negative_prompt if queued else "",
            "seed": queued.seed if queued else None,
            "all_seeds": [],
            "sd_model_name": queued.model if queued else None,
            "infotexts": [],
        }
        echo = _parameters_echo(call.body)
        return {"images": [], "parameters": echo, "info": json.dumps(stopped)}
    message = end.error or end.kind
    if not who.admin:
        message = tenancy.masked(message, client.stores())
    raise dialect.Refused(500, f"job {call.job_id} {end.kind}: {message}", None, "job_failed")


def info(call: Call, result: RenderResult, infotexts: list[str]) -> dict[str, Any]:
    """A1111's info for the job's images: image i of a batch is drawn from seed + i, in A1111
    and in kiln alike."""
    mapped, count = call.reading.mapped, len(result.images)
    prompt, negative = mapped.get("prompt", ""), mapped.get("negative_prompt", "")
    sampler = call.reading.sampler_name or _infotext_value(infotexts, "Sampler")
    hires = mapped.get("hires") or {}
    return {
        "prompt": prompt,
        "all_prompts": [prompt] * count,
        "negative_prompt": negative,
        "all_negative_prompts": [negative] * count,
        "seed": result.seed,
        "all_seeds": [result.seed + i for i in range(count)],
        "subseed": -1,
        "all_subseeds": [-1] * count,
        "subseed_strength": 0,
        "width": result.width,
        "height": result.height,
        "sampler_name": sampler,
        "scheduler": call.reading.scheduler,
        "cfg_scale": result.guidance,
        "steps": result.steps,
        "batch_size": count,
        "restore_faces": False,
        "face_restoration_model": None,
        "sd_model_name": result.model,
        "sd_model_hash": None,
        "sd_vae_name": None,
        "sd_vae_hash": None,
        "seed_resize_from_w": -1,
        "seed_resize_from_h": -1,
        "denoising_strength": hires.get("strength", mapped.get("strength")),
        "extra_generation_params": {},
        "index_of_first_image": 0,
        "infotexts": infotexts,
        "styles": [],
        "job_timestamp": result.started_at.strftime("%Y%m%d%H%M%S"),
        "clip_skip": 1,
        "is_using_inpainting_conditioning": mapped.get("mode") == "inpaint",
        "version": "kiln",
    }


def _parameters(png: bytes) -> str:
    """The A1111 "parameters" text the worker wrote into the PNG (worker/files/details.py)."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        text = getattr(image, "text", {}).get("parameters", "")
    return str(text)


def _infotext_value(infotexts: list[str], key: str) -> str | None:
    """One `Key: value` of an infotext's last line (what the worker says it ran)."""
    if not infotexts or not infotexts[0]:
        return None
    found = re.search(rf"(?:^|, ){re.escape(key)}: ([^,]+)", infotexts[0].splitlines()[-1])
    return found.group(1).strip() if found else None


def _parameters_echo(body: dict[str, Any]) -> dict[str, Any]:
    """The request as read, its input images left out (as A1111 does without
    include_init_images)."""
    return {k: (None if k in ("init_images", "mask") else v) for k, v in body.items()}
