"""The /sdapi/v1 routes, each answering JSON, under HTTP Basic (any user name, the kiln token as
the password) or what every private route takes (Bearer, the page's session): the same tokens,
scopes and tenancy as /v1.

A token's model when a call names none: the one it set through POST /options (kept per token in
Redis), else the first model (by id) a live worker serves, else the first manifest."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from api_client.client import KilnClient
from api_client.errors import RenderFailed, UnknownJob
from api_client.http import dialect, tenancy
from api_client.http.a1111 import fields
from api_client.http.a1111.answers import NO_STORE, PREFIX, Call, rendered
from api_client.http.auth import caller
from api_client.http.tokens import Caller, Tokens
from api_client.job import KilnJob
from api_client.manifest import Manifest
from api_client.samplers import A1111_ALIASES, A1111_SAMPLERS, A1111_SCHEDULERS

MODEL_KEY = "kiln:api:a1111:model:"  # + token id -> the manifest id its options set
CHALLENGE = {"WWW-Authenticate": 'Basic realm="kiln", Bearer'}
RECENT = 20  # the caller's newest jobs /progress and /interrupt look through


def a1111_caller(request: Request) -> Caller:
    """HTTP Basic with the token as its password (what A1111's --api-auth clients send), else
    the gateway's own dependency (Bearer, the page's session); 401 asks for either."""
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        try:
            return caller(request)
        except HTTPException as exc:
            raise HTTPException(exc.status_code, exc.detail, headers=CHALLENGE) from None
    tokens: Tokens = request.app.state.tokens
    token = _password(credentials.strip())
    found = tokens.caller(token) if token else None
    if found is None:
        detail = "HTTP Basic's password must be a kiln token (any user name)"
        if token:
            detail += ": this one is unknown, revoked or expired"
        raise HTTPException(401, detail, headers=CHALLENGE)
    request.state.caller = found
    return found


def _password(credentials: str) -> str | None:
    try:
        decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    _user, colon, password = decoded.partition(":")
    return password if colon and password else None


Who = Annotated[Caller, Depends(a1111_caller)]
router = APIRouter(prefix=PREFIX, include_in_schema=False, dependencies=[Depends(a1111_caller)])


# -- rendering -----------------------------------------------------------------------------------


@router.post("/txt2img")
async def txt2img(request: Request, who: Who) -> JSONResponse:
    """A prompt rendered as a kiln job; the call is held until the job ends."""
    return await _render(request, who, img2img=False)


@router.post("/img2img")
async def img2img(request: Request, who: Who) -> JSONResponse:
    """init_images[0] (and mask: inpaint, white repainted) rendered at the image's own size."""
    return await _render(request, who, img2img=True)


async def _render(request: Request, who: Caller, img2img: bool) -> JSONResponse:
    body = await dialect.json_object(request)
    call = await run_in_threadpool(_submit, request, who, body, img2img)
    end = await dialect.ending(request, call.job_id)
    answer = await run_in_threadpool(rendered, request, who, call, end)
    return JSONResponse(answer, headers=NO_STORE)


def _submit(request: Request, who: Caller, body: dict[str, Any], img2img: bool) -> Call:
    """The body read onto a RenderRequest, its images kept as the caller's uploads, submitted
    for the caller once a live worker serves its model."""
    client: KilnClient = request.app.state.client
    manifest = _manifest(client, fields.model_of(body) or current_model(client, who))
    reading = fields.read(body, manifest, img2img)
    dialect.require_served(client, manifest.id, "sd_model_checkpoint")
    if img2img:
        _keep_inputs(request, who, body, reading, manifest)
    job = dialect.submit(request, who, reading.mapped)
    return Call(job.id, body, reading)


def _keep_inputs(
    request: Request, who: Caller, body: dict[str, Any], reading: fields.Reading, manifest: Manifest
) -> None:
    """The init image and mask as the caller's uploads (checked and charged as /v1's inline
    images are); the job's size is the image's: kiln never resizes an input."""
    client, quotas = request.app.state.client, request.app.state.quotas
    mapped = reading.mapped
    mapped["image"], found = tenancy.keep_upload(reading.image or b"", "image", who, client, quotas)
    for name, size in (("width", found.width), ("height", found.height)):
        given = body.get(name)
        if given is not None and given != size:
            rule = (
                f"{given!r}: the init image is {found.width}x{found.height} and kiln never resizes"
                f" an input; send width {found.width} and height {found.height}, or leave them out"
            )
            raise fields.refuse(name, rule)
        mapped[name] = size
    if reading.mask is not None:
        mapped["mask"] = tenancy.keep_upload(reading.mask, "mask", who, client, quotas)[0]
    if "mode" not in body:
        inpaint = "mask" in mapped
        mapped["mode"] = "edit" if "edit" in manifest.modes else "inpaint" if inpaint else "img2img"


def _manifest(client: KilnClient, model: str) -> Manifest:
    manifests = client.manifests()
    if model not in manifests:
        known = ", ".join(sorted(_checkpoints(client)))
        raise dialect.Refused(
            404,
            f"sd_model_checkpoint {model[:100]!r}: no such model; models here: {known}",
            "sd_model_checkpoint",
            "model_not_found",
        )
    return dialect.makes_images(manifests[model], "sd_model_checkpoint")


def _checkpoints(client: KilnClient) -> dict[str, Manifest]:
    """The manifests A1111 calls checkpoints: every prompted image model (upscalers are
    /upscalers; a video model answers no txt2img)."""
    return {
        model_id: manifest
        for model_id, manifest in client.manifests().items()
        if manifest.family_row.prompted
        and not manifest.benchmark_only
        and not manifest.family_row.video
    }


def current_model(client: KilnClient, who: Caller) -> str:
    """The token's model: the one its options set, else the first (by id) a live worker serves,
    else the first manifest."""
    checkpoints = _checkpoints(client)
    chosen = client.connection.get(MODEL_KEY + who.id)
    if chosen is not None:
        chosen = chosen.decode() if isinstance(chosen, bytes) else str(chosen)
        if chosen in checkpoints:
            return str(chosen)
    served = sorted({m for state in client.workers() for m in state.models if m in checkpoints})
    if not served and not checkpoints:
        raise dialect.Refused(503, "the gateway sees no model: KILN_MANIFESTS names none", None)
    return served[0] if served else min(checkpoints)


# -- options and the lists -----------------------------------------------------------------------


@router.get("/options")
def get_options(request: Request, who: Who) -> dict[str, Any]:
    """The options kiln has a meaning for: the token's model, and what it renders with."""
    return {
        "sd_model_checkpoint": current_model(request.app.state.client, who),
        "sd_checkpoint_hash": None,
        "sd_vae": "Automatic",
        "CLIP_stop_at_last_layers": 1,
        "samples_format": "png",
        "live_previews_enable": True,
    }


@router.post("/options")
async def set_options(request: Request, who: Who) -> None:
    """The whole object, or a part: sd_model_checkpoint is applied (for this token), the rest is
    read and left (kiln's settings are the operator's)."""
    body = await dialect.json_object(request)
    model = body.get("sd_model_checkpoint")
    if model is None:
        return
    if not isinstance(model, str):
        raise fields.refuse("sd_model_checkpoint", "must be a model's title (GET sd-models)", 400)
    await run_in_threadpool(_choose, request, who, fields.checkpoint(model))


def _choose(request: Request, who: Caller, model: str) -> None:
    client: KilnClient = request.app.state.client
    if model not in _checkpoints(client):
        _manifest(client, model)  # names the models there are
        raise fields.refuse("sd_model_checkpoint", f"{model!r} is an upscaler: see /upscalers")
    client.connection.set(MODEL_KEY + who.id, model)


@router.get("/sd-models")
def sd_models(request: Request) -> list[dict[str, Any]]:
    """Every model a call may name, served or not (title and model_name: the manifest id)."""
    return [
        {
            "title": model_id,
            "model_name": model_id,
            "hash": None,
            "sha256": None,
            "filename": model_id,
            "config": None,
        }
        for model_id in sorted(_checkpoints(request.app.state.client))
    ]


@router.get("/samplers")
def samplers() -> list[dict[str, Any]]:
    """The samplers kiln runs, in A1111's names (a model may take fewer: a job names it)."""
    return [
        {
            "name": name,
            "aliases": [alias for alias, to in A1111_ALIASES.items() if to == name],
            "options": {},
        }
        for name in A1111_SAMPLERS
    ]


@router.get("/schedulers")
def schedulers() -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "label": name.capitalize(),
            "aliases": None,
            "default_rho": None,
            "need_inner_model": None,
        }
        for name in A1111_SCHEDULERS
    ]


@router.get("/upscalers")
def upscalers(request: Request) -> list[dict[str, Any]]:
    """The upscaler manifests, a hires pass's hr_upscaler (or Latent: latent-upscale-modes)."""
    client: KilnClient = request.app.state.client
    return [
        {
            "name": model_id,
            "model_name": model_id,
            "model_path": None,
            "model_url": None,
            "scale": manifest.scale,
        }
        for model_id, manifest in sorted(client.manifests().items())
        if not manifest.family_row.prompted and not manifest.benchmark_only
    ]


@router.get("/latent-upscale-modes")
def latent_upscale_modes() -> list[dict[str, str]]:
    return [{"name": fields.LATENT}]


@router.get("/loras")
def loras(request: Request) -> list[dict[str, Any]]:
    """Every LoRA some model declares; a prompt's <lora:name:weight> asks for one."""
    names = {name for m in _checkpoints(request.app.state.client).values() for name in m.loras}
    return [{"name": n, "alias": n, "path": n, "metadata": {}} for n in sorted(names)]


@router.get("/sd-vae")
def sd_vae() -> list[dict[str, str]]:
    """None to choose: each model renders with its manifest's VAE."""
    return []


@router.get("/scripts")
def scripts() -> dict[str, list[str]]:
    """No A1111 scripts run here (webuiapi asks this when it is given credentials)."""
    return {"txt2img": [], "img2img": []}


# -- progress, interrupt, skip -------------------------------------------------------------------


@router.get("/progress")
def progress(request: Request, who: Who, skip_current_image: bool = False) -> dict[str, Any]:
    """The caller's newest running job: its step, ETA and live preview (current_image, the
    worker's latest TAESD JPEG); idle: progress 0 and job_count 0."""
    running, waiting = _mine(request, who)
    step, steps, phase, eta = 0, 0, "idle", 0.0
    if running is not None:
        snapshot = running.snapshot(eta=True)
        eta, phase = snapshot.eta_s or 0.0, "started"
        if snapshot.progress is not None:
            shown = snapshot.progress
            step, steps, phase = shown.step, shown.steps, shown.phase
    image = None
    if running is not None and not skip_current_image:
        image = _preview(request, who, running.id)
    state: dict[str, Any] = {
        "skipped": False,
        "interrupted": False,
        "stopping_generation": False,
        "job": running.id if running else "",
        "job_count": waiting + int(running is not None),
        "job_no": 0,
        "job_timestamp": "0",
        "sampling_step": step,
        "sampling_steps": steps,
    }
    return {
        "progress": step / steps if steps else 0.0,
        "eta_relative": eta,
        "state": state,
        "current_image": image,
        "textinfo": f"{phase} step {step}/{steps}" if steps else None,
    }


@router.post("/interrupt")
def interrupt(request: Request, who: Who) -> dict[str, Any]:
    """Stop the caller's running job at its next step (its held call answers no images)."""
    running, _ = _mine(request, who)
    if running is not None:
        running.cancel()
    return {}


@router.post("/skip")
def skip(request: Request, who: Who) -> dict[str, Any]:
    """A1111 skips the batch's current image; a kiln job is one unit: it stops, as interrupt."""
    return interrupt(request, who)


def _mine(request: Request, who: Caller) -> tuple[KilnJob | None, int]:
    """The caller's newest running job among its RECENT newest, and how many others wait."""
    client: KilnClient = request.app.state.client
    running, waiting = None, 0
    for job_id in request.app.state.tokens.recent_jobs(who, RECENT):
        job = client.job(job_id)
        try:
            status = job.status()
        except (UnknownJob, RenderFailed):
            continue
        if status == "started" and running is None:
            running = job
        elif status in ("queued", "scheduled", "deferred"):
            waiting += 1
    return running, waiting


def _preview(request: Request, who: Caller, job_id: str) -> str | None:
    """The job's latest preview as base64 (what /v1/jobs/{id}/preview serves), None before one."""
    from api_client.http import routes

    try:
        response = routes.job_preview(job_id, request, who)
    except HTTPException:
        return None
    if response.media_type != "image/jpeg":
        return None  # an S3 store's redirect: the preview is not the gateway's to inline
    return base64.b64encode(bytes(response.body)).decode()
