"""`kiln worker`: probe the device, build the renderer, connect to Redis and work the queues."""

from __future__ import annotations

import logging

import structlog

from api_client.manifest import Manifest
from worker import logs
from worker.faults import FaultPlan, InvalidFaults
from worker.settings import Settings

log = structlog.get_logger("kiln.worker")


def serve(
    settings: Settings, manifests: dict[str, Manifest], *, burst: bool, name: str | None
) -> int:
    logs.configure(settings.log_format)
    try:
        FaultPlan.parse(settings.faults)
    except InvalidFaults as exc:
        log.error("invalid_settings", error=str(exc))
        return 1
    servable = sorted(m.id for m in manifests.values() if not m.benchmark_only)
    if not servable:
        log.error("no_models", error="no servable manifests (all missing or benchmark_only)")
        return 1
    # Heavy imports only now: torch, diffusers.
    from worker import device as dev
    from worker.queue import make_worker, worker_connection
    from worker.render import Renderer

    info = dev.probe(settings)
    renderer = Renderer(settings, manifests, info)
    connection = worker_connection(settings.redis_url)
    connection.ping()
    worker = make_worker(connection, renderer, servable, name=name)
    if settings.metrics_port:
        from worker.metrics import start_metrics

        start_metrics(settings.metrics_port)
    log.info(
        "worker_started",
        worker=worker.name,
        models=servable,
        device=info.torch_device,
        device_name=info.name,
        memory_mode=settings.memory_mode,
        free_gb=round(info.free_bytes / 1e9, 2),
        redis=_redacted(settings.redis_url),
    )
    worker.work(burst=burst, logging_level=logging.getLevelName(logging.WARNING))
    if burst or worker.stopping:
        return 0
    # RQ's loop only ends by itself on an error it could not handle (e.g. Redis gone for longer
    # than the connection's retries): exit non-zero so a supervisor restarts the worker.
    log.error(
        "worker_exited", worker=worker.name, error="work loop ended without a shutdown request"
    )
    return 1


def _redacted(url: str) -> str:
    """Never log a Redis password."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"
