"""Prometheus metrics for `kiln worker --metrics-port`: jobs by model and status, phase seconds,
out-of-memory attempts and rung descents, jobs answered from the store, the rung each resident
model is on, device memory in use, and (read from Redis at scrape time only) the depth of each
served model's queue."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from api_client import keys
from api_client.schema import PHASES
from worker.timings import TimingRecord

JOBS = Counter(
    "kiln_jobs_total", "Jobs that ended in this worker, by model and status", ["model", "status"]
)
PHASE_SECONDS = Histogram(
    "kiln_phase_seconds",
    "Seconds per job phase (cold runs included; see the timings log for warm-only figures)",
    ["model", "phase"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
OOMS = Counter(
    "kiln_oom_total", "Out-of-memory attempts, by model, rung and phase", ["model", "rung", "phase"]
)
DESCENTS = Counter(
    "kiln_rung_descents_total",
    "Times a job stepped down the memory ladder, by model and the rung it left",
    ["model", "rung"],
)
ANSWERED_FROM_STORE = Counter(
    "kiln_jobs_answered_from_store_total",
    "Jobs answered from their stored result after a worker died before reporting it",
    ["model"],
)
RESIDENT_RUNG = Gauge(
    "kiln_resident_rung", "1 for each resident model at the rung it is loaded on", ["model", "rung"]
)
DEVICE_MEMORY = Gauge(
    "kiln_device_memory_allocated_bytes",
    "Device memory held in tensors after the last job (CPU: the process's resident set)",
)


class QueueDepth(Collector):
    """kiln_queue_depth{model}: jobs waiting per served model, read with LLEN when scraped."""

    def __init__(self, connection: Any, models: list[str]) -> None:
        self.connection = connection
        self.models = models

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("kiln_queue_depth", "Jobs waiting per model", labels=["model"])
        with self.connection.pipeline(transaction=False) as pipe:
            for model in self.models:
                pipe.llen(f"rq:queue:{keys.queue_name(model)}")
            depths = pipe.execute()
        for model, depth in zip(self.models, depths, strict=True):
            family.add_metric([model], int(depth))
        yield family


def start_metrics(port: int, connection: Any = None, models: list[str] | None = None) -> None:
    """Serve /metrics on this port from a daemon thread (with queue depths when given Redis)."""
    if connection is not None and models:
        REGISTRY.register(QueueDepth(connection, models))
    start_http_server(port)


def observe(record: TimingRecord) -> None:
    model = record.model or "unknown"
    JOBS.labels(model=model, status=record.status or "unknown").inc()
    if record.answered_from == "store":
        ANSWERED_FROM_STORE.labels(model=model).inc()
    for before, after in zip(record.attempts, record.attempts[1:], strict=False):
        if after.rung != before.rung:
            DESCENTS.labels(model=model, rung=before.rung).inc()
    for attempt in record.attempts:
        if attempt.outcome == "oom":
            OOMS.labels(model=model, rung=attempt.rung, phase=attempt.phase or "-").inc()
    if record.status != "done":
        return
    for phase in PHASES:
        PHASE_SECONDS.labels(model=model, phase=phase).observe(getattr(record.timings, phase))


def observe_resident(rungs: Mapping[str, str], allocated_bytes: int) -> None:
    """After each job: which models are resident at which rung, and device memory in use."""
    RESIDENT_RUNG.clear()
    for model, rung in rungs.items():
        RESIDENT_RUNG.labels(model=model, rung=rung).set(1)
    DEVICE_MEMORY.set(allocated_bytes)
