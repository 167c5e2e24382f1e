"""One timing record per job: a stopwatch over the phases, and the JSON line it becomes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, Field

from api_client.schema import Attempt, SettingsReport, Timings

log = structlog.get_logger("kiln.timings")


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


class TimingRecord(BaseModel):
    """What an operator reads per job: phases, where it ran, and what was applied or skipped."""

    event: Literal["job_timing"] = "job_timing"
    job_id: str
    model: str | None = None
    status: Literal["done", "failed", "stopped"] = "failed"
    error: str | None = None
    timings: Timings = Field(default_factory=Timings)
    cold: bool = False  # first job of this pipeline and shape in this process
    steps: int | None = None
    per_step_s: float | None = None
    width: int | None = None
    height: int | None = None
    num_images: int | None = None
    peak_memory_bytes: int | None = None
    rung: str | None = None
    rung_reason: str | None = None
    device: str | None = None
    simulated_device: str | None = None  # the KILN_DEVICE_PROFILE decisions were made as
    dtype: str | None = None
    compiled: bool = False
    recompiles: int = 0  # graphs torch.compile rebuilt for this pipeline after its first job
    previews: int = 0  # TAESD previews drawn while denoising
    quantized: dict[str, str] = Field(default_factory=dict)
    attempts: list[Attempt] = Field(default_factory=list)
    settings: SettingsReport = Field(default_factory=SettingsReport)
    worker: str | None = None
    finished_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))  # set by emit

    @property
    def steady(self) -> bool:
        """A warm render: done, not cold, and really rendered (not answered from disk after a
        crash). Only these go into medians and timing fits."""
        return self.status == "done" and not self.cold and self.timings.denoise > 0


def emit(record: TimingRecord, log_path: Path) -> None:
    """Log the record through structlog and append it to the timings log as one JSON line."""
    record.finished_at = datetime.now(timezone.utc)
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


class FitTracker:
    """Per (model, width, height): seconds = fixed_s + steps * per_step_s, from warm jobs only.

    per_step_s is the median denoise time per step and image; fixed_s the median of everything
    else a job costs after it is dequeued (text encode, decode, encode, save), per image.
    """

    def __init__(self, window: int = 50) -> None:
        self.window = window
        self._samples: dict[tuple[str, int, int], list[tuple[float, float]]] = {}

    def add(self, record: TimingRecord) -> tuple[str, int, int] | None:
        if not record.steady or not record.model or not record.steps:
            return None
        if record.width is None or record.height is None:
            return None
        t, images = record.timings, max(record.num_images or 1, 1)
        per_step = t.denoise / record.steps / images
        fixed = max(t.total - t.load - t.denoise, 0.0) / images
        key = (record.model, record.width, record.height)
        samples = self._samples.setdefault(key, [])
        samples.append((fixed, per_step))
        del samples[: -self.window]
        return key

    def fit(self, key: tuple[str, int, int]) -> dict[str, float | int]:
        samples = self._samples[key]
        return {
            "fixed_s": _median([s[0] for s in samples]),
            "per_step_s": _median([s[1] for s in samples]),
            "samples": len(samples),
        }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
