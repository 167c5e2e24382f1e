"""One timing record per job: a stopwatch over the phases, and the JSON line it becomes. The
record is the job's one account as it runs; its result is built from it (TimingRecord.result),
and the record of a job answered from the store from that result (from_result)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog
from pydantic import BaseModel, Field

from api_client.errors import MESSAGE_LIMIT, short
from api_client.samplers import Sampler, Sigmas
from api_client.schema import (
    Attempt,
    ControlReport,
    ImageFile,
    LoraChoice,
    ReferenceReport,
    RenderRequest,
    RenderResult,
    SettingsReport,
    StepCacheReport,
    TimingFit,
    Timings,
    VideoFile,
)
from worker.pipelines import samplers

if TYPE_CHECKING:
    from worker.pipelines.resident import Rendered

log = structlog.get_logger("kiln.timings")

# The resolved request's numbers a record keeps to say what its job was (TimingRecord.describe).
REQUEST_FIELDS = (
    "model",
    "num_images",
    "seed",
    "steps",
    "guidance",
    "true_cfg",
    "width",
    "height",
    "strength",
    "sampler",
    "sigmas",
    "frames",
    "fps",
)


class Stopwatch:
    """Adds wall time to named phases; sync() runs at each boundary so GPU work is charged to
    the phase that queued it, not the next one."""

    def __init__(
        self,
        sync: Callable[[], None] = lambda: None,
        scope: Callable[[str], AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.sync = sync
        self.scope = scope  # e.g. torch.profiler.record_function, so traces show kiln's phases
        self.seconds: dict[str, float] = {}
        self.current: str | None = None
        self.started = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self.current = name
        ok = False
        try:
            with self.scope(f"kiln.{name}") if self.scope else nullcontext():
                yield
            ok = True
        finally:
            if ok:
                self.sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def timings(self, queue_wait: float) -> Timings:
        return Timings(queue_wait=queue_wait, total=self.elapsed(), **self.seconds)


class PartialBlocks(BaseModel):
    """At the partial rung: how many of the denoiser's blocks stayed on the device (at least one,
    none when it has only one block) and how many were streamed in at each step."""

    resident: int
    streamed: int


class TimingRecord(BaseModel):
    """What an operator reads per job: phases, where it ran, and what was applied or skipped."""

    event: Literal["job_timing"] = "job_timing"
    job_id: str
    model: str | None = None
    status: Literal["done", "failed", "stopped"] = "failed"
    error: str | None = None
    timings: Timings = Field(default_factory=Timings)
    cold: bool = False  # first job of this pipeline and shape in this process
    seed: int | None = None
    steps: int | None = None
    guidance: float | None = None
    true_cfg: float | None = None
    mode: str = "txt2img"
    strength: float | None = None  # img2img and inpaint: how much of the input was re-noised
    scheduler: str | None = None  # the scheduler class the pipeline ran with
    # The request's sampler and sigma schedule (api_client.samplers); None: the manifest's
    # scheduler at its own sigmas.
    sampler: Sampler | None = None
    sigmas: Sigmas | None = None
    per_step_s: float | None = None
    # Denoiser steps run for this job over all its tries: `steps` when it denoised once; more when
    # out of memory ran the denoise again (out of memory in decode does not: the latents are kept).
    steps_denoised: int = 0
    partial_blocks: PartialBlocks | None = None  # the split, when the denoise ran at partial
    width: int | None = None
    height: int | None = None
    num_images: int | None = None
    frames: int | None = None  # a video's frames and frames a second
    fps: int | None = None
    peak_memory_bytes: int | None = None
    rung: str | None = None
    rung_reason: str | None = None
    # Whether the rung was chosen from what this card kind measured for the job's shape
    # (worker.memory.peaks) or from the manifest's declared figures.
    planned_from: Literal["declared", "measured"] = "declared"
    device: str | None = None
    simulated_device: str | None = None  # the KILN_DEVICE_PROFILE decisions were made as
    dtype: str | None = None
    compiled: bool = False
    # Where the weights came from: already resident, the host-RAM cache of evicted pipelines, or
    # a read from disk.
    load_source: Literal["resident", "ram", "disk"] = "resident"
    loras: list[LoraChoice] = Field(default_factory=list)  # adapters applied, at their weights
    recompiles: int = 0  # graphs torch.compile rebuilt for this pipeline after its first job
    # One entry per job of this pipeline that rebuilt graphs: what was new ("new size 192x128").
    recompile_causes: list[str] = Field(default_factory=list)
    # Seconds this job spent in torch.compile, and where its code came from: compiled here
    # (cold), this worker's Inductor cache (local), or a bundle another worker shared (fleet);
    # source None: it compiled nothing (eager, or graphs this process already held).
    compile_s: float = 0.0
    compile_source: Literal["cold", "local", "fleet"] | None = None
    step_cache: StepCacheReport | None = None  # what the job's step cache computed and reused
    controls: list[ControlReport] = Field(default_factory=list)  # ControlNets it ran with
    reference: ReferenceReport | None = None  # its IP-Adapter's, when it had a reference image
    passes: int = 1  # 2 after a hires pass (its denoise and decode add to the phases)
    previews: int = 0  # TAESD previews drawn while denoising
    quantized: dict[str, str] = Field(default_factory=dict)
    attempts: list[Attempt] = Field(default_factory=list)
    settings: SettingsReport = Field(default_factory=SettingsReport)
    worker: str | None = None  # the worker that ran this job and wrote this record
    # "store": answered from the store after the rendering worker died before committing the
    # job's end; its phases are the render's, from result.json, and rendered_by names that worker.
    answered_from: Literal["render", "store"] = "render"
    rendered_by: str | None = None
    finished_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))  # set by emit

    @property
    def steady(self) -> bool:
        """A warm render: done, not cold, and really rendered (not answered from disk after a
        crash). Only these go into medians and timing fits."""
        return (
            self.status == "done"
            and not self.cold
            and self.answered_from == "render"
            and self.timings.denoise > 0
        )

    def describe(self, request: RenderRequest) -> None:
        """What the record needs to reproduce the job: the resolved request's numbers."""
        for name in REQUEST_FIELDS:
            setattr(self, name, getattr(request, name))
        self.mode = request.mode or "txt2img"
        self.controls = [ControlReport.of(choice) for choice in request.controls or []]
        self.reference = ReferenceReport.of(request.reference)

    def ran_on(self, loaded: Rendered) -> None:
        """The pipeline this try runs on, and after decode the one that decoded (a lower rung's
        when decode descended): its rung and everything about it that changes pixels."""
        self.rung, self.dtype = loaded.rung, loaded.dtype_name
        self.compiled, self.settings = loaded.compiled, loaded.settings
        self.quantized = loaded.quantized
        self.scheduler = loaded.sampler
        if self.sampler is not None:  # the job's own, swapped in for its passes
            self.scheduler = samplers.class_name(loaded.manifest.family_row, self.sampler)

    def result(
        self,
        images: list[ImageFile],
        started_at: datetime,
        request_sha256: str,
        videos: list[VideoFile] | None = None,
    ) -> RenderResult:
        """The finished job's result: every field it shares with the record is the record's
        (RESULT_FIELDS), beside its files and clock."""
        shared = {name: getattr(self, name) for name in RESULT_FIELDS}
        return RenderResult(
            **shared,
            images=images,
            videos=videos or [],
            started_at=started_at,
            finished_at=datetime.now(timezone.utc),
            request_sha256=request_sha256,
        )

    @classmethod
    def recovered(cls, result: RenderResult) -> TimingRecord:
        """The record a worker that died right after committing the job's end did not publish:
        its render's, from the result the commit holds (worker/queue/upkeep/sweep.py)."""
        shared = {name: getattr(result, name) for name in RESULT_FIELDS}
        return cls(**shared, status="done", num_images=len(result.images))

    @classmethod
    def from_result(cls, result: RenderResult, answered_by: str) -> TimingRecord:
        """The record of a job answered from the store by worker answered_by, with the phases
        of the render that wrote result.json (its worker died before committing the job)."""
        shared = {name: getattr(result, name) for name in RESULT_FIELDS}
        return cls(
            **{**shared, "worker": answered_by},
            status="done",
            num_images=len(result.images),
            rendered_by=result.worker,
            answered_from="store",
        )


# The fields a job's record and its result share, in name and meaning (docs/contract.md,
# "Request and result" and "Timings"), each declared once in each model: the result is built from
# the record and a store-answered record from its result by these names, so neither copies them
# by hand.
# finished_at is each one's own clock: the result's when it is built, the record's at emit.
RESULT_FIELDS = tuple(
    name
    for name in RenderResult.model_fields
    if name in TimingRecord.model_fields and name != "finished_at"
)


def emit(record: TimingRecord, log_path: Path) -> None:
    """Log the record through structlog and append it to the timings log as one JSON line."""
    record.finished_at = datetime.now(timezone.utc)
    # Client-supplied text reaches records through model names and error messages: bound both.
    record.model, record.error = short(record.model), short(record.error, MESSAGE_LIMIT)
    data: dict[str, Any] = record.model_dump(mode="json")
    line = json.dumps(data, separators=(",", ":"))
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
    except OSError as exc:
        log.error("timings_log_unwritable", path=str(log_path), error=str(exc))
    fields = {k: v for k, v in data.items() if k != "event"}
    log.info("job_timing", **fields)


def read_records(log_path: Path) -> Iterator[TimingRecord]:
    """Records from a timings log; lines that are not records (truncated writes) are skipped."""
    with open(log_path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                yield TimingRecord.model_validate_json(line)
            except ValueError:
                continue


@dataclass(frozen=True)
class _Sample:
    steps: int
    seconds: float  # per image, dequeue to result, load excluded
    denoise: float  # per image
    rung: str | None


class FitTracker:
    """Per (model, width, height): seconds per image = fixed_s + steps * per_step_s, from warm
    jobs at the rung they ran on (a job on another rung starts the samples over).

    Least squares over the latest `window` jobs when they span two or more step counts; with one
    step count the split comes from the measured phases (denoise per step, the rest fixed).
    """

    def __init__(self, window: int = 50) -> None:
        self.window = window
        self._samples: dict[tuple[str, int, int], list[_Sample]] = {}

    def add(self, record: TimingRecord) -> tuple[str, int, int] | None:
        # A hires job's time is two passes at two sizes: not a sample of its first size's line.
        if not record.steady or not record.model or not record.steps or record.passes > 1:
            return None
        if record.width is None or record.height is None:
            return None
        t, images = record.timings, max(record.num_images or 1, 1)
        sample = _Sample(
            record.steps, max(t.total - t.load, 0.0) / images, t.denoise / images, record.rung
        )
        key = (record.model, record.width, record.height)
        samples = self._samples.setdefault(key, [])
        if samples and samples[-1].rung != sample.rung:
            samples.clear()
        samples.append(sample)
        del samples[: -self.window]
        return key

    def fit(self, key: tuple[str, int, int]) -> TimingFit:
        samples = self._samples[key]
        line = linear_fit([(s.steps, s.seconds) for s in samples])
        if line is not None and line[0] >= 0 and line[1] > 0:
            fixed, per_step = line
        else:
            per_step = _median([s.denoise / s.steps for s in samples])
            fixed = _median([s.seconds - s.denoise for s in samples])
        return TimingFit(
            fixed_s=fixed, per_step_s=per_step, samples=len(samples), rung=samples[-1].rung
        )


def linear_fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least squares seconds = fixed + steps * per_step; None without two distinct step counts."""
    xs = [float(x) for x, _ in points]
    if len(set(xs)) < 2:
        return None
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    covariance = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = covariance / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
