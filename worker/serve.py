"""`kiln worker`: probe the device, connect to Redis, build every collaborator of the worker here
(the composition root: queues, lane order, record publisher, webhook dispatcher, renderer) and
hand each in, then work the queues."""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

import structlog

from api_client.manifest import Manifest
from api_client.redact import redact
from worker import logs, quiet
from worker.errors import InvalidFaults, StoreError
from worker.files.store import open_store
from worker.memory.faults import FaultPlan, arm_crashes
from worker.settings import Settings, WebhooksInvalid, parse_targets
from worker.startup import StartClock

if TYPE_CHECKING:
    from worker.render.timings import TimingRecord

log = structlog.get_logger("kiln.worker")
PREWARM_PREFIX = "prewarm-"  # the job id of each --prewarm render


def serve(
    settings: Settings,
    manifests: dict[str, Manifest],
    *,
    burst: bool,
    name: str | None,
    prewarm: bool = False,
    clock: StartClock | None = None,
) -> int:
    clock = clock or StartClock.from_process_start()
    logs.configure(settings.log_format, secrets=settings.secrets())
    try:
        faults = FaultPlan.parse(settings.faults)
        armed = arm_crashes(settings.faults)
        open_store(settings)  # a malformed KILN_OUTPUT_URL stops the worker here, not per job
        targets = parse_targets(settings.webhooks)
        logs.configure(
            settings.log_format,
            secrets=[*settings.secrets(), *(t.secret for t in targets.values())],
        )
    except (InvalidFaults, WebhooksInvalid, StoreError) as exc:
        log.error("invalid_settings", error=str(exc))
        return 1
    from worker.queue.lease import worker_connection
    from worker.queue.pulse import watch_connection

    # Redis first, before any weight or import: an unreachable Redis is logged at the first
    # failed try (redis_lost, then redis_regained or the error), not after a minute of silence.
    connection = worker_connection(settings.redis_url)
    watch_connection(connection)
    connection.ping()
    clock.lap("redis")
    servable = sorted(m.id for m in manifests.values() if not m.benchmark_only)
    if not settings.models:
        # None named (--models, KILN_MODELS): serve what is here, never start pulling the
        # weights of every model kiln ships.
        from worker.pipelines.pull import missing

        absent = missing({m: manifests[m] for m in servable}, settings.models_dir)
        servable = [m for m in servable if m not in absent]
    if not servable:
        log.error("no_models", error=nothing_to_serve(settings, manifests))
        return 1
    # Weights before jobs: a download never runs under a job's timeout.
    if not ensure_weights(settings, {m: manifests[m] for m in servable}):
        return 1
    clock.lap("weights")
    # Heavy imports only now, and all of them before the first job, so no job pays them.
    # Before them: importing torchao asks torch for its Inductor cache directory, which pins
    # TORCHINDUCTOR_CACHE_DIR to torch's default (/tmp) if kiln has not set its own yet.
    from worker.pipelines.compile import use_persistent_cache

    use_persistent_cache(settings)
    from worker.memory import device as dev
    from worker.pipelines.compile_cache import CompileCache
    from worker.pipelines.loading import import_pipeline_classes
    from worker.queue.build import make_worker, open_queues
    from worker.queue.lanes import LaneOrder
    from worker.queue.publisher import RecordPublisher
    from worker.queue.webhooks import Dispatcher
    from worker.render.renderer import Renderer

    import_pipeline_classes([manifests[m] for m in servable])
    logs.route_library_logs()  # diffusers and transformers log through their own handlers
    clock.lap("imports")
    info = dev.probe(settings)
    clock.lap("device")
    name = name or default_worker_name()
    # Every collaborator built here, once, and handed in: no constructor rewires another.
    queues = open_queues(connection, servable)
    lanes = LaneOrder(queues)  # the order of the next pop, and so the model read ahead
    published = RecordPublisher()  # each job's record: metrics and the model's timing fit

    def records(record: TimingRecord) -> None:
        if record.job_id.startswith(PREWARM_PREFIX):  # part of the start: its load and compile
            clock.prewarmed(record.timings.load, record.compile_s)
        published(record)

    webhooks = Dispatcher.from_settings(settings, targets, connection)
    renderer = Renderer(
        settings,
        manifests,
        info,
        worker_name=name,
        on_record=records,
        faults=faults,
        webhook_targets=targets,
        upcoming=lanes.upcoming_model,
        compile_cache=CompileCache(
            connection, int(settings.compile_cache_mb * 2**20), settings.compile_cache_ttl_s
        ),
    )
    worker = make_worker(
        connection, renderer, queues, lanes=lanes, records=published, webhooks=webhooks
    )
    clock.lap("setup")
    if prewarm:
        warm(renderer, servable, worker.name)
        clock.lap("prewarm")
    if settings.metrics_port:
        from worker.queue.metrics import start_metrics

        start_metrics(settings.metrics_port, connection, servable)
    log.info(
        "worker_started",
        worker=worker.name,
        models=servable,
        device=info.torch_device,
        device_name=info.name,
        # torchao's kernels that failed to load at import (worker/quiet.py kept them off stderr)
        torchao_not_loaded=quiet.torchao_missing(),
        memory_mode=settings.memory_mode,
        free_gb=round(info.free_bytes / 1e9, 2),
        # KILN_FAULTS crash@POINT drills armed in this process (it ends itself at each)
        **({"crash_points": armed} if armed else {}),
        redis=redacted(settings.redis_url),
        startup_s=clock.report(),
    )
    worker.work(burst=burst, logging_level=logging.getLevelName(logging.WARNING))
    if worker.fatal is not None:
        log.error("worker_fatal", worker=worker.name, error=str(worker.fatal))
        return 1
    if burst or worker.stopping:
        return 0
    # RQ's loop only ends by itself on an error it could not handle (e.g. Redis gone for longer
    # than the connection's retries): exit non-zero so a supervisor restarts the worker.
    log.error(
        "worker_exited", worker=worker.name, error="work loop ended without a shutdown request"
    )
    return 1


def nothing_to_serve(settings: Settings, manifests: dict[str, Manifest]) -> str:
    """Why a worker serves nothing: the models it found, and how to serve one."""
    found = ", ".join(sorted(manifests)) or "none"
    if settings.models:
        why = f"every model named is benchmark_only (listed for `kiln bench`): {found}"
    else:
        why = (
            f"no model named (--models, KILN_MODELS) and none found has its weights in"
            f" {settings.models_dir} or the Hugging Face cache; found: {found}"
        )
    return (
        f"{why}. Serve one with `kiln worker --models ID` or KILN_MODELS=ID[,ID...] (its weights"
        " are pulled first; `kiln tiny-models` builds the tiny-* ones)"
    )


def ensure_weights(settings: Settings, manifests: dict[str, Manifest]) -> bool:
    """Pull whatever the served models lack (progress in the log); False when that fails."""
    from worker.pipelines.pull import PullError, missing, pull

    gaps = missing(manifests, settings.models_dir)
    if not gaps:
        return True
    log.info("weights_missing", models=sorted(gaps), reasons=gaps)
    try:
        pull(
            {m: manifests[m] for m in gaps},
            settings.models_dir,
            say=lambda line: log.info("pull", progress=line),
        )
    except PullError as exc:
        log.error("weights_unavailable", error=str(exc))
        return False
    return True


def warm(renderer: Any, models: list[str], worker_name: str) -> None:
    """Render each served model once at each manifest resolution before taking jobs, so load,
    torch.compile (one graph per size) and allocator growth are paid at startup, not by the
    first job of each size. Each warm-up leaves its own (cold) timing record."""
    import shutil
    import uuid

    from worker.render.context import LocalContext

    # Unique per start: a fixed id would be answered from the last start's files on disk, and
    # the warm-up (load, compile) would silently not happen.
    start = uuid.uuid4().hex[:8]
    for model_id in models:
        manifest = renderer.manifests[model_id]
        if manifest.family == "upscaler":
            continue  # no prompt to warm with; its load is a file of tens of MB
        for width, height in manifest.resolutions:
            request = {
                "model": model_id,
                "prompt": "prewarm",
                "steps": 2,
                "seed": 0,
                "width": width,
                "height": height,
            }
            job_id = f"{PREWARM_PREFIX}{worker_name}-{start}-{model_id}-{width}x{height}"
            try:
                renderer.render(request, LocalContext(job_id))
                # Nobody asked for these images; one directory per start would pile up.
                shutil.rmtree(renderer.settings.output_dir / job_id, ignore_errors=True)
            except Exception as exc:
                log.warning(
                    "prewarm_failed", model=model_id, width=width, height=height, error=str(exc)
                )
        log.info("prewarmed", model=model_id, sizes=len(manifest.resolutions))


def default_worker_name() -> str:
    """host.pid, like RQ's default, so an operator can tell the worker's machine and process."""
    return f"{socket.gethostname()}.{os.getpid()}"


def redacted(url: str) -> str:
    """Never log a Redis password (api_client.redact is the one helper)."""
    return redact(url)
