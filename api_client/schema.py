"""Everything kiln puts on the wire, as pydantic models the worker writes and the client reads:
the request and result, job progress and errors, worker state and timing fits (no torch here)."""

from __future__ import annotations

import base64
import re
from datetime import datetime
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from api_client.errors import Problem, RequestRejected, short
from api_client.samplers import Sampler, Sigmas

# A file's format: an image's png, webp or jpeg; a video's mp4 (H.264), webm (VP9) or webp
# (animated).
OutputFormat = Literal["png", "webp", "jpeg", "mp4", "webm"]
IMAGE_FORMATS: tuple[OutputFormat, ...] = ("png", "webp", "jpeg")
VIDEO_FORMATS: tuple[OutputFormat, ...] = ("mp4", "webm", "webp")
PHASES: tuple[str, ...] = (
    "queue_wait",
    "load",
    "text_encode",
    "denoise",
    "decode",
    "upscale",
    "image_encode",
    "video_encode",
    "save",
    "total",
)
# A phase's column header where tables are narrow (`kiln top`, `kiln timings`, `kiln submit`).
PHASE_HEADERS: dict[str, str] = {
    p: {
        "queue_wait": "wait",
        "text_encode": "text",
        "image_encode": "encode",
        "video_encode": "video",
    }.get(p, p)
    for p in PHASES
}
# What a request asks of its model: from a prompt alone, from an input image, into a mask's
# white area of one, or an instruction edit (FLUX.1 Kontext, Qwen-Image-Edit; not served yet).
# upscale: an upscaler manifest's one mode, an image made its scale times larger. txt2video and
# img2video: a video model's, from a prompt alone or from its first frame.
Mode = Literal["txt2img", "img2img", "inpaint", "edit", "upscale", "txt2video", "img2video"]
MODES: tuple[Mode, ...] = get_args(Mode)
VIDEO_MODES: tuple[Mode, ...] = ("txt2video", "img2video")
MAX_FPS = 60
# The memory ladder's rungs, best first: declared here once, for the worker and the client.
# partial: as many denoiser blocks resident as fit, the rest streamed (worker/partial.py).
Rung = Literal["full", "partial", "model_offload", "group_offload"]
RUNGS: tuple[Rung, ...] = get_args(Rung)
MAX_PROMPT_CHARS = 4000
MAX_SEED = 2**32 - 1
MAX_IMAGES = 4
# The function name every kiln job carries. Workers check it and run kiln's render; they never
# import or call what a payload names, so this is a label on the wire, not a code path.
RENDER_FUNC = "worker.queue.render_job"
WEBHOOK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_LORAS = 4  # adapters one request may name
MAX_CONTROLS = 2  # ControlNets one request may name (A1111's and ComfyUI's common stack)
Priority = Literal["interactive", "batch"]  # a request's lane (api_client/keys.py LANES)


class LoraChoice(BaseModel):
    """One adapter a request names, from its manifest's loras, and the weight it applies at."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str
    weight: float | None = None  # None: the manifest's default_weight


class ControlChoice(BaseModel):
    """One ControlNet a request names, from its manifest's controlnets: its control image (an
    input uri, as img2img's image, the job's size), how strongly it steers (0-2, default 1),
    the share of the steps it applies over (start, end: default 0 to 1), and what the worker
    computes from the image first (none: the image is the map; canny: its edges)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str
    image: str
    strength: float | None = None
    start: float | None = None
    end: float | None = None
    preprocess: Literal["none", "canny"] | None = None


class ReferenceChoice(BaseModel):
    """A reference image for the manifest's IP-Adapter: an input uri (any size: the adapter's
    image encoder resizes and crops it to its own) and how strongly it steers (0-2, default 1;
    0 renders what no reference renders)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    image: str
    strength: float | None = None


class HiresRequest(BaseModel):
    """A hires pass (A1111's hires fix): the image rendered at the request's size, made scale
    times larger by an upscaler manifest's model (or its latents, upscaler "latent"), then run
    through img2img at that size with strength and steps, on the same resident pipeline."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    scale: float
    strength: float | None = None  # default 0.35
    steps: int | None = None  # default: half the model's default steps
    upscaler: str | None = None  # an upscaler manifest's id, or "latent" (the default)


class RenderRequest(BaseModel):
    """One image job. Fields left as None take the manifest's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str
    prompt: str = ""  # every mode needs one but upscale
    negative_prompt: str = ""
    steps: int | None = None
    guidance: float | None = None
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    # True CFG with a negative prompt (flux, qwenimage), where the manifest's true_cfg allows it;
    # guidance is then FLUX.1's embedded guidance, not CFG.
    true_cfg: float | None = None
    # The mode (default: inpaint with a mask, img2img with an image, else txt2img), the input
    # image and mask (a kiln-input: uri from client.upload, a uri inside the worker's store, or
    # a small data: URL; never a worker path or an arbitrary URL) and how much of the image is
    # re-noised (0-1, default 0.75).
    mode: Mode | None = None
    image: str | None = None
    mask: str | None = None
    strength: float | None = None
    # Adapters from the manifest's loras, each at its weight (default: its default_weight).
    loras: list[LoraChoice] | None = Field(default=None, max_length=MAX_LORAS)
    # ControlNets from the manifest's controlnets, each with its image (api_client.controls).
    controls: list[ControlChoice] | None = Field(default=None, max_length=MAX_CONTROLS)
    # A reference image through the manifest's IP-Adapter (api_client.references).
    reference: ReferenceChoice | None = None
    # A second, larger pass after the first (HiresRequest).
    hires: HiresRequest | None = None
    # The sampler and its noise schedule (api_client.samplers: ComfyUI's names), from those its
    # model takes; None: the manifest's scheduler, at its own sigmas.
    sampler: Sampler | None = None
    sigmas: Sigmas | None = None
    num_images: int = 1
    # A video model's frames (its family's rule: wan 4k+1, ltx 8k+1) and frames a second; None:
    # the manifest's.
    frames: int | None = None
    fps: int | None = None
    # png unless said; a video model's default is mp4 (api_client.resolve).
    output_format: OutputFormat = "png"
    # TAESD previews while denoising, for a client that shows them (the model's manifest names
    # taesd weights); off by default: nobody watching, nothing drawn.
    previews: bool = False
    webhook: str | None = None  # the name of a target in the workers' KILN_WEBHOOKS, never a URL
    # Replays pin what else changes pixels: the ladder's rung and whether the denoiser is
    # compiled. None lets the worker decide; a pinned value is honoured or the job fails naming
    # why (never a silent descent or fallback).
    rung: Rung | None = None
    compile: bool | None = None
    # Reuse of denoiser work between steps (the manifest's step_cache): true asks for it (a fast
    # draft), false for every step computed (an exact final); None: the worker's auto decision.
    step_cache: bool | None = None
    # The lane its model's jobs wait in: interactive (someone is waiting; the default, None on
    # the wire) ahead of batch, which is never starved (docs/requests.md, on lanes).
    priority: Priority | None = None

    @property
    def lane(self) -> Priority:
        return self.priority or "interactive"

    @field_validator("priority")
    @classmethod
    def _interactive_is_the_default(cls, priority: Priority | None) -> Priority | None:
        # Said or not, the same request: the same wire form, digest and idempotent job.
        return None if priority == "interactive" else priority

    @field_validator("webhook")
    @classmethod
    def _webhook_is_a_name(cls, name: str | None) -> str | None:
        if name is not None and not WEBHOOK_NAME.fullmatch(name):
            raise ValueError(
                "must name a webhook target the workers are configured with "
                "(1-64 letters, digits, '.', '_' or '-'), never carry a URL"
            )
        return name

    @field_validator("model", "prompt", "negative_prompt")
    @classmethod
    def _encodable(cls, value: str) -> str:
        # A lone surrogate ("\ud800") passes as str but no tokenizer, JSON encoder or file takes it.
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"must be valid Unicode text: lone surrogate at position {exc.start}"
            ) from None
        return value

    @classmethod
    def parse(cls, payload: Any) -> RenderRequest:
        """Build from untrusted data (a queue payload, a CLI dict); each problem names its field."""
        if isinstance(payload, RenderRequest):
            return payload
        if not isinstance(payload, dict):
            raise RequestRejected([Problem("request", short(payload), "must be a JSON object")])
        try:
            return cls.model_validate(payload)
        except ValidationError as exc:
            problems = [
                Problem(
                    ".".join(str(p) for p in err["loc"]) or "request",
                    short(err.get("input")),
                    err["msg"],
                )
                for err in exc.errors()
            ]
            model = payload.get("model") if isinstance(payload.get("model"), str) else None
            raise RequestRejected(problems, model=model) from None


# Request fields added after requests were first stored; unset, they are left out of the wire form
# and the digest, so a request that does not use them reads exactly as it did before they existed
# (to workers not yet upgraded, and to result.json files written before).
LATER_FIELDS = (
    "true_cfg",
    "rung",
    "compile",
    "mode",
    "image",
    "mask",
    "strength",
    "loras",
    "priority",
    "step_cache",
    "controls",
    "hires",
    "reference",
    "frames",
    "fps",
)


def _unset_later_fields(request: RenderRequest) -> set[str]:
    return {name for name in LATER_FIELDS if getattr(request, name) is None}


def request_payload(request: RenderRequest) -> dict[str, Any]:
    """The request as a job carries it on the queue (JSON types)."""
    return request.model_dump(mode="json", exclude=_unset_later_fields(request))


def request_digest(request: RenderRequest) -> str:
    """sha256 of a resolved request: what a job id's files on disk were rendered from."""
    import hashlib

    data = request.model_dump_json(exclude=_unset_later_fields(request))
    return hashlib.sha256(data.encode()).hexdigest()


class ImageFile(BaseModel):
    """One image of a result. uri says where it lives in the store (file:// or s3://); url is a
    presigned HTTPS link for S3 stores, valid KILN_URL_EXPIRES_S; path only for local stores."""

    path: str | None = None
    uri: str | None = None
    url: str | None = None
    width: int
    height: int
    format: OutputFormat
    sha256: str


class VideoFile(BaseModel):
    """One video of a result, as ImageFile is one image, with its frames, frames a second and
    seconds of playback."""

    path: str | None = None
    uri: str | None = None
    url: str | None = None
    width: int
    height: int
    frames: int
    fps: int
    format: OutputFormat
    sha256: str
    duration_s: float


class Attempt(BaseModel):
    """One try at a rung: outcome is ok, oom, stopped or error; phase says where it ended."""

    rung: str
    outcome: str
    phase: str | None = None
    detail: str | None = None


class SettingNote(BaseModel):
    name: str
    reason: str


class SettingsReport(BaseModel):
    """What each optimisation switch did at load: applied, skipped, or fell back, with reasons."""

    applied: list[SettingNote] = Field(default_factory=list)
    skipped: list[SettingNote] = Field(default_factory=list)
    fell_back: list[SettingNote] = Field(default_factory=list)

    def add(self, kind: Literal["applied", "skipped", "fell_back"], name: str, reason: str) -> None:
        getattr(self, kind).append(SettingNote(name=name, reason=reason))

    def names(self, kind: Literal["applied", "skipped", "fell_back"]) -> list[str]:
        return [note.name for note in getattr(self, kind)]


class StepCacheReport(BaseModel):
    """A job's step cache: its kind and parameters, and of the denoiser's steps (its conditional
    passes: under true CFG the negative pass decides on its own) how many ran every block and
    how many reused the cached residual after the first block."""

    kind: str
    params: dict[str, int | float | str]
    steps_computed: int = 0
    steps_reused: int = 0


class ControlReport(BaseModel):
    """A control as a job ran it: its ControlNet's name, strength, the share of the steps it
    applied over, and the worker's preprocess. Its image is an input (image details' inputs)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str
    strength: float
    start: float
    end: float
    preprocess: Literal["none", "canny"]

    @classmethod
    def of(cls, choice: ControlChoice) -> ControlReport:
        """A resolved request's control (every default filled in)."""
        return cls(
            name=choice.name,
            strength=float(choice.strength if choice.strength is not None else 1.0),
            start=float(choice.start or 0.0),
            end=float(choice.end if choice.end is not None else 1.0),
            preprocess=choice.preprocess or "none",
        )


class Timings(BaseModel):
    """Seconds per phase; load is 0 when the pipeline was resident."""

    queue_wait: float = 0.0
    load: float = 0.0
    text_encode: float = 0.0
    denoise: float = 0.0
    decode: float = 0.0
    upscale: float = 0.0  # an upscaler's pass (mode upscale, a hires pass's upscaler)
    image_encode: float = 0.0
    video_encode: float = 0.0  # frames into the video's container (0 for images)
    save: float = 0.0
    total: float = 0.0


class RenderResult(BaseModel):
    job_id: str
    model: str
    images: list[ImageFile]
    seed: int
    videos: list[VideoFile] = Field(default_factory=list)  # a video model's ([] for images)
    frames: int | None = None  # a video's frames and frames a second
    fps: int | None = None
    # The request's sampler and sigmas; None: the manifest's scheduler, at its own sigmas.
    sampler: Sampler | None = None
    sigmas: Sigmas | None = None
    steps: int
    guidance: float
    true_cfg: float | None = None
    width: int
    height: int
    rung: str
    device: str
    simulated_device: str | None = None  # the device profile decisions were made as, if any
    dtype: str
    compiled: bool
    quantized: dict[str, str]
    attempts: list[Attempt]
    settings: SettingsReport
    timings: Timings
    worker: str
    started_at: datetime
    finished_at: datetime
    step_cache: StepCacheReport | None = None  # when the job ran with a step cache
    controls: list[ControlReport] = Field(default_factory=list)  # ControlNets it ran with
    reference: ReferenceReport | None = None  # its IP-Adapter's, when it had a reference image
    # Denoising passes: 2 after a hires pass (its second pass adds to denoise and decode).
    passes: int = 1
    # sha256 of the resolved request this answers: a job id reused for another request is never
    # answered with these images (see request_digest).
    request_sha256: str | None = None


class ReferenceReport(BaseModel):
    """A reference image as a job ran it: its IP-Adapter strength. Its image is an input (image
    details' inputs, reference.image)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    strength: float

    @classmethod
    def of(cls, choice: ReferenceChoice | None) -> ReferenceReport | None:
        """A resolved request's reference (its strength filled in), or None."""
        return None if choice is None else cls(strength=float(choice.strength or 0.0))


class Progress(BaseModel):
    """job.progress(): where a job is, from the worker's events on its stream."""

    phase: str
    step: int = 0
    steps: int = 0
    preview: str | None = None  # store uri of the latest TAESD preview, when previews are on


class JobSnapshot(BaseModel):
    """job.snapshot(): everything known about one job now. status is job.status()'s (queued,
    scheduled, started, finished, failed, stopped, canceled, or quarantined); position counts the
    jobs ahead of it in its queue (0: next), None once it left the queue; result when finished,
    error (the worker's message) when it ended without one."""

    id: str
    status: str
    model: str | None = None
    request: RenderRequest | None = None  # as it was queued, defaults filled in
    position: int | None = None
    eta_s: float | None = None
    progress: Progress | None = None
    result: RenderResult | None = None
    error: str | None = None


class JobError(BaseModel):
    """job.meta["error"]: why a job failed, stopped or was refused, in the worker's words."""

    type: str
    message: str


class WorkerState(BaseModel):
    """kiln:worker:<name>: what a live worker serves and holds, refreshed with its heartbeat."""

    name: str
    models: list[str]
    resident: list[str]
    device: str
    device_name: str
    state: str
    heartbeat: float  # unix seconds
    pid: int
    host: str
    # Read by `kiln top`; defaulted so a state published by an older worker still parses.
    profile: str | None = None  # the KILN_DEVICE_PROFILE it decides as, if any
    rungs: dict[str, str] = Field(default_factory=dict)  # resident model -> its rung
    running: str | None = None  # the id of the job it renders (phase, step: its event stream)
    jobs_done: int = 0  # jobs it finished since it started
    free_bytes: int | None = None  # device memory free, as measured (CPU: host memory)
    # Why it takes no jobs now: no served model's measured need fits the memory it has.
    blocked: str | None = None
    ram: list[str] = Field(default_factory=list)  # models in its RAM cache, off the device
    reading: str | None = None  # the model it reads ahead into that cache now (KILN_PREFETCH)
    step_cache_off: list[str] = Field(default_factory=list)  # served models whose switch is off


class TimingFit(BaseModel):
    """kiln:fits field "<model>:<w>x<h>": seconds = fixed_s + steps * per_step_s, per image."""

    fixed_s: float
    per_step_s: float
    samples: int
    rung: str | None = None  # the rung the samples ran on

    def eta(self, steps: int, num_images: int = 1) -> float:
        return num_images * (self.fixed_s + steps * self.per_step_s)


EventKind = Literal["queued", "started", "progress", "preview", "done", "failed", "stopped"]
TERMINAL_EVENTS: tuple[str, ...] = ("done", "failed", "stopped")


class PreviewRef(BaseModel):
    """A denoising preview as it travels in events: its store uri, a presigned url for S3
    stores, and the JPEG itself (base64) when it is small enough to ride along."""

    uri: str
    url: str | None = None
    data: str | None = None

    def jpeg(self) -> bytes | None:
        return None if self.data is None else base64.b64decode(self.data)


class JobEvent(BaseModel):
    """One moment of a job's life, as stored in its Redis stream and sent to webhooks.

    progress carries phase/step/steps; preview a PreviewRef; done the result; failed and stopped
    the worker's message in error. id is the stream entry id, set when read, for resuming.
    """

    kind: EventKind
    job_id: str
    model: str | None = None
    at: float
    id: str | None = None
    phase: str | None = None
    step: int | None = None
    steps: int | None = None
    preview: PreviewRef | None = None
    result: RenderResult | None = None
    error: str | None = None
    detail: str | None = None

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_EVENTS
