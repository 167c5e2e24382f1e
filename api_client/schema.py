"""The request and result shapes shared by the client and the worker (pure pydantic, no torch)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_client.errors import Problem, RequestRejected

OutputFormat = Literal["png", "webp", "jpeg"]
PHASES: tuple[str, ...] = (
    "queue_wait",
    "load",
    "text_encode",
    "denoise",
    "decode",
    "image_encode",
    "save",
    "total",
)
RUNGS: tuple[str, ...] = ("full", "model_offload", "group_offload")
MAX_PROMPT_CHARS = 4000
MAX_SEED = 2**32 - 1
MAX_IMAGES = 4
RENDER_FUNC = "worker.queue.render_job"


class RenderRequest(BaseModel):
    """One image job. Fields left as None take the manifest's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str
    prompt: str
    negative_prompt: str = ""
    steps: int | None = None
    guidance: float | None = None
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    num_images: int = 1
    output_format: OutputFormat = "png"

    @classmethod
    def parse(cls, payload: Any) -> RenderRequest:
        """Build from untrusted data (a queue payload, a CLI dict); each problem names its field."""
        if isinstance(payload, RenderRequest):
            return payload
        if not isinstance(payload, dict):
            raise RequestRejected([Problem("request", _short(payload), "must be a JSON object")])
        try:
            return cls.model_validate(payload)
        except ValidationError as exc:
            problems = [
                Problem(
                    ".".join(str(p) for p in err["loc"]) or "request",
                    _short(err.get("input")),
                    err["msg"],
                )
                for err in exc.errors()
            ]
            model = payload.get("model") if isinstance(payload.get("model"), str) else None
            raise RequestRejected(problems, model=model) from None


def request_digest(request: RenderRequest) -> str:
    """sha256 of a resolved request: what a job id's files on disk were rendered from."""
    import hashlib

    return hashlib.sha256(request.model_dump_json().encode()).hexdigest()


def _short(value: Any, limit: int = 80) -> Any:
    """Keep error messages readable when the offending value is a 1 MB prompt."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]}... ({len(value)} chars)"
    if isinstance(value, (dict, list)) and len(repr(value)) > limit:
        return f"{repr(value)[:limit]}..."
    return value


class ImageFile(BaseModel):
    path: str
    width: int
    height: int
    format: OutputFormat
    sha256: str


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


class Timings(BaseModel):
    """Seconds per phase; load is 0 when the pipeline was resident."""

    queue_wait: float = 0.0
    load: float = 0.0
    text_encode: float = 0.0
    denoise: float = 0.0
    decode: float = 0.0
    image_encode: float = 0.0
    save: float = 0.0
    total: float = 0.0


class RenderResult(BaseModel):
    job_id: str
    model: str
    images: list[ImageFile]
    seed: int
    steps: int
    guidance: float
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


class Progress(BaseModel):
    phase: str
    step: int = 0
    steps: int = 0
    preview: str | None = None  # path of the latest TAESD preview image, when previews are on
