"""What a tenant may send and what it is shown. Every `jobs` token is a tenant: it reuses only
inputs it made (its own uploads, its own jobs' images as kiln-output:<job id>/<n>; never a store
path), leaves the operator's pins alone (rung, compile, a step cache the workers switched off),
and sees its jobs with no store path, worker path or other tenant's job id in them. An `admin`
token is the operator: it may pin and name any store object.

Inline data: inputs become uploads here, charged to the caller's upload quota like any other
(api_client.http.quotas), so a queued job carries a 77-character reference, not megabytes."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from api_client import inputs, keys
from api_client.client import KilnClient
from api_client.errors import Problem, RequestRejected
from api_client.http.quotas import Quotas
from api_client.http.tokens import Caller, Tokens
from api_client.schema import (
    ImageFile,
    JobEvent,
    JobSnapshot,
    PreviewRef,
    RenderRequest,
    RenderResult,
    VideoFile,
    WorkerState,
)

# One rule for every store object a tenant may not name, whether or not it exists.
NOT_YOURS = (
    "names no image this token made: give kiln-output:<job id>/<n> of one of your finished jobs,"
    " a kiln-input: uri from your own upload (POST /v1/uploads) or a data: URL"
)
NOT_YOUR_UPLOAD = (
    "no upload of this token has this sha256 in Redis: it expired (KILN_INPUT_TTL_S) or was"
    " never uploaded with this token; upload it again"
)
PIN_RULE = "is the operator's to pin (an admin token); leave it out and the worker decides"
STORE_URI = re.compile(r"(?:file|s3)://[^\s'\"]+")
StoredFile = TypeVar("StoredFile", ImageFile, VideoFile)


def admit(
    request: RenderRequest, who: Caller, client: KilnClient, tokens: Tokens, quotas: Quotas
) -> RenderRequest:
    """The request as the caller may send it: pins refused for a tenant, every input checked
    against what the caller made, inline images kept as the caller's uploads. RequestRejected
    names every field refused; OverQuota when the inline images do not fit."""
    problems = [] if who.admin else _pins(request, client)

    def own(value: str, field: str) -> str:
        try:
            ref = inputs.parse_ref(value, field)
        except inputs.InputRefused as exc:
            problems.append(exc.problem)
            return value
        if ref.kind == "data":
            return keep_upload(ref.data or b"", field, who, client, quotas)[0]
        refused = None if who.admin else _not_made(ref, who, tokens, quotas)
        if refused is not None:
            problems.append(Problem(field, value, refused))
        return value

    admitted = _map_inputs(request, own)
    if problems:
        raise RequestRejected(problems, model=request.model)
    return admitted


def keep_upload(
    data: bytes, field: str, who: Caller, client: KilnClient, quotas: Quotas
) -> tuple[str, inputs.InputImage]:
    """Check an input image, charge it to the caller, and keep it in Redis for KILN_INPUT_TTL_S:
    its kiln-input: uri and what the check found. RequestRejected names what is wrong with the
    image; OverQuota when the caller's uploads would pass its limit."""
    try:
        found = inputs.inspect_image(data, field, max_bytes=int(client.input_max_mb * inputs.MB))
    except inputs.InputRefused as exc:
        raise RequestRejected([exc.problem]) from None
    quotas.charge_upload(who, found.sha256, len(data), client.input_ttl_s)
    client.connection.set(keys.input_key(found.sha256), data, ex=client.input_ttl_s)
    return f"{inputs.INPUT_SCHEME}{found.sha256}", found


def _pins(request: RenderRequest, client: KilnClient) -> list[Problem]:
    problems = [
        Problem(name, value, PIN_RULE)
        for name, value in (("rung", request.rung), ("compile", request.compile))
        if value is not None
    ]
    if request.step_cache and _step_cache_off(client, request.model):
        rule = (
            "is off on every worker serving this model (KILN_STEP_CACHE=off or the manifest):"
            " only the operator turns it on"
        )
        problems.append(Problem("step_cache", True, rule))
    return problems


def _step_cache_off(client: KilnClient, model: str) -> bool:
    serving = [state for state in client.workers() if model in state.models]
    return bool(serving) and all(model in state.step_cache_off for state in serving)


def _not_made(ref: inputs.InputRef, who: Caller, tokens: Tokens, quotas: Quotas) -> str | None:
    """Why a tenant may not name this input (None: it made it), in words that say nothing of
    whether the object exists."""
    if ref.kind == "upload":
        return None if quotas.holds_upload(who, ref.sha256 or "") else NOT_YOUR_UPLOAD
    if ref.kind == "output" and tokens.made(who, ref.job_id or ""):
        return None
    return NOT_YOURS  # another's output, or a store uri or path: never a tenant's to name


def _map_inputs(request: RenderRequest, own: Callable[[str, str], str]) -> RenderRequest:
    """The request with every input image passed through own(value, field)."""
    update: dict[str, Any] = {}
    for name in ("image", "mask"):
        value = getattr(request, name)
        if value is not None:
            update[name] = own(value, name)
    if request.controls:
        update["controls"] = [
            control.model_copy(update={"image": own(control.image, f"controls.{i}.image")})
            for i, control in enumerate(request.controls)
        ]
    if request.reference is not None:
        image = own(request.reference.image, "reference.image")
        update["reference"] = request.reference.model_copy(update={"image": image})
    return request.model_copy(update=update) if update else request


# -- what a caller is shown ----------------------------------------------------------------------


def shown_result(base: str, job_id: str, result: RenderResult) -> RenderResult:
    """result.images and result.videos as the gateway shows them: url this gateway's absolute
    URL (/images/<n>, /videos/<n>; an S3 store's presigned URL stays), uri the opaque
    kiln-output:<job id>/<n> (the owner may give an image's as an input), and no path."""
    images = [
        _shown_file(f"{base}/v1/jobs/{job_id}/images", job_id, n, image)
        for n, image in enumerate(result.images)
    ]
    videos = [
        _shown_file(f"{base}/v1/jobs/{job_id}/videos", job_id, n, video)
        for n, video in enumerate(result.videos)
    ]
    return result.model_copy(update={"images": images, "videos": videos})


def _shown_file(route: str, job_id: str, n: int, stored: StoredFile) -> StoredFile:
    presigned = stored.uri and stored.uri.startswith("s3://") and stored.url
    update = {
        "url": stored.url if presigned else f"{route}/{n}",
        "uri": f"{inputs.OUTPUT_SCHEME}{job_id}/{n}",
        "path": None,
    }
    return stored.model_copy(update=update)


def shown_preview(base: str, job_id: str, preview: PreviewRef) -> PreviewRef:
    """A preview event's image as the gateway serves it (the JPEG itself still rides along)."""
    return preview.model_copy(update={"uri": f"{base}/v1/jobs/{job_id}/preview", "url": None})


def shown_snapshot(base: str, snapshot: JobSnapshot, who: Caller, stores: list[str]) -> JobSnapshot:
    """A job as the caller sees it: images and preview through the gateway; for a tenant, the
    worker's error with store uris and the workers' published stores masked."""
    update: dict[str, Any] = {}
    if snapshot.result is not None:
        update["result"] = shown_result(base, snapshot.id, snapshot.result)
    if snapshot.progress is not None and snapshot.progress.preview is not None:
        preview = f"{base}/v1/jobs/{snapshot.id}/preview"
        update["progress"] = snapshot.progress.model_copy(update={"preview": preview})
    if snapshot.error is not None and not who.admin:
        update["error"] = masked(snapshot.error, stores)
    return snapshot.model_copy(update=update) if update else snapshot


def shown_event(base: str, event: JobEvent, who: Caller, stores: list[str]) -> JobEvent:
    """One event of a job's stream as the caller sees it, by shown_snapshot's rules."""
    update: dict[str, Any] = {}
    if event.result is not None:
        update["result"] = shown_result(base, event.job_id, event.result)
    if event.preview is not None:
        update["preview"] = shown_preview(base, event.job_id, event.preview)
    if event.error is not None and not who.admin:
        update["error"] = masked(event.error, stores)
    return event.model_copy(update=update) if update else event


def masked(text: str, stores: list[str]) -> str:
    """A worker's message with every store uri and store location in it replaced: a tenant
    learns no path."""
    text = STORE_URI.sub("<store object>", text)
    for location in sorted(stores, key=len, reverse=True):
        if len(location) > 1:
            text = text.replace(location, "<store>")
    return text


def shown_worker(state: WorkerState, who: Caller) -> WorkerState:
    """A worker as the caller sees it: the job it runs is named to admin only."""
    return state if who.admin else state.model_copy(update={"running": None})
