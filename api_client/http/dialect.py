"""What the gateway's dialects (OpenAI's Images API, AUTOMATIC1111's) share: a refusal each
renders in its own error shape (app.py picks the shape by the path), the body read as a JSON
object, a call submitted as the caller's kiln job only while a live worker serves its model,
and the job's end awaited on the gateway's one event reader (held.py) with its images read back.

A dialect maps its fields onto a RenderRequest; from there a dialect's job is a kiln job like
any other: tenancy, quotas, the queue, records and events are /v1's."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from api_client.client import KilnClient
from api_client.fetch import FetchFailed, fetch_image
from api_client.http import held
from api_client.http.tokens import Caller
from api_client.job import KilnJob
from api_client.manifest import Manifest
from api_client.schema import ImageFile, JobEvent, RenderRequest, RenderResult


class Refused(Exception):
    """A dialect's call refused: its status, the message, the field it names (as the dialect
    names it) and a machine-readable code. app.py renders it in the caller's dialect."""

    def __init__(
        self, status: int, message: str, field: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.field, self.code = status, field, code


async def json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying it is not one."""
    try:
        body = await request.json()
    except ValueError:
        raise Refused(400, "the body must be a JSON object", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object", None, "invalid_json")
    return body


def makes_images(manifest: Manifest, field: str) -> Manifest:
    """The manifest of a model the dialect's images API can answer for: a video model is refused
    (400) naming kiln's own route, which serves its videos."""
    if manifest.family_row.video:
        message = (
            f"model {manifest.id} renders video, and this API answers with images: submit it"
            " through POST /v1/jobs (its result lists videos)"
        )
        raise Refused(400, message, field, "model_not_supported")
    return manifest


def require_served(client: KilnClient, model: str, field: str = "model") -> None:
    """A call for a model no live worker serves is answered now (503), not held for a worker
    that may never come."""
    if not held.served_now(client, model):
        message = f"no live worker serves model {model!r} now: its jobs would wait for one"
        raise Refused(503, message, field, "model_not_served")


def submit(request: Request, who: Caller, mapped: dict[str, Any]) -> KilnJob:
    """The mapped request, checked as /v1 checks it (RequestRejected naming each field) and
    submitted for the caller (tenancy and quotas as on /v1)."""
    from api_client.http import routes

    job, _ = routes.submit_for(request, who, RenderRequest.parse(mapped), None)
    return job


async def ending(request: Request, job_id: str) -> JobEvent:
    """The job's end event (done, failed or stopped), awaited without a thread; a 500 when the
    job ended with none (quarantined, deleted)."""
    async for event in held.events(request, job_id):
        if event is not None and event.terminal:
            return event
    raise Refused(500, f"job {job_id} ended without a result")


async def result(request: Request, job_id: str) -> RenderResult:
    """The job's result once it is done; a 500 naming how it ended otherwise."""
    try:
        return await held.result(request, job_id)
    except held.EndedWithout as exc:
        raise Refused(500, str(exc)) from None


def image_bytes(job_id: str, n: int, image: ImageFile) -> bytes:
    """One image of a finished job, read from its store (sha256 checked)."""
    try:
        return fetch_image(image)
    except FetchFailed as exc:
        raise Refused(500, f"job {job_id}'s image {n} cannot be read: {exc}") from None
