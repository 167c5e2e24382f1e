"""/v1: the job API. Every route here is declared on `router`, which app.py mounts under the
auth dependency: none of them can be reached without a token or the page's cookie.

Routes are plain defs unless they stream: FastAPI runs them in its thread pool, where the
synchronous KilnClient (the Python client, unchanged) does the work. The event stream is async
and reads through the gateway's one EventHub.

What a tenant may send and is shown is tenancy's; its limits are quotas'. Every JSON answer here
is `Cache-Control: no-store` (the router's dependency): a job view is one caller's, and current.

Over 400 lines because every /v1 route stands here with the responses it declares to the OpenAPI
document (schemathesis holds each answer to them), beside the few helpers they share (owned_job,
links); one router is what app.py hangs under auth."""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Annotated, Any
from urllib.parse import unquote, urlparse

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse, StreamingResponse

from api_client import events, keys
from api_client.client import JOB_ID, KilnClient
from api_client.errors import Problem, RenderFailed, RequestRejected, UnknownJob
from api_client.http import files, held, tenancy
from api_client.http.auth import caller
from api_client.http.hub import EventHub
from api_client.http.quotas import Quotas
from api_client.http.tokens import Caller, Tokens
from api_client.http.views import (
    PROBLEM_JSON,
    Canceled,
    JobCreated,
    JobLinks,
    JobList,
    JobView,
    ModelList,
    ModelView,
    ProblemDetail,
    QueueList,
    QueueView,
    Uploaded,
    WorkerList,
    WorkerView,
)
from api_client.job import KilnJob
from api_client.schema import JobEvent, RenderRequest

KEEPALIVE_S = 15.0
EVENT_ID = re.compile(r"0|\d{1,20}-\d{1,20}")
UPLOAD_TYPES = ("image/png", "image/jpeg", "image/webp")
MAX_LIST = 100
BINARY = {"type": "string", "format": "binary"}


def no_store(response: Response) -> None:
    response.headers["Cache-Control"] = "no-store"


# Routes that answer with a Response of their own (images, previews, events) set their own
# Cache-Control; the dependency's reaches the JSON answers.
router = APIRouter(prefix="/v1", dependencies=[Depends(no_store)])


def _problem(status: int, description: str) -> dict[str, Any]:
    # The schema goes under problem+json, the type every refusal is sent as ("model" only
    # registers the component; FastAPI also lists it under application/json).
    schema = {"$ref": "#/components/schemas/ProblemDetail"}
    return {
        "model": ProblemDetail,
        "description": description,
        "content": {PROBLEM_JSON: {"schema": schema}},
    }


Responses = dict[int | str, dict[str, Any]]
REFUSED: Responses = {
    401: _problem(401, "no valid token or session"),
    403: _problem(403, "a scope, or a cross-origin request, refused"),
    421: _problem(421, "a Host not in KILN_API_HOSTS"),
}
INVALID: Responses = {
    422: _problem(422, "a parameter or header breaks its rule (errors: field, value, rule)")
}
JOB_REFUSED: Responses = {
    **REFUSED,
    **INVALID,
    404: _problem(404, "no such job, or not the caller's"),
}
UNREADABLE: Responses = {400: _problem(400, "a body that cannot be read (not UTF-8 JSON)")}
REJECTED: Responses = {
    422: _problem(
        422, "the request breaks its manifest or the schema (errors: field, value, rule)"
    ),
    413: _problem(413, "a body over KILN_API_MAX_BODY_MB"),
    409: _problem(409, "the job id is taken: not one the caller may take"),
    429: _problem(429, "a limit of the caller's token is reached (Retry-After says when to retry)"),
}


def client_of(request: Request) -> KilnClient:
    client: KilnClient = request.app.state.client
    return client


def tokens_of(request: Request) -> Tokens:
    tokens: Tokens = request.app.state.tokens
    return tokens


def quotas_of(request: Request) -> Quotas:
    quotas: Quotas = request.app.state.quotas
    return quotas


def base_of(request: Request) -> str:
    """This gateway's absolute URL as the caller reached it (a named proxy's forwarded scheme
    and host included), with no trailing slash."""
    return str(request.base_url).rstrip("/")


Client = Annotated[KilnClient, Depends(client_of)]
Auth = Annotated[Caller, Depends(caller)]


def links(request: Request, job_id: str) -> JobLinks:
    base = f"/v1/jobs/{job_id}"
    root = request.scope.get("root_path", "")
    return JobLinks(
        self=f"{root}{base}", events=f"{root}{base}/events", cancel=f"{root}{base}/cancel"
    )


def owned_job(request: Request, who: Caller, job_id: str) -> KilnJob:
    """The caller's job, or 404 (another caller's job is 404 too: its existence is not theirs
    to learn)."""
    # An id RQ could never have made is no job (RQ's fetch would raise ValueError: a 500).
    if not JOB_ID.fullmatch(job_id) or not tokens_of(request).owns(who, job_id):
        raise HTTPException(404, f"no job {job_id[:200]!r} of yours")
    return client_of(request).job(job_id)


# -- models, workers, queues ---------------------------------------------------------------------


@router.get("/models", response_model=ModelList, responses=REFUSED)
def list_models(client: Client, who: Auth) -> ModelList:
    """Every model a request may name (the shipped manifests, KILN_MANIFESTS, what workers
    published): what the page's form follows, with the workers serving each (none: its jobs
    wait), queue depths and ETAs."""
    return ModelList(
        models=[
            ModelView(
                manifest=info.manifest,
                workers=info.workers,
                resident_on=info.resident_on,
                queued=info.queued,
                blocked=info.blocked,
                default_eta_s=info.default_eta_s,
                eta_now_s=info.eta_now_s(),
                sigmas={
                    sampler: list(info.manifest.family_row.sigmas_for(sampler))
                    for sampler in info.manifest.samplers
                },
                frame_step=info.manifest.family_row.frame_step,
            )
            for info in client.models()
            if not info.manifest.benchmark_only
        ]
    )


@router.get("/workers", response_model=WorkerList, responses=REFUSED)
def list_workers(client: Client, who: Auth) -> WorkerList:
    """Live workers (what `kiln top` shows): models, resident rungs, free memory; the running
    job and where it is for an admin token only (another tenant's job id is not a tenant's to
    learn)."""
    views = []
    for state in sorted(client.workers(), key=lambda s: s.name):
        shown = tenancy.shown_worker(state, who)
        progress = None
        if shown.running:
            try:
                progress = client.job(shown.running).progress()
            except (UnknownJob, RenderFailed):
                progress = None
        views.append(WorkerView(state=shown, progress=progress))
    return WorkerList(workers=views)


@router.get("/queues", response_model=QueueList, responses=REFUSED)
def list_queues(client: Client, who: Auth) -> QueueList:
    """Each served or non-empty queue: depth, serving workers, the ETA of a job sent now."""
    queues = []
    for info in client.models():
        for lane in keys.LANES:
            depth = info.queued.get(lane, 0)
            if info.workers or depth:
                queues.append(
                    QueueView(
                        model=info.manifest.id,
                        lane=lane,
                        depth=depth,
                        workers=info.workers,
                        eta_now_s=info.eta_now_s(lane),
                    )
                )
    return QueueList(queues=queues)


# -- jobs ----------------------------------------------------------------------------------------


def submit_for(
    request: Request, who: Caller, body: RenderRequest, job_id: str | None
) -> tuple[KilnJob, bool]:
    """Submit for the caller; (job, created). An id the caller cannot take (another tenant's,
    or one made outside the gateway) is 409 in one set of words, and nothing is created."""
    tokens, client, quotas = tokens_of(request), client_of(request), quotas_of(request)
    existed = job_id is not None and request_exists(client, job_id)
    if existed and job_id is not None and not tokens.owns(who, job_id):
        raise _taken(job_id)
    admitted = tenancy.admit(body, who, client, tokens, quotas)
    job_id = job_id or uuid.uuid4().hex  # chosen here: the quota counts it before it is queued
    if not existed:
        quotas.take_job(who, job_id)
    try:
        job = client.submit(admitted, job_id=job_id)
    except BaseException:
        if not existed:
            quotas.give_back_job(who, job_id)
        raise
    if not job.created and not existed and not tokens.owns(who, job.id):
        quotas.give_back_job(who, job_id)
        raise _taken(job.id)
    tokens.record_job(who, job.id)
    return job, job.created


def _taken(job_id: str) -> HTTPException:
    return HTTPException(409, f"job id {job_id[:200]!r} is taken: choose another")


def request_exists(client: KilnClient, job_id: str) -> bool:
    return bool(client.connection.exists(keys.rq_job_key(job_id)))


def _created(
    request: Request, response: Response, job: KilnJob, created: bool, model: str
) -> JobCreated:
    response.status_code = 201 if created else 200
    response.headers["Location"] = links(request, job.id).self
    status = "queued" if created else job.status()  # a job just enqueued is queued: no read
    served = held.served_now(client_of(request), model)
    warnings = [] if served else [unserved(model)]
    return JobCreated(
        id=job.id, status=status, served=served, warnings=warnings, urls=links(request, job.id)
    )


def unserved(model: str) -> str:
    return (
        f"no live worker serves {model} now: the job waits in its queue until one starts"
        f" (kiln worker --models {model})"
    )


@router.post(
    "/jobs",
    response_model=JobCreated,
    status_code=201,
    responses={
        **REFUSED,
        **REJECTED,
        **UNREADABLE,
        200: {"model": JobCreated, "description": "the same job"},
    },
)
def create_job(
    body: RenderRequest,
    request: Request,
    response: Response,
    who: Auth,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JobCreated:
    """Validate against the model's manifest and enqueue. With Idempotency-Key, the same key
    (from the same caller) returns the same job and never renders twice."""
    job_id = None
    if idempotency_key is not None:
        job_id = "idem-" + hashlib.sha256(f"{who.id}\n{idempotency_key}".encode()).hexdigest()[:40]
    job, created = submit_for(request, who, body, job_id)
    return _created(request, response, job, created, body.model)


@router.put(
    "/jobs/{job_id}",
    response_model=JobCreated,
    responses={
        **REFUSED,
        **REJECTED,
        **UNREADABLE,
        201: {"model": JobCreated, "description": "created"},
    },
)
def put_job(
    job_id: str, body: RenderRequest, request: Request, response: Response, who: Auth
) -> JobCreated:
    """Create the job under this id; the same request again is the same job (200), a different
    one under the same id is refused (422, field job_id)."""
    job, created = submit_for(request, who, body, job_id)
    return _created(request, response, job, created, body.model)


@router.get("/jobs", response_model=JobList, responses={**REFUSED, **INVALID})
def list_jobs(
    request: Request,
    who: Auth,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 20,
) -> JobList:
    """The caller's recent jobs, newest first. A tenant's: those it made through a gateway; an
    admin's: everyone's, those submitted by `kiln submit` or the Python client included (what
    the model queues' event streams still hold)."""
    client = client_of(request)
    ids = tokens_of(request).recent_jobs(who, limit)
    if who.admin:
        ids = everyones(client, ids, limit)
    views = [view_job(request, who, client.job(job_id), eta=False) for job_id in ids]
    return JobList(jobs=[view for view in views if view is not None])


def everyones(client: KilnClient, gateway_ids: list[str], limit: int) -> list[str]:
    """Every recent job id, newest first: the queues' event streams (any submitter) with the
    gateway's own list (a job older than its stream's retention)."""
    stamped = {event.job_id: event.at for event in client.recent_jobs(limit=limit)}
    for rank, job_id in enumerate(gateway_ids):
        stamped.setdefault(job_id, -rank)  # older than anything the streams hold, in order
    return sorted(stamped, key=lambda job_id: stamped[job_id], reverse=True)[:limit]


@router.get("/jobs/{job_id}", response_model=JobView, responses=JOB_REFUSED)
def read_job(job_id: str, request: Request, who: Auth) -> JobView:
    """Status, queue position, ETA, progress, and the result or the worker's error."""
    view = view_job(request, who, owned_job(request, who, job_id), eta=True)
    if view is None:
        raise HTTPException(404, f"no job {job_id[:200]!r} (never submitted, or expired)")
    return view


def view_job(request: Request, who: Caller, job: KilnJob, eta: bool) -> JobView | None:
    """The job as the API shows it (the Python client's job.snapshot() through tenancy's view:
    images and preview as this gateway's URLs, no store path); None when Redis holds no such
    job."""
    try:
        snapshot = job.snapshot(eta=eta)
    except UnknownJob:
        return None
    masks = client_of(request).stores() if snapshot.error and not who.admin else []
    shown = tenancy.shown_snapshot(base_of(request), snapshot, who, masks)
    return JobView(**dict(shown), urls=links(request, job.id))


@router.post(
    "/jobs/{job_id}/cancel", response_model=Canceled, status_code=202, responses=JOB_REFUSED
)
def cancel_job(job_id: str, request: Request, who: Auth) -> Canceled:
    """Queued: removed from its queue. Running: stopped at the next denoise step."""
    job = owned_job(request, who, job_id)
    try:
        seen = job.cancel()
    except UnknownJob:
        raise HTTPException(404, f"no job {job_id[:200]!r} (never submitted, or expired)") from None
    return Canceled(status=CANCEL_DID.get(seen, seen))


# What a cancel did, by the status it found: a waiting job never runs, a running one stops.
CANCEL_DID = {"queued": "canceled", "scheduled": "canceled", "deferred": "canceled"}
CANCEL_DID |= {"started": "stopping"}


@router.get(
    "/jobs/{job_id}/images/{n}",
    responses={
        **JOB_REFUSED,
        200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}},
        307: {"description": "a presigned URL of the image in S3"},
    },
    response_class=Response,
)
def job_image(job_id: str, n: int, request: Request, who: Auth) -> Response:
    """One image of a finished job: its bytes (sha256 checked) from a local store, or a
    redirect to a presigned URL in S3."""
    image = files.stored(client_of(request), owned_job(request, who, job_id), n, "image")
    if isinstance(image, RedirectResponse):
        return image
    data = files.read(image)
    return Response(data, media_type=f"image/{image.format}", headers=files.PRIVATE_CACHE)


@router.get(
    "/jobs/{job_id}/videos/{n}",
    responses={
        **JOB_REFUSED,
        200: {"content": {kind: {} for kind in files.VIDEO_TYPES.values()}},
        206: {"description": "the bytes a `Range: bytes=a-b` asked for, with Content-Range"},
        307: {"description": "a presigned URL of the video in S3 (S3 serves ranges itself)"},
        416: _problem(416, "a range that starts past the file's end (Content-Range: its size)"),
    },
    response_class=Response,
)
def job_video(
    job_id: str,
    n: int,
    request: Request,
    who: Auth,
    range: Annotated[str | None, Header(max_length=200)] = None,
    if_range: Annotated[str | None, Header(max_length=200)] = None,
) -> Response:
    """One video of a finished video job, as /images/{n} serves an image: its bytes (sha256
    checked) from a local store, whole or the one byte range asked for (a browser's <video>
    seeks by ranges), or a redirect to a presigned URL in S3."""
    video = files.stored(client_of(request), owned_job(request, who, job_id), n, "video")
    if isinstance(video, RedirectResponse):
        return video
    data = files.read(video)
    return files.ranged(data, video, range, if_range)


@router.get(
    "/jobs/{job_id}/preview",
    responses={**JOB_REFUSED, 200: {"content": {"image/jpeg": {}}}},
    response_class=Response,
)
def job_preview(job_id: str, request: Request, who: Auth) -> Response:
    """The latest TAESD preview of a running job (404 until there is one)."""
    job = owned_job(request, who, job_id)
    connection = client_of(request).connection
    entries: Any = connection.xrevrange(keys.events_key(job.id), count=50)
    for _entry_id, fields in entries or []:
        try:
            event = JobEvent.model_validate_json(fields[events.FIELD])
        except (KeyError, ValueError):
            continue
        if event.kind in ("queued", "started"):
            break
        if event.kind != "preview" or event.preview is None:
            continue
        data = event.preview.jpeg()
        if data is not None:
            return Response(data, media_type="image/jpeg", headers={"Cache-Control": "no-store"})
        if event.preview.url:
            return RedirectResponse(event.preview.url, status_code=307)
        uri = event.preview.uri
        if uri.startswith("file://") and files.in_published_store(client_of(request), uri):
            try:
                with open(unquote(urlparse(uri).path), "rb") as file:
                    return Response(file.read(), media_type="image/jpeg")
            except OSError:
                break
        break
    raise HTTPException(404, f"job {job_id[:200]!r} has no preview now")


@router.get(
    "/jobs/{job_id}/events",
    responses={**JOB_REFUSED, 200: {"content": {"text/event-stream": {}}}},
    response_class=StreamingResponse,
)
async def job_events(
    job_id: str,
    request: Request,
    who: Auth,
    last_event_id: Annotated[str | None, Header()] = None,
    after: Annotated[str | None, Query(description="resume after this event id")] = None,
) -> StreamingResponse:
    """The job's events as Server-Sent Events (event: its kind, id: its stream id, data: the
    JobEvent), from the start or after Last-Event-ID (or ?after=); closes after the end event,
    with a comment every 15 s in between."""
    resume = last_event_id or after or "0"
    if not EVENT_ID.fullmatch(resume):
        problem = Problem("Last-Event-ID", resume[:100], "must be an event id like 1700000000000-0")
        raise RequestRejected([problem])
    job = await run_in_threadpool(owned_job, request, who, job_id)
    await run_in_threadpool(job.status)  # UnknownJob -> 404 before the stream starts
    hub: EventHub = request.app.state.hub
    base, client = base_of(request), client_of(request)

    async def stream() -> Any:
        yield ": kiln events\n\n"
        async for event in hub.watch(keys.events_key(job.id), resume, KEEPALIVE_S):
            if event is None:
                if await run_in_threadpool(ended_without_event, job):
                    return
                yield ": keepalive\n\n"
                continue
            masks = []
            if event.error is not None and not who.admin:
                masks = await run_in_threadpool(client.stores)
            shown = tenancy.shown_event(base, event, who, masks)
            data = shown.model_dump_json(exclude_none=True)
            yield f"id: {event.id}\nevent: {event.kind}\ndata: {data}\n\n"

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


def ended_without_event(job: KilnJob) -> bool:
    """A job can end with no event on its stream (quarantined, deleted): the stream closes."""
    return job.ended()


# -- uploads -------------------------------------------------------------------------------------


@router.post(
    "/uploads",
    response_model=Uploaded,
    status_code=201,
    responses={
        **REFUSED,
        **REJECTED,
        415: _problem(415, "not image/png, image/jpeg or image/webp"),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                kind: {"schema": {"type": "string", "format": "binary"}} for kind in UPLOAD_TYPES
            },
        }
    },
)
async def upload(request: Request, who: Auth) -> Uploaded:
    """An input image for img2img, inpaint, edit, a control or a reference, checked as
    client.upload checks it and charged to the token's upload limit; its kiln-input: uri goes
    in a request's image, mask, controls or reference. Checked in the thread pool: decoding a
    large image must not hold up the event loop."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in UPLOAD_TYPES:
        raise HTTPException(415, f"Content-Type {kind[:80]!r}: send {', '.join(UPLOAD_TYPES)}")
    data = await request.body()
    client, quotas = client_of(request), quotas_of(request)
    uri, found = await run_in_threadpool(tenancy.keep_upload, data, "image", who, client, quotas)
    return Uploaded(uri=uri, sha256=found.sha256, width=found.width, height=found.height)
