"""Prometheus metrics for `kiln worker --metrics-port`: jobs by model and status, phase seconds."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

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


def start_metrics(port: int) -> None:
    """Serve /metrics on this port from a daemon thread."""
    start_http_server(port)


def observe(record: TimingRecord) -> None:
    model = record.model or "unknown"
    JOBS.labels(model=model, status=record.status or "unknown").inc()
    if record.status != "done":
        return
    for phase in PHASES:
        PHASE_SECONDS.labels(model=model, phase=phase).observe(getattr(record.timings, phase))
