"""The wire shapes the gateway adds around api_client's own models. The request is
api_client.schema.RenderRequest and the result RenderResult, both unchanged: the OpenAPI document
is generated from them, so there is one source for the contract."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from api_client.manifest import Manifest
from api_client.schema import JobSnapshot, Progress, WorkerState

PROBLEM_JSON = "application/problem+json"


class FieldError(BaseModel):
    """One broken rule, as RequestRejected names it."""

    field: str
    value: Any = None
    rule: str


class ProblemDetail(BaseModel):
    """RFC 9457 problem details; `errors` lists each broken rule of a refused request."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    errors: list[FieldError] = Field(default_factory=list)


class JobLinks(BaseModel):
    self: str
    events: str
    cancel: str


class JobCreated(BaseModel):
    """A job made (or found again): served is whether a live worker serves its model now; when
    none does, warnings says so (the job waits in its queue until one starts)."""

    id: str
    status: str
    served: bool = True
    warnings: list[str] = Field(default_factory=list)
    urls: JobLinks


class JobView(JobSnapshot):
    """A job as GET /v1/jobs/{id} shows it: the Python client's job.snapshot() (status is
    job.status()'s: queued, scheduled, started, finished, failed, stopped, canceled or
    quarantined, the last five ends; position the jobs ahead of it in its queue, 0: next), with
    result.images[].url and result.videos[].url this gateway's URLs for a local store,
    presigned ones for S3."""

    urls: JobLinks


class JobList(BaseModel):
    jobs: list[JobView]


class Canceled(BaseModel):
    """What the cancel did: canceled (it was waiting, and will never run) or stopping (it was
    running, and stops at its next denoise step); a job that had already ended answers its end
    (finished, failed, stopped, canceled)."""

    status: str


class Uploaded(BaseModel):
    uri: str
    sha256: str
    width: int | None = None
    height: int | None = None


class ModelView(BaseModel):
    """A published manifest with what serves it: the page builds its form from this."""

    manifest: Manifest
    workers: list[str]
    resident_on: list[str]
    queued: dict[str, int]
    blocked: dict[str, str]
    default_eta_s: float | None = None
    eta_now_s: float | None = None
    # The sigma schedules each of its samplers (manifest.samplers) takes on its family.
    sigmas: dict[str, list[str]] = Field(default_factory=dict)
    # A video family's frames are frame_step * k + 1 (FamilyRow.frame_step); 0: images.
    frame_step: int = 0


class ModelList(BaseModel):
    models: list[ModelView]


class WorkerView(BaseModel):
    state: WorkerState
    progress: Progress | None = None  # of its running job, from that job's newest events


class WorkerList(BaseModel):
    workers: list[WorkerView]


class QueueView(BaseModel):
    model: str
    lane: str
    depth: int
    workers: list[str]
    eta_now_s: float | None = None  # a default job submitted now to this lane


class QueueList(BaseModel):
    queues: list[QueueView]


class Health(BaseModel):
    status: str
