"""The operator's verbs, for watching and tuning a fleet, never on a job's path: doctor, bench,
profile, timings, top, quarantine, webhooks. They need the worker extra; each handler only
parses, calls the module that owns the work (worker/ops/, worker/queue/), and prints. Every Redis
connection comes from api_client.connection.connect, so a redis+sentinel:// URL works here too."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.cli import extras
from worker.cli.extras import worker_settings

if TYPE_CHECKING:
    from redis import Redis


def register(verbs: Any) -> None:
    _diagnosis_verbs(verbs)
    _measurement_verbs(verbs)
    _fleet_verbs(verbs)


def _diagnosis_verbs(verbs: Any) -> None:
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
    doctor.set_defaults(handler=doctor_verb)
    extras.needs(doctor, "worker")

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
    profile.set_defaults(handler=profile_verb)
    extras.needs(profile, "worker")


def _measurement_verbs(verbs: Any) -> None:
    bench = verbs.add_parser(
        "bench", help="a prompt suite over a matrix of models/steps/sizes/settings"
    )
    bench.add_argument("--suite", type=Path, default=Path("bench/suites/prompts-8.json"))
    bench.add_argument("--matrix", type=Path, default=Path("bench/matrices/tiny-steps.json"))
    bench.add_argument(
        "--through-queue", action="store_true", help="submit through Redis to running workers"
    )
    bench.add_argument("--out", type=Path, help="results directory (default bench/results/<time>)")
    bench.set_defaults(handler=bench_verb)
    extras.needs(bench, "worker")

    timings = verbs.add_parser(
        "timings", help="per-model phase medians and p90 from the timings log"
    )
    timings.add_argument("log", nargs="?", type=Path, help="default: KILN_TIMINGS_LOG")
    timings.add_argument("--csv", type=Path, help="also write every record as CSV")
    timings.add_argument("--chart", type=Path, help="also draw a PNG chart of phase medians")
    timings.add_argument("--last", type=int, help="show the last N jobs one per row")
    timings.set_defaults(handler=timings_verb)
    extras.needs(timings, "worker")


def _fleet_verbs(verbs: Any) -> None:
    top = verbs.add_parser(
        "top", help="live view: workers, resident models and rungs, queues, last jobs"
    )
    top.add_argument("--once", action="store_true", help="print one frame as plain text and exit")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--last", type=int, default=10, help="how many ended jobs to show")
    top.set_defaults(handler=top_verb)
    extras.needs(top, "worker")

    quarantine = verbs.add_parser(
        "quarantine", help="job records kiln could not read or that killed workers, with reasons"
    )
    quarantine.add_argument("--clear", metavar="ID", help="drop this entry (`all`: every entry)")
    quarantine.add_argument("--json", action="store_true", help="one JSON object per entry")
    quarantine.set_defaults(handler=quarantine_verb)
    extras.needs(quarantine, "worker")

    webhooks = verbs.add_parser(
        "webhooks",
        help="deliveries waiting, retrying, and dead letters with the receiver's last answer",
    )
    webhooks.add_argument(
        "--resend", metavar="ID", help="send this dead letter again (same webhook-id, tries reset)"
    )
    webhooks.set_defaults(handler=webhooks_verb)
    extras.needs(webhooks, "worker")
    actions = webhooks.add_subparsers(title="webhooks commands", metavar="ACTION", required=False)
    listen = actions.add_parser(
        "listen",
        help="a local receiver on any path: checks each delivery's signature, prints a line,"
        " saves body and headers (the base install runs it)",
    )
    listen.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any)")
    listen.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    listen.add_argument(
        "--secret", help="the target's whsec_... secret (without it: saved unchecked)"
    )
    listen.add_argument(
        "--dir",
        default="webhooks",
        type=Path,
        help="where deliveries are saved (default ./webhooks)",
    )
    listen.set_defaults(handler=listen_verb, extra=None)


def _redis() -> Redis:
    """The operator's Redis: KILN_REDIS_URL as the worker's settings validate it."""
    from api_client.connection import connect

    return connect(worker_settings().redis_url)


def doctor_verb(args: argparse.Namespace) -> int:
    from worker.ops.doctor import run_doctor

    return run_doctor(worker_settings(), model=args.model, profile=args.profile, as_json=args.json)


def profile_verb(args: argparse.Namespace) -> int:
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
        return run_profile(worker_settings(), request, args.trace, warmup=args.warmup)
    except (KilnError, ManifestDirectoryInvalid) as exc:
        print(f"kiln profile: {exc}", file=sys.stderr)
        return 2


def bench_verb(args: argparse.Namespace) -> int:
    from worker import logs
    from worker.ops.bench import run_bench

    settings = worker_settings()
    logs.configure("json", quiet=True)
    return run_bench(settings, args.suite, args.matrix, args.out, args.through_queue)


def timings_verb(args: argparse.Namespace) -> int:
    from worker.ops.report import run_report

    log = args.log or worker_settings().timings_log
    return run_report(log, csv=args.csv, chart=args.chart, last=args.last)


def top_verb(args: argparse.Namespace) -> int:
    from worker.ops.top import run_top

    return run_top(_redis(), args.once, args.interval, args.last)


def quarantine_verb(args: argparse.Namespace) -> int:
    from worker.queue.upkeep.quarantine import command

    return command(_redis(), args.clear, args.json)


def webhooks_verb(args: argparse.Namespace) -> int:
    from worker.queue.upkeep.webhooks import command

    return command(_redis(), args.resend)


def listen_verb(args: argparse.Namespace) -> int:
    from api_client.listen import listen

    try:
        receiver = listen(args.port, args.secret, args.dir, host=args.host)
    except (ValueError, OSError) as exc:
        print(f"kiln webhooks listen: {exc}", file=sys.stderr)
        return 2
    port = receiver.server_address[1]
    print(
        f"kiln webhooks listen: on http://{args.host}:{port}/ (any path), saving into {args.dir}",
        file=sys.stderr,
        flush=True,
    )
    try:
        receiver.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        receiver.server_close()
    return 0
