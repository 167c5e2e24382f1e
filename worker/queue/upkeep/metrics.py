"""Prometheus metrics for `kiln worker --metrics-port`: jobs by model and status, phase seconds,
out-of-memory attempts and rung descents, jobs answered from the store, recompiles by cause,
compile seconds by source, loads by source, the rung each resident model is on, device memory in
use, and (read from Redis at scrape time only) the depth of each served model's queue and the ETA
of its next default job.

Labels are bounded sets (model ids, rungs, phases, statuses, the CAUSES below): never a job id, a
prompt or a raw message. docker/grafana/dashboards/kiln.json reads these names
(tests/test_dashboard.py holds the two together)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any, get_args

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError

from api_client import keys
from api_client.manifest import Manifest
from api_client.schema import PHASES
from worker.queue.upkeep.backlog import backlogs
from worker.render.timings import TimingRecord

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
RECOMPILES = Counter(
    "kiln_recompiles_total",
    "Graphs torch.compile rebuilt for a warm pipeline, by model and what was new (see CAUSES)",
    ["model", "cause"],
)
COMPILE_SECONDS = Counter(
    "kiln_compile_seconds_total",
    "Seconds jobs spent in torch.compile, by where the code came from: compiled in this worker"
    " (cold), its Inductor cache (local), or a bundle another worker shared (fleet)",
    ["model", "source"],
)
LOADS = Counter(
    "kiln_loads_total",
    "Jobs by where their pipeline came from: resident already, the host-RAM cache, or disk",
    ["model", "source"],
)
RESIDENT_RUNG = Gauge(
    "kiln_resident_rung", "1 for each resident model at the rung it is loaded on", ["model", "rung"]
)
DEVICE_MEMORY = Gauge(
    "kiln_device_memory_allocated_bytes",
    "Device memory held in tensors after the last job (CPU: the process's resident set)",
)
WAITING_FOR_MEMORY = Gauge(
    "kiln_waiting_for_memory",
    "1 while this worker takes no jobs: no served model's measured need fits its memory",
)


# The label values of kiln_recompiles_total, from the start of each recompile cause the renderer
# writes (LoadedPipeline.novelty in worker/pipelines/resident.py, "new adapter set" from the LoRA
# swap): a cause's text names sizes and modes, which would make a new series per size.
CAUSES = (
    ("new size", "size"),
    ("new batch", "batch"),
    ("guidance", "guidance"),
    ("new mode", "mode"),
    ("new adapter", "adapters"),
)


def cause_category(cause: str) -> str:
    """size, batch, guidance, mode, adapters, or other (a guard on another input failed)."""
    return next((label for start, label in CAUSES if cause.startswith(start)), "other")


def graphs_in(cause: str) -> int:
    """The graph count a cause ends with ("new size 192x128: 3 graph(s)"), else 1."""
    count = re.search(r": (\d+) graph", cause)
    return int(count.group(1)) if count else 1


class QueueDepth(Collector):
    """kiln_queue_depth{model} (LLEN) and kiln_queue_eta_seconds{model} (a default job submitted
    now, worker/queue/upkeep/backlog.py) for each served model, read from Redis when scraped. A
    model whose default size has no measured fit yet has no ETA sample."""

    def __init__(self, connection: Any, models: list[str]) -> None:
        self.connection = connection
        self.models = models

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily("kiln_queue_depth", "Jobs waiting per model", labels=["model"])
        eta = GaugeMetricFamily(
            "kiln_queue_eta_seconds",
            "Seconds until a default job of this model submitted now would have its result",
            labels=["model"],
        )
        published = self.connection.hmget(keys.MANIFESTS_KEY, self.models)
        manifests = {}
        for model, raw in zip(self.models, published, strict=True):
            try:
                manifests[model] = Manifest.model_validate_json(raw or b"")
            except ValidationError:  # none published (or retyped): no ETA, the depth still shows
                continue
        for backlog in backlogs(self.connection, self.models, manifests):
            depth.add_metric([backlog.model], backlog.depth)
            if backlog.eta_s is not None:
                eta.add_metric([backlog.model], backlog.eta_s)
        yield depth
        yield eta


def start_metrics(port: int, connection: Any = None, models: list[str] | None = None) -> None:
    """Serve /metrics on this port from a daemon thread (with queue depths when given Redis)."""
    if connection is not None and models:
        REGISTRY.register(QueueDepth(connection, models))
    for model in models or []:
        zero_series(model)
    start_http_server(port)


def zero_series(model: str) -> None:
    """The bounded series of a served model at 0 from the start, so the first event is an
    increase() Prometheus sees and a dashboard panel is empty only when nothing happened."""
    for status in get_args(TimingRecord.model_fields["status"].annotation):
        JOBS.labels(model=model, status=status)
    for source in get_args(TimingRecord.model_fields["load_source"].annotation):
        LOADS.labels(model=model, source=source)
    for cause in (*(label for _, label in CAUSES), "other"):
        RECOMPILES.labels(model=model, cause=cause)
    for source in get_args(get_args(TimingRecord.model_fields["compile_source"].annotation)[0]):
        COMPILE_SECONDS.labels(model=model, source=source)
    ANSWERED_FROM_STORE.labels(model=model)


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
    for cause in record.recompile_causes:
        RECOMPILES.labels(model=model, cause=cause_category(cause)).inc(graphs_in(cause))
    if record.compile_source is not None:
        COMPILE_SECONDS.labels(model=model, source=record.compile_source).inc(record.compile_s)
    if record.rung is not None and record.answered_from == "render":  # a pipeline was placed
        LOADS.labels(model=model, source=record.load_source).inc()
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
