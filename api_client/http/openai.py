"""OpenAI's Images API on the gateway (`/openai/v1`): what the openai SDKs, Open WebUI's,
LibreChat's and LiteLLM's OpenAI engines send, mapped onto a kiln RenderRequest and run as a kiln
job (the same tokens, tenancy, quotas, queue, records and events).

A call is held open until the job's end event (api_client.http.held): no thread waits per call,
and a dropped connection leaves the job running (`kiln job ID` finds it). Errors leave in
OpenAI's shape, {"error": {message, type, param, code}}, `param` naming the field.

The mapping, as the README states it: model is a manifest id; n is num_images; size "WxH" (or
auto, the manifest's first size); quality auto/standard/medium keep the manifest's default
steps, low halves them, high and hd take one and a half times (within the manifest's max);
output_format png | jpeg | webp; background auto | opaque (transparent is refused: kiln renders
no alpha). Any RenderRequest field may ride in the same body (the SDK's extra_body) and wins over
the mapping. OpenAI fields kiln has no use for (user, style, moderation, output_compression) are
read and ignored; anything else is refused naming it.

Over 400 lines because the dialect reads as one: its routes share the mapping of OpenAI's fields
onto a RenderRequest, and the shapes of its answers, stream events and errors are the SDK's to
parse, so they stand together."""

from __future__ import annotations

import base64
import io
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api_client.client import KilnClient
from api_client.http import dialect, held
from api_client.http.auth import caller
from api_client.http.dialect import Refused
from api_client.http.tokens import Caller
from api_client.manifest import Manifest
from api_client.schema import JobEvent, RenderRequest, RenderResult

PREFIX = "/openai/v1"
QUALITY_STEPS = {"auto": 1.0, "standard": 1.0, "medium": 1.0, "low": 0.5, "high": 1.5, "hd": 1.5}
IGNORED = (
    "user",
    "style",
    "moderation",
    "output_compression",
    "input_fidelity",
    "safety_identifier",
)
OWN = (
    "model",
    "prompt",
    "n",
    "size",
    "quality",
    "response_format",
    "output_format",
    "background",
    "stream",
    "partial_images",
)
MAX_PARTIALS = 3
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
TYPES |= {404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error"}
TYPES |= {415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}

router = APIRouter(prefix=PREFIX, include_in_schema=False, dependencies=[Depends(caller)])


def speaks(request: Request) -> bool:
    """Whether a request is this dialect's: its errors leave in OpenAI's shape."""
    path: str = request.scope.get("path", "")
    return path == PREFIX or path.startswith(PREFIX + "/")


def error(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers or None)


# -- routes --------------------------------------------------------------------------------------


@router.get("/models")
def list_models(request: Request) -> dict[str, Any]:
    """Every manifest the gateway can see, served or not (OpenAI's model list shape)."""
    client: KilnClient = request.app.state.client
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "kiln"}
            for model_id, manifest in sorted(client.manifests().items())
            if not manifest.benchmark_only and not manifest.family_row.video
        ],
    }


@router.post("/images/generations", response_model=None)
async def generate(request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    """Render the prompt as a kiln job and answer when it ends: every image as b64_json or an
    absolute gateway URL; with stream, Server-Sent Events of partial images (the worker's
    previews) then one completed event an image."""
    body = await dialect.json_object(request)
    call = await run_in_threadpool(_submit, request, who, body)
    return await _answer(request, call, "image_generation")


@router.post("/images/edits", response_model=None)
async def edit(request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    """An image and a prompt (multipart, as the SDK sends them): an edit model edits, a mask
    makes an inpaint, else img2img, at the image's own size (kiln never resizes an input). A
    mask with an alpha channel follows OpenAI (fully transparent pixels are edited), one without
    follows kiln (white is repainted)."""
    body, files = await _form(request)
    call = await run_in_threadpool(_submit_edit, request, who, body, files)
    return await _answer(request, call, "image_edit")


async def _answer(request: Request, call: Call, kind: str) -> Response:
    """The call's answer once its job ends, or its event stream (kind: image_generation or
    image_edit, the events' type prefix)."""
    if call.stream:
        return StreamingResponse(
            _stream(request, call, kind),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
    result = await dialect.result(request, call.job_id)
    data = await run_in_threadpool(_images, request, call, result, call.b64)
    return JSONResponse(_response(call, data), headers={"Cache-Control": "no-store"})


# -- mapping -------------------------------------------------------------------------------------


class Call:
    """One accepted call: its job, and how the answer is shaped."""

    def __init__(self, job_id: str, body: dict[str, Any], size: str, output_format: str) -> None:
        self.job_id = job_id
        self.b64 = (body.get("response_format") or "b64_json") == "b64_json"
        self.stream = bool(body.get("stream"))
        self.partials = int(body.get("partial_images") or 0)
        self.quality = body.get("quality") or "auto"
        self.background = "opaque"
        self.size = size
        self.output_format = output_format
        self.created = int(time.time())


def _submit(request: Request, who: Caller, body: dict[str, Any]) -> Call:
    """The body as a RenderRequest, submitted for the caller (tenancy and quotas as on /v1)."""
    client: KilnClient = request.app.state.client
    manifest = _manifest(client, body.get("model"))
    mapped = to_request(body, manifest)
    dialect.require_served(client, manifest.id)
    job = dialect.submit(request, who, mapped)
    width, height = mapped.get("width"), mapped.get("height")
    if (width is None or height is None) and manifest.resolutions:
        width, height = manifest.default_size
    return Call(job.id, body, f"{width}x{height}", mapped.get("output_format", "png"))


def to_request(body: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
    """OpenAI's fields mapped onto a RenderRequest's; kiln's own fields in the body win."""
    kiln_fields = set(RenderRequest.model_fields)
    unknown = [k for k in body if k not in kiln_fields and k not in OWN and k not in IGNORED]
    if unknown:
        raise Refused(400, f"unknown parameter {unknown[0]!r}", unknown[0], "unknown_parameter")
    mapped: dict[str, Any] = {k: v for k, v in body.items() if k in kiln_fields}
    mapped["model"] = manifest.id
    if "n" in body and "num_images" not in body:
        mapped["num_images"] = body["n"]
    if "width" not in body and "height" not in body:
        mapped.update(_size(body.get("size"), manifest))
    if "steps" not in body and manifest.resolutions:
        mapped["steps"] = _steps(body.get("quality"), manifest)
    _check_choices(body)
    if "partial_images" in body and int(body.get("partial_images") or 0) > 0:
        mapped.setdefault("previews", True)
    return mapped


def _manifest(client: KilnClient, model: Any) -> Manifest:
    manifests = client.manifests()
    if not isinstance(model, str) or not model:
        raise Refused(400, "model is required: a kiln manifest id (GET /openai/v1/models)", "model")
    if model not in manifests:
        known = ", ".join(sorted(manifests)[:20])
        message = f"the model {model[:100]!r} does not exist; models here: {known}"
        raise Refused(404, message, "model", "model_not_found")
    return dialect.makes_images(manifests[model], "model")


def _size(size: Any, manifest: Manifest) -> dict[str, int]:
    if size in (None, "auto") or not manifest.resolutions:
        return {}
    sizes = ", ".join(f"{w}x{h}" for w, h in manifest.resolutions)
    try:
        width, height = (int(part) for part in str(size).lower().split("x"))
    except ValueError:
        rule = f"size {str(size)[:40]!r}: must be WxH, one of {sizes}, or auto"
        raise Refused(400, rule, "size") from None
    if (width, height) not in manifest.resolutions:
        raise Refused(400, f"size {size!r}: model {manifest.id} renders {sizes}", "size")
    return {"width": width, "height": height}


def _steps(quality: Any, manifest: Manifest) -> int:
    scale = QUALITY_STEPS.get(quality or "auto")
    if scale is None:
        choices = ", ".join(QUALITY_STEPS)
        raise Refused(400, f"quality {str(quality)[:40]!r}: must be one of {choices}", "quality")
    default, most = manifest.steps.default, manifest.steps.max
    return max(1, min(most, math.ceil(default * scale)))


def _check_choices(body: dict[str, Any]) -> None:
    checks = (
        ("response_format", ("b64_json", "url")),
        ("background", ("auto", "opaque")),
        ("partial_images", tuple(range(MAX_PARTIALS + 1))),
        ("stream", (True, False)),
    )
    for name, allowed in checks:
        value = body.get(name)
        if value is not None and value not in allowed:
            extra = " (kiln renders no alpha channel)" if value == "transparent" else ""
            shown = ", ".join(map(str, allowed))
            raise Refused(400, f"{name} {str(value)[:40]!r}: must be one of {shown}{extra}", name)


def param(field: str | None) -> str | None:
    """A kiln field as the dialect names it."""
    return {"num_images": "n", "width x height": "size"}.get(field or "", field)


# -- waiting and answering -----------------------------------------------------------------------


def _images(request: Request, call: Call, result: RenderResult, b64: bool) -> list[dict[str, Any]]:
    """Each image as OpenAI's data entry: its bytes base64, or this gateway's absolute URL."""
    base = str(request.base_url).rstrip("/")
    data = []
    for n, image in enumerate(result.images):
        if not b64:
            data.append({"url": f"{base}/v1/jobs/{call.job_id}/images/{n}", "revised_prompt": None})
            continue
        raw = dialect.image_bytes(call.job_id, n, image)
        data.append({"b64_json": base64.b64encode(raw).decode(), "revised_prompt": None})
    return data


def _usage() -> dict[str, Any]:
    details = {"image_tokens": 0, "text_tokens": 0}
    return {
        "input_tokens": 0,
        "input_tokens_details": details,
        "output_tokens": 0,
        "output_tokens_details": details,
        "total_tokens": 0,
    }


def _response(call: Call, data: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "created": call.created,
        "data": data,
        "background": call.background,
        "output_format": call.output_format,
        "quality": call.quality,
        "size": call.size,
        "usage": _usage(),
    }


async def _stream(request: Request, call: Call, kind: str) -> AsyncIterator[str]:
    """SSE of `data:` JSON events alone: up to partial_images partial images, from the worker's
    previews spread over the steps, then one completed event an image; a comment each quiet
    KEEPALIVE_S; a failure as an {"error": ...} event, which the SDK raises."""
    shown = 0
    result: RenderResult | None = None
    async for event in held.events(request, call.job_id):
        if event is None:
            yield ": keepalive\n\n"
        elif (
            event.kind == "preview" and shown < call.partials and _due(event, shown, call.partials)
        ):
            jpeg = event.preview.jpeg() if event.preview else None
            if jpeg is not None:
                yield _sse(_partial(call, kind, jpeg, shown))
                shown += 1
        elif event.kind == "done":
            result = event.result
        elif event.terminal:
            message = f"job {call.job_id} {event.kind}: {event.error or event.kind}"
            yield _sse(
                {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
            )
            return
    if result is None:
        return
    for item in await run_in_threadpool(_images, request, call, result, True):
        yield _sse(
            {
                "type": f"{kind}.completed",
                "b64_json": item["b64_json"],
                "created_at": call.created,
                "size": call.size,
                "quality": call.quality,
                "background": call.background,
                "output_format": call.output_format,
                "usage": _usage(),
            }
        )


def _due(event: JobEvent, shown: int, wanted: int) -> bool:
    """Whether this preview is the next of `wanted` spread evenly over the steps."""
    steps = event.steps or 0
    return not steps or (event.step or 0) >= (shown + 1) * steps / (wanted + 1)


def _partial(call: Call, kind: str, jpeg: bytes, index: int) -> dict[str, Any]:
    return {
        "type": f"{kind}.partial_image",
        "b64_json": base64.b64encode(jpeg).decode(),
        "partial_image_index": index,
        "created_at": call.created,
        "size": call.size,
        "quality": call.quality,
        "background": call.background,
        "output_format": "jpeg",  # a preview is the worker's TAESD JPEG
    }


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event)}\n\n"


# -- edits ---------------------------------------------------------------------------------------

# Form fields the SDK sends as text that a RenderRequest or OpenAI takes as numbers or booleans.
_TEXT_FIELDS = {
    name
    for name, field in RenderRequest.model_fields.items()
    if "str" in repr(field.annotation) or "Literal" in repr(field.annotation)
} | {"size", "quality", "response_format", "output_format", "background", "user"}


async def _form(request: Request) -> tuple[dict[str, Any], dict[str, list[bytes]]]:
    """The multipart body: its text fields (numbers and booleans read as JSON where the field
    takes them) and its files by field name (`image[]` counts as `image`)."""
    try:
        form = await request.form()
    except Exception as exc:  # python-multipart raises several types for a broken body
        raise Refused(400, f"the body must be multipart/form-data: {exc}", None) from None
    body: dict[str, Any] = {}
    files: dict[str, list[bytes]] = {}
    for name, value in form.multi_items():
        key = name.removesuffix("[]")
        if isinstance(value, str):
            body[key] = value if key in _TEXT_FIELDS else _scalar(value)
        else:
            files.setdefault(key, []).append(await value.read())
    return body, files


def _scalar(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (int, float, bool)) or value is None else text


def _submit_edit(
    request: Request, who: Caller, body: dict[str, Any], files: dict[str, list[bytes]]
) -> Call:
    """The edit as a kiln job: its image (and mask) kept as the caller's uploads, the mode from
    the manifest and the mask."""
    from api_client.http import tenancy

    client: KilnClient = request.app.state.client
    images = files.get("image", [])
    if len(images) != 1:
        raise Refused(400, f"give exactly one image (got {len(images)}): kiln edits one", "image")
    for name in ("image", "mask"):
        if name in body:
            raise Refused(400, f"{name} must be a file part of the form", name)
    manifest = _manifest(client, body.get("model"))
    mapped = to_request({k: v for k, v in body.items() if k != "size"}, manifest)
    quotas = request.app.state.quotas
    image_uri, found = tenancy.keep_upload(images[0], "image", who, client, quotas)
    mapped["image"] = image_uri
    if "width" not in body and "height" not in body:
        mapped.update(width=found.width, height=found.height)
    given = body.get("size")
    if given not in (None, "auto") and given != f"{found.width}x{found.height}":
        rule = f"size {str(given)[:40]!r}: the image is {found.width}x{found.height}, and kiln"
        raise Refused(400, rule + " never resizes an input (leave size out, or auto)", "size")
    if files.get("mask"):
        mask = kiln_mask(files["mask"][0])
        mapped["mask"] = tenancy.keep_upload(mask, "mask", who, client, quotas)[0]
    if "mode" not in body:
        mapped["mode"] = "edit" if "edit" in manifest.modes else _img_mode(mapped)
    dialect.require_served(client, manifest.id)
    job = dialect.submit(request, who, mapped)
    size = f"{mapped['width']}x{mapped['height']}"
    return Call(job.id, body, size, mapped.get("output_format", "png"))


def _img_mode(mapped: dict[str, Any]) -> str:
    return "inpaint" if "mask" in mapped else "img2img"


def kiln_mask(data: bytes) -> bytes:
    """A mask as kiln reads it (white repainted): OpenAI's, with alpha, has its fully
    transparent pixels edited; one without alpha is kiln's already."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            if "A" not in image.getbands():
                return data
            alpha = image.getchannel("A")
    except (UnidentifiedImageError, OSError, ValueError):
        return data  # its own check names what is wrong with it
    repaint = alpha.point(lambda value: 255 if value == 0 else 0)
    out = io.BytesIO()
    repaint.save(out, format="PNG")
    return out.getvalue()
