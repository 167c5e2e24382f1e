"""The `kiln` command: one module per audience, each registering its own verbs and handlers.

- client.py: what a backend runs, on the base install (`pip install kiln-render`): submit,
  models, job, jobs, fetch, cancel; and replay, which reads an image with Pillow;
- worker.py: a GPU box's own verbs: worker, manifests, pull, tiny-models;
- operator.py: watching and tuning a fleet: doctor, bench, profile, timings, top, quarantine,
  webhooks;
- gateway.py: the HTTP gateway and its tokens: api.

Beside them: flags.py (a request's flags, and those submit and replay share), plain.py (the
client verbs' output, without rich), extras.py (what a verb needs beyond the base install). A new
verb is a `register` entry in its audience's module. Each handler imports what it needs when it
runs, so `kiln --help` never loads torch; the worker and operator verbs need the worker extra,
the client verbs only the base install."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from worker.cli import client, extras, gateway, operator
from worker.cli import worker as gpu_box  # not `worker`: that name is the package above

AUDIENCES = (gpu_box, client, operator, gateway)


def main(argv: list[str] | None = None) -> int:
    from worker import quiet

    quiet.install()  # before any verb imports the stack: its harmless notices (worker/quiet.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        code = _explained(args, exc)
        if code is None:
            raise
        return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="A render worker for diffusion models."
    )
    verbs = parser.add_subparsers(title="commands", metavar="COMMAND", dest="verb")
    for audience in AUDIENCES:
        audience.register(verbs)
    return parser


def _explained(args: argparse.Namespace, exc: Exception) -> int | None:
    """The exit code after one line on stderr for an error a user can act on: a missing extra,
    Redis out of reach, an invalid value; None for anything else (a bug: shown whole)."""
    extra = getattr(args, "extra", None)
    if extra and isinstance(exc, ModuleNotFoundError):
        line = extras.missing_extra(args.verb, extra, exc)
        if line is not None:
            print(line, file=sys.stderr)
            return extras.EXIT_MISSING_EXTRA
    # redis is imported by the verbs that talk to it, never up front (kiln --help stays light).
    redis_errors = sys.modules.get("redis.exceptions")
    if redis_errors is not None and isinstance(exc, redis_errors.ConnectionError):
        print(f"kiln {args.verb}: {_unreachable(exc)}", file=sys.stderr)
        return 1
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(exc, pydantic.ValidationError):
        _print_invalid(args.verb, exc)
        return 2
    return None


def _unreachable(exc: Exception) -> str:
    """Which Redis could not be reached, its password masked. Read from the environment as the
    client reads it: the client verbs run without the worker's settings."""
    from urllib.parse import urlparse

    from api_client.redact import redact

    url = client.redis_url()
    try:
        secrets = [urlparse(url).password]
    except ValueError:
        secrets = []
    return redact(f"cannot reach Redis at {url}: {exc}", secrets)


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
