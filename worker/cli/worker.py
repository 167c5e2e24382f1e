"""A GPU box's own verbs: worker (the process itself), manifests (check, publish), pull (weights
into the cache), tiny-models. They need the worker extra; each handler only parses, calls the
module that owns the work, and prints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from worker.cli import extras
from worker.cli.extras import worker_settings


def register(verbs: Any) -> None:
    serving = verbs.add_parser(
        "worker", help="serve render jobs from Redis (keeps pipelines resident)"
    )
    serving.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    serving.add_argument(
        "--models",
        help="comma-separated model ids to serve (default: KILN_MODELS, else every manifest"
        " whose weights are here)",
    )
    serving.add_argument(
        "--memory-mode", help="auto, or pin a rung: full, partial, model_offload, group_offload"
    )
    serving.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    serving.add_argument("--name", help="worker name (default: RQ's host.pid name)")
    serving.add_argument(
        "--prewarm",
        action="store_true",
        help="render each model once per manifest size before taking jobs (load, compile up front)",
    )
    serving.set_defaults(handler=run_worker)
    extras.needs(serving, "worker")
    _manifest_verbs(verbs)

    pulling = verbs.add_parser(
        "pull",
        help="fetch manifests' weights into the Hugging Face cache before any job needs them",
    )
    pulling.add_argument("--models", help="comma-separated model ids (default: every manifest)")
    pulling.set_defaults(handler=pull)
    extras.needs(pulling, "worker")

    tiny = verbs.add_parser("tiny-models", help="build the tiny random-weight pipelines")
    tiny.add_argument("dir", nargs="?", type=Path, help="default: KILN_MODELS_DIR")
    tiny.add_argument("--force", action="store_true", help="rebuild even if present")
    tiny.set_defaults(handler=tiny_models)
    extras.needs(tiny, "worker")


def _manifest_verbs(verbs: Any) -> None:
    manifests = verbs.add_parser("manifests", help="check or publish model manifests")
    extras.needs(manifests, "worker")
    actions = manifests.add_subparsers(title="manifest commands", metavar="ACTION")
    check = actions.add_parser("check", help="validate every manifest; exit 1 naming each problem")
    check.add_argument("dir", nargs="?", type=Path)
    check.set_defaults(handler=manifests_check)
    publish = actions.add_parser("publish", help="publish manifests to Redis for clients")
    publish.add_argument("dir", nargs="?", type=Path)
    publish.set_defaults(handler=manifests_publish)
    new = actions.add_parser(
        "new", help="write a checked manifest for a downloaded .safetensors or .gguf file"
    )
    new.add_argument("file", type=Path)
    new.add_argument("--id", help="the model id (default: the file's name)")
    new.add_argument("--family", help="sd15, sd2, sdxl, sd3 or flux, where the file cannot tell")
    new.add_argument("--config", help="diffusers repo or directory with the configs it lacks")
    new.add_argument("--out", type=Path, help="default: the first KILN_MANIFESTS directory")
    new.set_defaults(handler=manifests_new)


def run_worker(args: argparse.Namespace) -> int:
    from worker.startup import StartClock

    clock = StartClock.from_process_start()
    clock.lap("interpreter")
    from worker.errors import ManifestDirectoryInvalid
    from worker.manifest import load_manifests

    settings = worker_settings(
        memory_mode=args.memory_mode, metrics_port=args.metrics_port, models=args.models
    )
    clock.lap("settings")
    only = list(settings.models) or None  # --models over KILN_MODELS; none: what is here
    try:
        manifests = load_manifests(settings.manifests, only)
    except ManifestDirectoryInvalid as exc:
        print(f"kiln worker: refusing to start on invalid manifests:\n{exc}", file=sys.stderr)
        return 1
    clock.lap("manifests")
    from worker.serve import serve

    return serve(
        settings, manifests, burst=args.burst, name=args.name, prewarm=args.prewarm, clock=clock
    )


def manifests_check(args: argparse.Namespace) -> int:
    from api_client.manifest import load_manifest_dir

    directory = args.dir or worker_settings().manifests
    manifests, failures = load_manifest_dir(directory)
    for failure in failures:
        for p in failure.problems:
            print(f"{failure.path}: field {p.field}: value {p.value!r}: {p.rule}", file=sys.stderr)
    print(f"{len(manifests)} valid, {len(failures)} invalid in {directory}")
    return 1 if failures else 0


def manifests_new(args: argparse.Namespace) -> int:
    from worker.ops.new_manifest import NewManifestError, new_manifest

    settings = worker_settings()
    out = args.out or next(iter(settings.manifests[1:]), None)
    if out is None:
        print("kiln manifests new: pass --out DIR or set KILN_MANIFESTS", file=sys.stderr)
        return 2
    try:
        path = new_manifest(
            args.file,
            settings.manifests,
            settings.models_dir,
            out,
            model_id=args.id,
            family=args.family,
            config=args.config,
        )
    except (NewManifestError, OSError) as exc:
        print(f"kiln manifests new: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def manifests_publish(args: argparse.Namespace) -> int:
    from api_client.connection import connect
    from api_client.redact import redact
    from worker.errors import ManifestDirectoryInvalid
    from worker.manifest import load_manifests, publish_manifests

    settings = worker_settings()
    try:
        manifests = load_manifests(args.dir or settings.manifests)
    except ManifestDirectoryInvalid as exc:
        print(f"kiln manifests publish: not publishing invalid manifests:\n{exc}", file=sys.stderr)
        return 1
    publish_manifests(connect(settings.redis_url), manifests)
    print(
        f"published {len(manifests)} manifests to {redact(settings.redis_url)}: "
        f"{', '.join(sorted(manifests))}"
    )
    return 0


def pull(args: argparse.Namespace) -> int:
    from worker.errors import ManifestDirectoryInvalid
    from worker.manifest import load_manifests
    from worker.pipelines.pull import PullError
    from worker.pipelines.pull import pull as pull_weights

    settings = worker_settings()
    only = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    try:
        manifests = load_manifests(settings.manifests, only)
        pulled = pull_weights(manifests, settings.models_dir)
    except (ManifestDirectoryInvalid, PullError) as exc:
        print(f"kiln pull: {exc}", file=sys.stderr)
        return 1
    print(f"kiln pull: {len(manifests)} models ready, {len(pulled)} fetched")
    return 0


def tiny_models(args: argparse.Namespace) -> int:
    import time

    from worker.logs import quiet_libraries

    quiet_libraries()  # before torch and diffusers are imported
    from worker.pipelines.tiny import build_tiny_models

    directory = args.dir or worker_settings().models_dir
    started = time.perf_counter()
    built = build_tiny_models(directory, force=args.force)
    for name, path in built.items():
        print(f"{name}: {path}")
    print(f"tiny models ready in {time.perf_counter() - started:.1f} s")
    return 0
