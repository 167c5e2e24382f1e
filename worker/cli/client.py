"""The client's verbs: submit, replay, models, job, jobs, fetch, cancel. Each talks to Redis as a
backend's KilnClient does and prints what it hears, so all but replay (which reads an image's
details with Pillow, the worker extra's) run on the base install: api_client, the standard library
and plain.py, never the worker's settings, rich or torch. Their flags are in flags.py; imports
stay inside each verb."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.cli import extras, flags

if TYPE_CHECKING:
    from api_client import KilnClient, KilnJob

# Exit codes of the verbs that wait or act on a job (README: the command line).
EXIT_FAILED = 1  # the job failed, stopped or was canceled; or a job verb found no such job
EXIT_REFUSED = 2  # the request broke its manifest: nothing was enqueued
EXIT_TIMEOUT = 3  # --timeout passed; the job goes on
EXIT_NOT_SERVED = 4  # no live worker serves the model; the job stays queued
UNDONE = ("failed", "stopped", "canceled", "quarantined")  # the ends that are not done
NOT_SERVED_GRACE_S = 3.0  # how long --wait looks for a serving worker before it says so


def register(verbs: Any) -> None:
    submitting = verbs.add_parser("submit", help="enqueue one render job")
    flags.request_flags(submitting)
    flags.follow_flags(submitting)
    submitting.set_defaults(handler=submit)

    replaying = verbs.add_parser(
        "replay",
        help="render an image again from the generation details it carries (through the queue,"
        " pinned to its rung and compile state)",
    )
    replaying.add_argument(
        "image", help="a PNG, WebP or JPEG that kiln wrote (a path or file:// uri)"
    )
    flags.follow_flags(replaying)
    replaying.set_defaults(handler=replay)
    extras.needs(replaying, "worker")  # Pillow reads the image's details

    listing = verbs.add_parser(
        "models", help="published models, the workers serving them, and ETAs"
    )
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=models)
    _job_verbs(verbs)


def _job_verbs(verbs: Any) -> None:
    """The verbs that act on one job by id, and `jobs`."""
    shown = verbs.add_parser(
        "job", help="one job by id: status, queue position, ETA, progress, result or error"
    )
    shown.add_argument("id")
    shown.add_argument("--json", action="store_true")
    shown.set_defaults(handler=job)
    canceling = verbs.add_parser(
        "cancel", help="cancel a job by id (queued: removed; running: stopped at its next step)"
    )
    canceling.add_argument("id")
    canceling.set_defaults(handler=cancel)
    fetching = verbs.add_parser(
        "fetch", help="a finished job's images or videos into DIR, sha256 checked"
    )
    fetching.add_argument("id")
    fetching.add_argument("dir", nargs="?", default=".", type=Path, help="default: here")
    fetching.set_defaults(handler=fetch)
    recent = verbs.add_parser("jobs", help="recent jobs, newest first (from the queues' events)")
    recent.add_argument("--model", help="one model's jobs only")
    recent.add_argument("--limit", type=int, default=20)
    recent.add_argument("--json", action="store_true")
    recent.set_defaults(handler=jobs)


def _client() -> KilnClient:
    from api_client import KilnClient

    return KilnClient.from_env()


def redis_url() -> str:
    """KILN_REDIS_URL as KilnClient.from_env reads it, for what the base install must reach
    without the worker's settings: an unreachable Redis's message, the gateway's tokens."""
    import os

    from api_client.client import DEFAULT_REDIS_URL

    return os.environ.get("KILN_REDIS_URL", DEFAULT_REDIS_URL)


def submit(args: argparse.Namespace) -> int:
    from api_client import RequestRejected

    request = _request(args)
    client = _client()
    try:
        for field in ("image", "mask"):
            if field in request and not _is_uri(request[field]):
                request[field] = client.upload(request[field])  # a local file: upload it first
        for given in [*request.get("controls", []), request.get("reference") or {}]:
            if given and not _is_uri(given["image"]):
                given["image"] = client.upload(given["image"])
        job = client.submit(request, job_id=args.job_id, at_front=args.front)
    except RequestRejected as exc:
        print(f"kiln submit: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return _follow(job, args.model, args)


def _request(args: argparse.Namespace) -> dict[str, Any]:
    """The request the flags name: every request field has a flag of the same name; an unset flag
    takes the manifest's default."""
    from api_client.schema import RenderRequest

    request: dict[str, Any] = {
        field: getattr(args, field)
        for field in RenderRequest.model_fields
        if getattr(args, field, None) is not None and field != "hires"
    }
    if args.hires is not None:
        hires = {"scale": args.hires, "upscaler": args.hires_upscaler}
        hires.update(strength=args.hires_strength, steps=args.hires_steps)
        request["hires"] = {k: v for k, v in hires.items() if v is not None}
    for control in request.get("controls", []):
        if args.control_preprocess is not None:
            control["preprocess"] = args.control_preprocess
    return request


def _is_uri(value: str) -> bool:
    return re.match(r"[a-z][a-z0-9+.-]*:", value) is not None


def replay(args: argparse.Namespace) -> int:
    from api_client import RequestRejected
    from worker.errors import CannotReplay
    from worker.files.details import read_details

    try:
        path = _local_image(args.image)
        request = read_details(path).replay_request()
    except CannotReplay as exc:
        print(f"kiln replay: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        job = _client().submit(request)
    except RequestRejected as exc:
        print(f"kiln replay: {args.image}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return _follow(job, request.model, args)


def _local_image(argument: str) -> Path:
    """The image file a replay reads: a path, or a file:// uri as results give them."""
    from urllib.parse import unquote, urlparse

    from worker.errors import CannotReplay

    if argument.startswith("file://"):
        return Path(unquote(urlparse(argument).path))
    if "://" in argument:
        raise CannotReplay(
            f"{argument}: kiln replay reads a local file; fetch the image first"
            " (KilnClient.fetch or job.download)"
        )
    return Path(argument)


def _follow(job: KilnJob, model: str, args: argparse.Namespace) -> int:
    """After a submit: the job id, or with --wait its progress and result (--json: as JSON)."""
    from api_client import JobTimeout, RenderFailed
    from worker.cli import plain

    if not args.wait:
        from api_client.keys import queue_name

        queue = queue_name(model, getattr(args, "priority", None) or "interactive")
        print(json.dumps({"job_id": job.id}) if args.json else f"queued {job.id} on {queue}")
        unserved = not_served(_client(), model, grace_s=0)  # one look: no wait without --wait
        if unserved:
            print(
                f"kiln {args.verb}: warning: job {job.id} waits in its queue: {unserved}."
                f" Start one (`kiln worker --models {model}`) or drop it (`kiln cancel {job.id}`)",
                file=sys.stderr,
            )
        return 0
    if not args.queue_anyway:
        unserved = not_served(_client(), model)
        if unserved:
            print(
                f"kiln {args.verb}: job {job.id} stays queued: {unserved}. Start one (`kiln"
                f" worker --models {model}`), drop the job (`kiln cancel {job.id}`), or wait for"
                " one with --queue-anyway",
                file=sys.stderr,
            )
            return EXIT_NOT_SERVED
    try:
        result = plain.wait_with_progress(job, timeout=args.timeout, quiet=args.json)
    except RenderFailed as exc:
        print(
            json.dumps({"job_id": job.id, "status": exc.status, "error": exc.message})
            if args.json
            else f"kiln {args.verb}: {exc}",
            file=sys.stdout if args.json else sys.stderr,
        )
        return EXIT_FAILED
    except JobTimeout as exc:
        print(
            f"kiln {args.verb}: {exc}; it goes on (`kiln job {job.id}`, `kiln cancel {job.id}`)",
            file=sys.stderr,
        )
        return EXIT_TIMEOUT
    if args.json:
        print(result.model_dump_json())
    else:
        plain.print_result(result)
    return 0


def not_served(client: KilnClient, model: str, grace_s: float = NOT_SERVED_GRACE_S) -> str | None:
    """Why no job of model will start now: no live worker serves it (looked for over grace_s, so
    a worker that is starting is found), naming the workers that serve other models; None when
    one serves it."""
    import time

    deadline = time.monotonic() + grace_s
    while True:
        workers = client.workers()
        if any(model in state.models for state in workers):
            return None
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    others = "; ".join(f"{s.name} serves {', '.join(s.models)}" for s in workers) or "none is live"
    return f"no live worker serves {model} ({others})"


def job(args: argparse.Namespace) -> int:
    """`kiln job ID`: status, position, ETA, progress, the result or the error; exit 1 for a job
    that failed, stopped, was canceled or quarantined."""
    from api_client import UnknownJob
    from worker.cli import plain

    try:
        snapshot = _client().job(args.id).snapshot()
    except UnknownJob as exc:
        print(f"kiln job: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(snapshot.model_dump_json())
    else:
        plain.print_snapshot(snapshot)
    # As the README's exit codes: a job that ended other than done is 1, shown or not.
    return EXIT_FAILED if snapshot.status in UNDONE else 0


def cancel(args: argparse.Namespace) -> int:
    """`kiln cancel ID`: queued, removed; running, stopped at its next step."""
    from api_client import RenderFailed, UnknownJob

    try:
        seen = _client().job(args.id).cancel()
    except (UnknownJob, RenderFailed) as exc:
        print(f"kiln cancel: {exc}", file=sys.stderr)
        return EXIT_FAILED
    outcome = {
        "queued": "canceled: taken off its queue",
        "scheduled": "canceled: taken off its queue",
        "deferred": "canceled: taken off its queue",
        "started": "stopping at its next step",
    }.get(seen, f"not canceled: it is already {seen}")
    print(f"{args.id}: {outcome}")
    return 0 if seen in ("queued", "scheduled", "deferred", "started") else EXIT_FAILED


def fetch(args: argparse.Namespace) -> int:
    """`kiln fetch ID [DIR]`: a finished job's images or videos, sha256 checked, as
    <id>-<n>.<ext>."""
    from api_client import FetchFailed, RenderFailed, UnknownJob

    handle = _client().job(args.id)
    try:
        result = handle.result()
        if result is None:
            print(
                f"kiln fetch: job {args.id} is {handle.status()}, not finished: nothing to fetch",
                file=sys.stderr,
            )
            return EXIT_FAILED
        paths = handle.download(args.dir, timeout=1)
    except (UnknownJob, RenderFailed, FetchFailed) as exc:
        print(f"kiln fetch: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for path in paths:
        print(path)
    return 0


def jobs(args: argparse.Namespace) -> int:
    """`kiln jobs`: recent jobs, newest first, from the queues' event streams."""
    from datetime import datetime

    client = _client()
    if args.model and args.model not in client.manifests():
        print(f"kiln jobs: unknown model {args.model!r}", file=sys.stderr)
        return EXIT_FAILED
    found = client.recent_jobs(args.model, args.limit)
    if args.json:
        print(json.dumps([e.model_dump(exclude_none=True, exclude={"result"}) for e in found]))
        return 0
    for event in found:
        when = datetime.fromtimestamp(event.at).strftime("%Y-%m-%d %H:%M:%S")
        status = {"done": "finished", "stopped": event.error or "stopped"}.get(
            event.kind, event.kind
        )
        error = f"  {event.error}" if event.error and event.kind == "failed" else ""
        print(f"{when}  {event.job_id}  {event.model or '-'}  {status}{error}")
    if not found:
        print("no recent jobs", file=sys.stderr)
    return 0


def models(args: argparse.Namespace) -> int:
    from worker.cli import plain

    infos = _client().models()
    if args.json:
        print(json.dumps([plain.model_json(info) for info in infos], indent=2))
    else:
        plain.print_models(infos)
    return 0
