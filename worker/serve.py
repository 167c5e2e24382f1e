"""`kiln worker`: probe the device, connect to Redis, build every collaborator of the worker here
(the composition root: queues, lane order, record publisher, webhook dispatcher, renderer) and
hand each in, then work the queues."""

from __future__ import annotations

import gc
import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from api_client.manifest import Manifest
from api_client.redact import redact
from worker import logs, quiet
from worker.crashes import arm_crashes
from worker.errors import InvalidFaults, StoreError
from worker.files.store import open_store
from worker.memory.faults import FaultPlan
from worker.settings import Settings, WebhooksInvalid, WebhookTarget, parse_targets
from worker.startup import StartClock

if TYPE_CHECKING:
    from redis import Redis

    from worker.memory.device import DeviceInfo
    from worker.queue.worker import KilnWorker
    from worker.render.renderer import Renderer
    from worker.render.timings import TimingRecord

log = structlog.get_logger("kiln.worker")
PREWARM_PREFIX = "prewarm-"  # the job id of each --prewarm render


@dataclass(frozen=True)
class Checked:
    """What the settings give that a worker refuses to start without."""

    faults: FaultPlan
    armed: list[str]  # KILN_FAULTS crash@POINT drills armed in this process
    targets: dict[str, WebhookTarget]


def serve(
    settings: Settings,
    manifests: dict[str, Manifest],
    *,
    burst: bool,
    name: str | None,
    prewarm: bool = False,
    clock: StartClock | None = None,
) -> int:
    """`kiln worker`'s exit status: 0 after a burst or a shutdown request, 1 when it cannot
    start or its work loop ended by itself (a supervisor restarts it)."""
    clock = clock or StartClock.from_process_start()
    # 1. Settings a worker cannot start with end it here, not at its first job.
    checked = check_settings(settings)
    if checked is None:
        return 1
    # 2. Redis first, before any weight or import: an unreachable Redis is logged at the first
    # failed try (redis_lost, then redis_regained or the error), not after a minute of silence.
    from worker.queue.lease import worker_connection
    from worker.queue.upkeep.pulse import watch_connection

    connection = worker_connection(settings.redis_url)
    watch_connection(connection)
    connection.ping()
    clock.lap("redis")
    # 3. The models it serves, their weights here before any job (a download never runs under
    # a job's timeout).
    servable = served_models(settings, manifests)
    if not servable:
        log.error("no_models", error=nothing_to_serve(settings, manifests))
        return 1
    if not ensure_weights(settings, {m: manifests[m] for m in servable}):
        return 1
    clock.lap("weights")
    # 4. Every collaborator built once and handed in; then the prewarm and the metrics.
    worker, renderer, info = build(settings, manifests, servable, connection, checked, name, clock)
    if prewarm:
        warm(renderer, servable, worker.name)
        clock.lap("prewarm")
    if settings.metrics_port:
        from worker.queue.upkeep.metrics import start_metrics

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
        **({"crash_points": checked.armed} if checked.armed else {}),
        redis=redacted(settings.redis_url),
        startup_s=clock.report(),
    )
    # 5. Work the queues until a burst ends, a shutdown is asked for, or the worker must stop.
    worker.work(burst=burst, logging_level=logging.getLevelName(logging.WARNING))
    # The process ends next, and its last collection of all that torch and diffusers made took
    # 5.4 s of a 6.9 s shutdown on 2 cores: those objects are left to the exit, uncollected.
    gc.freeze()
    return exit_status(worker, burst)


def check_settings(settings: Settings) -> Checked | None:
    """The fault plan, the store and the webhook targets, parsed once (logs configured to hide
    the targets' secrets too); None, with the reason logged, when one is invalid."""
    logs.configure(settings.log_format, secrets=settings.secrets())
    try:
        faults = FaultPlan.parse(settings.faults)
        armed = arm_crashes(settings.faults)
        open_store(settings)  # a malformed KILN_OUTPUT_URL stops the worker here, not per job
        targets = parse_targets(settings.webhooks)
    except (InvalidFaults, WebhooksInvalid, StoreError) as exc:
        log.error("invalid_settings", error=str(exc))
        return None
    logs.configure(
        settings.log_format,
        secrets=[*settings.secrets(), *(t.secret for t in targets.values())],
    )
    return Checked(faults, armed, targets)


def served_models(settings: Settings, manifests: dict[str, Manifest]) -> list[str]:
    """The models named (--models, KILN_MODELS) that are not benchmark_only; none named: those
    whose weights are here (never start pulling the weights of every model kiln ships)."""
    servable = sorted(m.id for m in manifests.values() if not m.benchmark_only)
    if settings.models:
        return servable
    from worker.pipelines.pull import missing

    absent = missing({m: manifests[m] for m in servable}, settings.models_dir)
    return [m for m in servable if m not in absent]


def build(
    settings: Settings,
    manifests: dict[str, Manifest],
    servable: list[str],
    connection: Redis,
    checked: Checked,
    name: str | None,
    clock: StartClock,
) -> tuple[KilnWorker, Renderer, DeviceInfo]:
    """The composition root: the heavy imports (all before the first job, so no job pays
    them), the device probe, then every collaborator of the worker, built here and handed in."""
    # Before the imports: importing torchao asks torch for its Inductor cache directory, which
    # pins TORCHINDUCTOR_CACHE_DIR to torch's default (/tmp) if kiln has not set its own yet.
    from worker.pipelines.compile import use_persistent_cache

    use_persistent_cache(settings)
    from worker.memory import device as dev
    from worker.pipelines.compile_cache import CompileCache
    from worker.pipelines.loading import import_pipeline_classes
    from worker.queue.build import make_worker, open_queues
    from worker.queue.lanes import LaneOrder
    from worker.queue.upkeep.publisher import RecordPublisher
    from worker.queue.upkeep.webhooks import Dispatcher
    from worker.render.renderer import Renderer

    import_pipeline_classes([manifests[m] for m in servable])
    logs.route_library_logs()  # diffusers and transformers log through their own handlers
    clock.lap("imports")
    info = dev.probe(settings)
    clock.lap("device")
    queues = open_queues(connection, servable)
    lanes = LaneOrder(queues)  # the order of the next pop, and so the model read ahead
    published = RecordPublisher()  # each job's record: metrics and the model's timing fit

    def records(record: TimingRecord) -> None:
        if record.job_id.startswith(PREWARM_PREFIX):  # part of the start: its load and compile
            clock.prewarmed(record.timings.load, record.compile_s)
        published(record)

    webhooks = Dispatcher.from_settings(settings, checked.targets, connection)
    renderer = Renderer(
        settings,
        manifests,
        info,
        worker_name=name or default_worker_name(),
        on_record=records,
        faults=checked.faults,
        webhook_targets=checked.targets,
        upcoming=lanes.upcoming_model,
        compile_cache=CompileCache(
            connection, int(settings.compile_cache_mb * 2**20), settings.compile_cache_ttl_s
        ),
    )
    worker = make_worker(
        connection, renderer, queues, lanes=lanes, records=published, webhooks=webhooks
    )
    clock.lap("setup")
    return worker, renderer, info


def exit_status(worker: KilnWorker, burst: bool) -> int:
    """0 after a burst or a shutdown request; 1 for a fatal error, or a work loop that ended by
    itself: RQ's loop only does on an error it could not handle (e.g. Redis gone for longer
    than the connection's retries), and a supervisor should restart the worker."""
    if worker.fatal is not None:
        log.error("worker_fatal", worker=worker.name, error=str(worker.fatal))
        return 1
    if burst or worker.stopping:
        return 0
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
        if not manifest.family_row.prompted:
            continue  # no prompt to warm with (an upscaler: its load is a file of tens of MB)
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
