"""The client verbs of `kiln` (submit, replay, models, top, quarantine): each talks to Redis as
a client does and prints what it hears. worker/cli.py's parser names these handlers, so this
module imports only the standard library up front; each verb imports what it needs."""

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


def lora_flag(text: str) -> dict[str, Any]:
    """`submit --lora NAME[:WEIGHT]`, checked as the request will be."""
    from api_client.loras import parse_lora_flag

    try:
        return parse_lora_flag(text).model_dump(exclude_none=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def submit(args: argparse.Namespace) -> int:
    from api_client import RequestRejected
    from api_client.schema import RenderRequest

    # Every request field has a flag of the same name; unset flags take the manifest's defaults.
    request: dict[str, Any] = {
        field: getattr(args, field)
        for field in RenderRequest.model_fields
        if getattr(args, field, None) is not None
    }
    client = _client()
    try:
        for field in ("image", "mask"):
            if field in request and not re.match(r"[a-z][a-z0-9+.-]*:", request[field]):
                request[field] = client.upload(request[field])  # a local file: upload it first
        job = client.submit(request, job_id=args.job_id, at_front=args.front)
    except RequestRejected as exc:
        print(f"kiln submit: {exc}", file=sys.stderr)
        return 2
    return _follow(job, args.model, args)


def replay(args: argparse.Namespace) -> int:
    from api_client import RequestRejected
    from worker.details import read_details
    from worker.errors import CannotReplay

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


def _follow(job: KilnJob, model: str, args: argparse.Namespace) -> int:
    """After a submit: the job id, or with --wait its progress and result (--json: as JSON)."""
    from api_client import RenderFailed

    if not args.wait:
        from api_client.keys import queue_name

        queue = queue_name(model, getattr(args, "priority", None) or "interactive")
        print(json.dumps({"job_id": job.id}) if args.json else f"queued {job.id} on {queue}")
        return 0
    from worker.display import wait_with_progress

    try:
        result = wait_with_progress(job, timeout=args.timeout, quiet=args.json)
    except RenderFailed as exc:
        print(
            json.dumps({"job_id": job.id, "status": exc.status, "error": exc.message})
            if args.json
            else f"kiln {args.verb}: {exc}",
            file=sys.stdout if args.json else sys.stderr,
        )
        return 1
    if args.json:
        print(result.model_dump_json())
    else:
        from worker.display import print_result

        print_result(result)
    return 0


def models(args: argparse.Namespace) -> int:
    client = _client()
    infos = client.models()
    if args.json:
        print(json.dumps([_model_json(info) for info in infos], indent=2))
        return 0
    from worker.display import print_models

    print_models(infos)
    return 0


def _model_json(info: Any) -> dict[str, Any]:
    return {
        "id": info.manifest.id,
        "family": info.manifest.family,
        "default_steps": info.manifest.steps.default,
        "default_size": list(info.manifest.default_size),
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
    from worker.settings import Settings
    from worker.top import run_top

    return run_top(connect(Settings().redis_url), args.once, args.interval, args.last)


def quarantine(args: argparse.Namespace) -> int:
    from redis import Redis

    from worker.quarantine import command
    from worker.settings import Settings

    return command(Redis.from_url(Settings().redis_url), args.clear, args.json)
