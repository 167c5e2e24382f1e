"""The `kiln` command: the parser for every verb, main, and the worker-side verbs' handlers;
the client verbs' handlers are in worker/commands.py. Imports stay inside each verb so
`kiln --help` never loads torch.

Over 400 lines because the parser declares every flag of twenty verbs in one place, so
`kiln --help` and the flags read in one file; each handler here only parses, calls the module
that owns the work, and prints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from worker import commands


def main(argv: list[str] | None = None) -> int:
    from worker import quiet

    quiet.install()  # before any verb imports the stack: its harmless notices (worker/quiet.py)
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # redis is imported by the verbs that talk to it, never up front (kiln --help stays light).
        redis_errors = sys.modules.get("redis.exceptions")
        if redis_errors is not None and isinstance(exc, redis_errors.ConnectionError):
            from api_client.redact import redact

            settings = _settings()
            message = f"cannot reach Redis at {settings.redis_url}: {exc}"
            print(f"kiln {args.verb}: {redact(message, settings.secrets())}", file=sys.stderr)
            return 1
        pydantic = sys.modules.get("pydantic")
        if pydantic is not None and isinstance(exc, pydantic.ValidationError):
            _print_invalid(args.verb, exc)
            return 2
        raise


def _print_invalid(verb: str, exc: Any) -> None:
    """One line per error of a pydantic ValidationError. Only the Settings model's errors are
    KILN_* variables; any other model's (a request, a fit or a state read from Redis) name that
    model and its field, so a bad value in Redis is never blamed on the environment."""
    from api_client.errors import short

    for error in exc.errors():
        value = short(error.get("input"), 200)
        if exc.title == "Settings":
            where = "KILN_" + "_".join(str(p) for p in error["loc"]).upper()
            print(f"kiln {verb}: {where}={value!r}: {error['msg']}", file=sys.stderr)
        else:
            field = ".".join(str(p) for p in error["loc"]) or "value"
            message = f"{exc.title} field {field}={value!r}: {error['msg']}"
            print(f"kiln {verb}: {message}", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="A render worker for diffusion models."
    )
    verbs = parser.add_subparsers(title="commands", metavar="COMMAND", dest="verb")

    worker = verbs.add_parser(
        "worker", help="serve render jobs from Redis (keeps pipelines resident)"
    )
    worker.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    worker.add_argument(
        "--models",
        help="comma-separated model ids to serve (default: KILN_MODELS, else every manifest"
        " whose weights are here)",
    )
    worker.add_argument(
        "--memory-mode", help="auto, or pin a rung: full, partial, model_offload, group_offload"
    )
    worker.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    worker.add_argument("--name", help="worker name (default: RQ's host.pid name)")
    worker.add_argument(
        "--prewarm",
        action="store_true",
        help="render each model once per manifest size before taking jobs (load, compile up front)",
    )
    worker.set_defaults(handler=_worker)

    submit = verbs.add_parser("submit", help="enqueue one render job")
    submit.add_argument("prompt")
    submit.add_argument("--model", required=True)
    submit.add_argument("--negative-prompt")
    submit.add_argument("--steps", type=int)
    submit.add_argument(
        "--guidance", type=float, help="CFG; FLUX.1: its embedded guidance (dev 3.5, schnell 0)"
    )
    submit.add_argument(
        "--true-cfg",
        type=float,
        help="true CFG against the negative prompt (FLUX.1, Qwen-Image; where the manifest allows)",
    )
    submit.add_argument(
        "--mode",
        choices=["txt2img", "img2img", "inpaint", "edit"],
        help="default: from --image/--mask (an edit model's --image: edit)",
    )
    submit.add_argument("--image", help="input image: a local file (uploaded) or a kiln-input: uri")
    submit.add_argument("--mask", help="inpaint mask (white: repaint), as --image")
    submit.add_argument("--strength", type=float, help="img2img/inpaint: 0-1, how much to repaint")
    submit.add_argument(
        "--lora",
        dest="loras",
        action="append",
        type=commands.request_flag("api_client.loras", "parse_lora_flag"),
        metavar="NAME[:WEIGHT]",
        help="an adapter the manifest allows, at its default weight or WEIGHT (repeatable)",
    )
    submit.add_argument(
        "--control",
        dest="controls",
        action="append",
        type=commands.request_flag("api_client.controls", "parse_control_flag"),
        metavar="NAME:PATH[:STRENGTH]",
        help="a ControlNet the manifest allows, steered by the image at PATH (a local file,"
        " uploaded, or a kiln-input: uri; the job's size) at STRENGTH 0-2 (default 1);"
        " repeatable, up to 2",
    )
    submit.add_argument(
        "--control-preprocess",
        choices=["none", "canny"],
        help="what the worker computes from each --control image first (default none: the image"
        " is the map; canny: its edges)",
    )
    submit.add_argument(
        "--reference",
        type=commands.request_flag("api_client.references", "parse_reference_flag"),
        metavar="PATH[:STRENGTH]",
        help="a reference image through the manifest's IP-Adapter (a local file, uploaded, or a"
        " kiln-input: uri; any size) at STRENGTH 0-2 (default 1)",
    )
    submit.add_argument(
        "--hires",
        type=float,
        metavar="SCALE",
        help="a hires pass: render, make SCALE times larger (above 1, at most 4), img2img again",
    )
    submit.add_argument(
        "--hires-upscaler",
        metavar="ID",
        help="the hires pass's upscaler manifest (default latent: the latents, bilinear)",
    )
    submit.add_argument("--hires-strength", type=float, help="the hires img2img's strength (0.5)")
    submit.add_argument("--hires-steps", type=int, help="the hires img2img's steps (the request's)")
    submit.add_argument("--width", type=int)
    submit.add_argument("--height", type=int)
    submit.add_argument("--seed", type=int)
    submit.add_argument("--num-images", type=int)
    submit.add_argument("--format", dest="output_format", choices=["png", "webp", "jpeg"])
    submit.add_argument(
        "--previews",
        action="store_true",
        default=None,
        help="draw TAESD previews while denoising (models whose manifest names taesd)",
    )
    submit.add_argument(
        "--rung",
        help="pin a rung of the memory ladder, e.g. full (never descends; replays pin it)",
    )
    submit.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="pin torch.compile of the denoiser on or off (fails naming why if it cannot)",
    )
    submit.add_argument(
        "--step-cache",
        action=argparse.BooleanOptionalAction,
        help="reuse denoiser steps (a fast draft) or compute every step (the exact final);"
        " unset: the worker's KILN_STEP_CACHE decides",
    )
    submit.add_argument("--webhook", help="a webhook target named in the workers' KILN_WEBHOOKS")
    submit.add_argument("--job-id", help="idempotency key: the same id twice renders once")
    submit.add_argument(
        "--front", action="store_true", help="put the job at the front of its queue"
    )
    submit.add_argument(
        "--priority",
        choices=["interactive", "batch"],
        help="its lane: interactive (default) goes ahead of batch; batch is never starved",
    )
    submit.add_argument("--wait", action="store_true", help="wait for the result, showing progress")
    submit.add_argument(
        "--timeout", type=float, default=600.0, help="seconds --wait gives up after (exit 3)"
    )
    submit.add_argument(
        "--queue-anyway",
        action="store_true",
        help="--wait even when no live worker serves the model (else: exit 4 within seconds)",
    )
    submit.add_argument("--json", action="store_true", help="print machine-readable JSON")
    submit.set_defaults(handler=commands.submit)

    replay = verbs.add_parser(
        "replay",
        help="render an image again from the generation details it carries (through the queue,"
        " pinned to its rung and compile state)",
    )
    replay.add_argument("image", help="a PNG, WebP or JPEG that kiln wrote (a path or file:// uri)")
    replay.add_argument("--wait", action="store_true", help="wait for the result, showing progress")
    replay.add_argument(
        "--timeout", type=float, default=600.0, help="seconds --wait gives up after (exit 3)"
    )
    replay.add_argument(
        "--queue-anyway",
        action="store_true",
        help="--wait even when no live worker serves the model (else: exit 4 within seconds)",
    )
    replay.add_argument(
        "--json", action="store_true", help="print JSON: the new RenderResult with --wait"
    )
    replay.set_defaults(handler=commands.replay)

    models = verbs.add_parser("models", help="published models, the workers serving them, and ETAs")
    models.add_argument("--json", action="store_true")
    models.set_defaults(handler=commands.models)

    manifests = verbs.add_parser("manifests", help="check or publish model manifests")
    manifest_verbs = manifests.add_subparsers(title="manifest commands", metavar="ACTION")
    check = manifest_verbs.add_parser(
        "check", help="validate every manifest; exit 1 naming each problem"
    )
    check.add_argument("dir", nargs="?", type=Path)
    check.set_defaults(handler=_manifests_check)
    publish = manifest_verbs.add_parser("publish", help="publish manifests to Redis for clients")
    publish.add_argument("dir", nargs="?", type=Path)
    publish.set_defaults(handler=_manifests_publish)

    doctor = verbs.add_parser(
        "doctor", help="device, memory, dtypes, attention, compile, torchao, Redis"
    )
    doctor.add_argument("--model", help="also load this model and print its switch report")
    doctor.add_argument(
        "--profile",
        help="decide as this card (t4, l4, a100, h100, h200, mi300, mps; NAME:FREE_GIB): the rung,"
        " dtype, switches and quantize schemes of every manifest there; exit 1 if one cannot run",
    )
    doctor.add_argument(
        "--json",
        action="store_true",
        help="print JSON: with --profile one object per manifest (model, runs, rung, dtype,"
        " quantize, resident_gb, reason)",
    )
    doctor.set_defaults(handler=_doctor)

    pull = verbs.add_parser(
        "pull",
        help="fetch manifests' weights into the Hugging Face cache before any job needs them",
    )
    pull.add_argument("--models", help="comma-separated model ids (default: every manifest)")
    pull.set_defaults(handler=_pull)

    bench = verbs.add_parser(
        "bench", help="a prompt suite over a matrix of models/steps/sizes/settings"
    )
    bench.add_argument("--suite", type=Path, default=Path("bench/suites/prompts-8.json"))
    bench.add_argument("--matrix", type=Path, default=Path("bench/matrices/tiny-steps.json"))
    bench.add_argument(
        "--through-queue", action="store_true", help="submit through Redis to running workers"
    )
    bench.add_argument("--out", type=Path, help="results directory (default bench/results/<time>)")
    bench.set_defaults(handler=_bench)

    profile = verbs.add_parser(
        "profile", help="torch.profiler table and chrome trace of one render"
    )
    profile.add_argument("--model", required=True)
    profile.add_argument("--prompt", default="a red fox in fresh snow, golden hour")
    profile.add_argument("--steps", type=int)
    profile.add_argument("--width", type=int)
    profile.add_argument("--height", type=int)
    profile.add_argument("--seed", type=int, default=0)
    profile.add_argument(
        "--warmup", type=int, default=1, help="unprofiled renders first (load, compile)"
    )
    profile.add_argument("--trace", type=Path, help="write a chrome trace here")
    profile.set_defaults(handler=_profile)

    tiny = verbs.add_parser("tiny-models", help="build the tiny random-weight pipelines")
    tiny.add_argument("dir", nargs="?", type=Path, help="default: KILN_MODELS_DIR")
    tiny.add_argument("--force", action="store_true", help="rebuild even if present")
    tiny.set_defaults(handler=_tiny_models)

    timings = verbs.add_parser(
        "timings", help="per-model phase medians and p90 from the timings log"
    )
    timings.add_argument("log", nargs="?", type=Path, help="default: KILN_TIMINGS_LOG")
    timings.add_argument("--csv", type=Path, help="also write every record as CSV")
    timings.add_argument("--chart", type=Path, help="also draw a PNG chart of phase medians")
    timings.add_argument("--last", type=int, help="show the last N jobs one per row")
    timings.set_defaults(handler=_timings)

    top = verbs.add_parser(
        "top", help="live view: workers, resident models and rungs, queues, last jobs"
    )
    top.add_argument("--once", action="store_true", help="print one frame as plain text and exit")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--last", type=int, default=10, help="how many ended jobs to show")
    top.set_defaults(handler=commands.top)

    job = verbs.add_parser(
        "job", help="one job by id: status, queue position, ETA, progress, result or error"
    )
    job.add_argument("id")
    job.add_argument("--json", action="store_true")
    job.set_defaults(handler=commands.job)
    cancel = verbs.add_parser(
        "cancel", help="cancel a job by id (queued: removed; running: stopped at its next step)"
    )
    cancel.add_argument("id")
    cancel.set_defaults(handler=commands.cancel)
    fetch = verbs.add_parser("fetch", help="a finished job's images into DIR, sha256 checked")
    fetch.add_argument("id")
    fetch.add_argument("dir", nargs="?", default=".", type=Path, help="default: here")
    fetch.set_defaults(handler=commands.fetch)
    jobs = verbs.add_parser("jobs", help="recent jobs, newest first (from the queues' events)")
    jobs.add_argument("--model", help="one model's jobs only")
    jobs.add_argument("--limit", type=int, default=20)
    jobs.add_argument("--json", action="store_true")
    jobs.set_defaults(handler=commands.jobs)

    api = verbs.add_parser(
        "api", help="the HTTP gateway and web page over the same Redis (needs kiln[api])"
    )
    api.add_argument("--host", help="bind address (KILN_API_HOST, default 127.0.0.1)")
    api.add_argument("--port", type=int, help="port (KILN_API_PORT, default 8700)")
    api.set_defaults(handler=commands.api)
    api_verbs = api.add_subparsers(title="api commands", metavar="ACTION")
    token = api_verbs.add_parser("token", help="API tokens, kept hashed in Redis")
    token_verbs = token.add_subparsers(title="token commands", metavar="ACTION")
    create = token_verbs.add_parser("create", help="make a token; it is printed once, alone")
    create.add_argument("name", help="1-64 letters, digits, . _ or -")
    create.add_argument(
        "--scope", choices=["jobs", "admin"], default="jobs", help="jobs: its own jobs (default)"
    )
    create.add_argument(
        "--max-queued",
        type=int,
        metavar="N",
        help="its jobs queued or running at once (default KILN_API_MAX_QUEUED, 100; admin: none)",
    )
    create.add_argument(
        "--upload-mb",
        type=float,
        metavar="M",
        help="its upload MB held in Redis at once (default KILN_API_UPLOAD_MB, 256; admin: none)",
    )
    create.add_argument(
        "--expires", type=float, metavar="DAYS", help="it stops working after DAYS (default never)"
    )
    create.set_defaults(handler=commands.token_create)
    listed = token_verbs.add_parser(
        "list", help="token names, scopes, when each was made and expires, limits"
    )
    listed.set_defaults(handler=commands.token_list)
    revoke = token_verbs.add_parser("revoke", help="revoke a token by name, on every replica")
    revoke.add_argument("name")
    revoke.set_defaults(handler=commands.token_revoke)

    quarantine = verbs.add_parser(
        "quarantine", help="job records kiln could not read or that killed workers, with reasons"
    )
    quarantine.add_argument("--clear", metavar="ID", help="drop this entry (`all`: every entry)")
    quarantine.add_argument("--json", action="store_true", help="one JSON object per entry")
    quarantine.set_defaults(handler=commands.quarantine)

    webhooks = verbs.add_parser(
        "webhooks",
        help="deliveries waiting, retrying, and dead letters with the receiver's last answer",
    )
    webhooks.add_argument(
        "--resend", metavar="ID", help="send this dead letter again (same webhook-id, tries reset)"
    )
    webhooks.set_defaults(handler=commands.webhooks)
    return parser


def _settings(**overrides: Any) -> Any:
    """KILN_* settings, with command-line flags (validated the same way) over them."""
    from worker.settings import Settings

    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _worker(args: argparse.Namespace) -> int:
    from worker.startup import StartClock

    clock = StartClock.from_process_start()
    clock.lap("interpreter")
    from worker.errors import ManifestDirectoryInvalid
    from worker.manifest import load_manifests

    settings = _settings(
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


def _manifests_check(args: argparse.Namespace) -> int:
    from api_client.manifest import load_manifest_dir

    directory = args.dir or _settings().manifests
    manifests, failures = load_manifest_dir(directory)
    for failure in failures:
        for p in failure.problems:
            print(f"{failure.path}: field {p.field}: value {p.value!r}: {p.rule}", file=sys.stderr)
    print(f"{len(manifests)} valid, {len(failures)} invalid in {directory}")
    return 1 if failures else 0


def _manifests_publish(args: argparse.Namespace) -> int:
    from api_client.connection import connect
    from worker.errors import ManifestDirectoryInvalid
    from worker.manifest import load_manifests, publish_manifests

    settings = _settings()
    try:
        manifests = load_manifests(args.dir or settings.manifests)
    except ManifestDirectoryInvalid as exc:
        print(f"kiln manifests publish: not publishing invalid manifests:\n{exc}", file=sys.stderr)
        return 1
    publish_manifests(connect(settings.redis_url), manifests)
    from api_client.redact import redact

    print(
        f"published {len(manifests)} manifests to {redact(settings.redis_url)}: "
        f"{', '.join(sorted(manifests))}"
    )
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from worker.ops.doctor import run_doctor

    return run_doctor(_settings(), model=args.model, profile=args.profile, as_json=args.json)


def _pull(args: argparse.Namespace) -> int:
    from worker.errors import ManifestDirectoryInvalid
    from worker.manifest import load_manifests
    from worker.pipelines.pull import PullError, pull

    settings = _settings()
    only = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    try:
        manifests = load_manifests(settings.manifests, only)
        pulled = pull(manifests, settings.models_dir)
    except (ManifestDirectoryInvalid, PullError) as exc:
        print(f"kiln pull: {exc}", file=sys.stderr)
        return 1
    print(f"kiln pull: {len(manifests)} models ready, {len(pulled)} fetched")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from worker import logs
    from worker.ops.bench import run_bench

    settings = _settings()
    logs.configure("json", quiet=True)
    return run_bench(settings, args.suite, args.matrix, args.out, args.through_queue)


def _profile(args: argparse.Namespace) -> int:
    from worker import logs
    from worker.ops.profile import run_profile

    request: dict[str, Any] = {"model": args.model, "prompt": args.prompt, "seed": args.seed}
    for field in ("steps", "width", "height"):
        if getattr(args, field) is not None:
            request[field] = getattr(args, field)
    logs.configure("json", quiet=True)
    from api_client import KilnError
    from worker.errors import ManifestDirectoryInvalid

    try:
        return run_profile(_settings(), request, args.trace, warmup=args.warmup)
    except (KilnError, ManifestDirectoryInvalid) as exc:
        print(f"kiln profile: {exc}", file=sys.stderr)
        return 2


def _tiny_models(args: argparse.Namespace) -> int:
    import time

    from worker.logs import quiet_libraries

    quiet_libraries()  # before torch and diffusers are imported
    from worker.pipelines.tiny import build_tiny_models

    directory = args.dir or _settings().models_dir
    started = time.perf_counter()
    built = build_tiny_models(directory, force=args.force)
    for name, path in built.items():
        print(f"{name}: {path}")
    print(f"tiny models ready in {time.perf_counter() - started:.1f} s")
    return 0


def _timings(args: argparse.Namespace) -> int:
    from worker.ops.report import run_report

    settings = _settings()
    return run_report(
        args.log or settings.timings_log, csv=args.csv, chart=args.chart, last=args.last
    )


if __name__ == "__main__":
    sys.exit(main())
