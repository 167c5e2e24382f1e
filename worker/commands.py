"""The client verbs of `kiln` (submit, replay, models, top, quarantine, webhooks, api): each talks
to Redis as a client does and prints what it hears. worker/cli.py's parser names these handlers,
so this module imports only the standard library up front; each verb imports what it needs."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from api_client import KilnJob


def _client() -> Any:
    from api_client import KilnClient

    return KilnClient.from_env()


def request_flag(module: str, parser: str) -> Any:
    """An argparse type for a request flag (`--lora NAME[:WEIGHT]`, `--control
    NAME:PATH[:STRENGTH]`, `--reference PATH[:STRENGTH]`): api_client's parser of it, checked as
    the request will be, imported when the flag is read."""

    def parsed(text: str) -> dict[str, Any]:
        import importlib

        try:
            choice = getattr(importlib.import_module(module), parser)(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        result: dict[str, Any] = choice.model_dump(exclude_none=True)
        return result

    return parsed


def submit(args: argparse.Namespace) -> int:
    from api_client import RequestRejected
    from api_client.schema import RenderRequest

    # Every request field has a flag of the same name; unset flags take the manifest's defaults.
    request: dict[str, Any] = {
        field: getattr(args, field)
        for field in RenderRequest.model_fields
        if getattr(args, field, None) is not None and field != "hires"
    }
    if args.hires is not None:
        hires = {"scale": args.hires, "upscaler": args.hires_upscaler}
        hires.update(strength=args.hires_strength, steps=args.hires_steps)
        request["hires"] = {k: v for k, v in hires.items() if v is not None}
    client = _client()
    try:
        for field in ("image", "mask"):
            if field in request and not _is_uri(request[field]):
                request[field] = client.upload(request[field])  # a local file: upload it first
        for given in [*request.get("controls", []), request.get("reference") or {}]:
            if given and not _is_uri(given["image"]):
                given["image"] = client.upload(given["image"])
        for control in request.get("controls", []):
            if args.control_preprocess is not None:
                control["preprocess"] = args.control_preprocess
        job = client.submit(request, job_id=args.job_id, at_front=args.front)
    except RequestRejected as exc:
        print(f"kiln submit: {exc}", file=sys.stderr)
        return 2
    return _follow(job, args.model, args)


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
        return 2
    try:
        job = _client().submit(request)
    except RequestRejected as exc:
        print(f"kiln replay: {args.image}: {exc}", file=sys.stderr)
        return 2
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


# Exit codes of the verbs that wait or act on a job (README: the command line).
EXIT_FAILED = 1  # the job failed, stopped or was canceled; or a job verb found no such job
EXIT_REFUSED = 2  # the request broke its manifest: nothing was enqueued
EXIT_TIMEOUT = 3  # --timeout passed; the job goes on
EXIT_NOT_SERVED = 4  # no live worker serves the model; the job stays queued
NOT_SERVED_GRACE_S = 3.0  # how long --wait looks for a serving worker before it says so


def _follow(job: KilnJob, model: str, args: argparse.Namespace) -> int:
    """After a submit: the job id, or with --wait its progress and result (--json: as JSON)."""
    from api_client import JobTimeout, RenderFailed

    if not args.wait:
        from api_client.keys import queue_name

        queue = queue_name(model, getattr(args, "priority", None) or "interactive")
        print(json.dumps({"job_id": job.id}) if args.json else f"queued {job.id} on {queue}")
        return 0
    if not getattr(args, "queue_anyway", False):
        unserved = not_served(_client(), model)
        if unserved:
            print(f"kiln {args.verb}: job {job.id} stays queued: {unserved}", file=sys.stderr)
            return EXIT_NOT_SERVED
    from worker.ops.display import wait_with_progress

    try:
        result = wait_with_progress(job, timeout=args.timeout, quiet=args.json)
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
        from worker.ops.display import print_result

        print_result(result)
    return 0


def not_served(client: Any, model: str, grace_s: float = NOT_SERVED_GRACE_S) -> str | None:
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
    return (
        f"no live worker serves {model} ({others}). Start one (`kiln worker --models {model}`),"
        " drop the job (`kiln cancel ID`), or wait for one with --queue-anyway"
    )


def job(args: argparse.Namespace) -> int:
    """`kiln job ID`: status, position, ETA, progress, the result or the error."""
    from api_client import UnknownJob

    try:
        snapshot = _client().job(args.id).snapshot()
    except UnknownJob as exc:
        print(f"kiln job: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(snapshot.model_dump_json())
        return 0
    parts = [f"{snapshot.id}: {snapshot.status}"]
    if snapshot.model:
        parts.append(f"model {snapshot.model}")
    if snapshot.position is not None:
        parts.append(f"{snapshot.position} ahead in its queue")
    if snapshot.progress is not None:
        p = snapshot.progress
        parts.append(f"{p.phase} {p.step}/{p.steps}")
    if snapshot.eta_s is not None:
        parts.append(f"ETA {snapshot.eta_s:.1f} s")
    if snapshot.error:
        parts.append(f"error: {snapshot.error}")
    print(", ".join(parts))
    if snapshot.result is not None:
        from worker.ops.display import print_result

        print_result(snapshot.result)
    return 0


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
    """`kiln fetch ID [DIR]`: a finished job's images, sha256 checked, as <id>-<n>.<ext>."""
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
    client = _client()
    infos = client.models()
    if args.json:
        print(json.dumps([_model_json(info) for info in infos], indent=2))
        return 0
    from worker.ops.display import print_models

    print_models(infos)
    return 0


def _model_json(info: Any) -> dict[str, Any]:
    return {
        "id": info.manifest.id,
        "family": info.manifest.family,
        "served": bool(info.workers),
        "modes": list(info.manifest.modes),
        "loras": sorted(info.manifest.loras),
        "default_steps": info.manifest.steps.default,
        # An upscaler has none: each job is its image's size.
        "default_size": list(info.manifest.default_size) if info.manifest.resolutions else None,
        "workers": info.workers,
        "resident_on": info.resident_on,
        "eta_s": info.default_eta_s,
        "queued": info.queued,
        "blocked": info.blocked,
        "eta_now_s": {lane: info.eta_now_s(lane) for lane in info.queued},
        "fits": {f"{w}x{h}": fit.model_dump() for (w, h), fit in info.fits.items()},
    }


def top(args: argparse.Namespace) -> int:
    from api_client.connection import connect
    from worker.ops.top import run_top
    from worker.settings import Settings

    return run_top(connect(Settings().redis_url), args.once, args.interval, args.last)


def quarantine(args: argparse.Namespace) -> int:
    from redis import Redis

    from worker.queue.quarantine import command
    from worker.settings import Settings

    return command(Redis.from_url(Settings().redis_url), args.clear, args.json)


def webhooks(args: argparse.Namespace) -> int:
    from api_client.connection import connect
    from worker.queue.webhooks import command
    from worker.settings import Settings

    return command(connect(Settings().redis_url), args.resend)


def api(args: argparse.Namespace) -> int:
    """`kiln api`: the gateway. Its web framework loads here, not before."""
    from api_client.http.settings import ApiSettings, ApiSettingsInvalid

    try:
        settings = ApiSettings.from_env(host=args.host, port=args.port)
    except ApiSettingsInvalid as exc:
        print(f"kiln api: {exc}", file=sys.stderr)
        return 2
    try:
        from api_client.http.serve import serve
    except ImportError as exc:
        print(
            f"kiln api: the gateway needs the api extra ({exc.name} is missing):"
            " pip install 'kiln[api]'",
            file=sys.stderr,
        )
        return 1
    return serve(settings)


def _tokens() -> Any:
    import os

    from api_client.connection import connect
    from api_client.http.tokens import Tokens

    return Tokens(connect(os.environ.get("KILN_REDIS_URL", "redis://localhost:6379/0")))


def token_create(args: argparse.Namespace) -> int:
    from api_client.http.tokens import TokenInvalid

    try:
        token = _tokens().create(
            args.name,
            args.scope,
            max_queued=args.max_queued,
            upload_mb=args.upload_mb,
            expires_days=args.expires,
        )
    except TokenInvalid as exc:
        print(f"kiln api token create: {exc}", file=sys.stderr)
        return 1
    print(token)
    return 0


def token_list(args: argparse.Namespace) -> int:
    for info in _tokens().listed():
        print(info.line())
    return 0


def token_revoke(args: argparse.Namespace) -> int:
    if not _tokens().revoke(args.name):
        print(f"kiln api token revoke: no token named {args.name!r}", file=sys.stderr)
        return 1
    print(f"revoked {args.name}", file=sys.stderr)
    return 0
