"""What a verb needs beyond the base install (`pip install kiln-render`: pydantic, redis, rq).

The client verbs need nothing more. A verb of the worker or operator audience needs the worker
extra and `kiln api` the api extra: each is marked with `needs(parser, extra)`, and main turns a
module missing under it into one line naming the install, exit 2, instead of a traceback."""

from __future__ import annotations

import argparse
from typing import Any

EXIT_MISSING_EXTRA = 2
KILN_PACKAGES = ("worker", "api_client", "kiln_manifests")


def needs(parser: argparse.ArgumentParser, extra: str) -> None:
    """Mark a verb (and the actions under it) as needing `kiln-render[extra]`."""
    parser.set_defaults(extra=extra)


def install_line(extra: str) -> str:
    return f"pip install 'kiln-render[{extra}]'"


def missing_extra(verb: str, extra: str, exc: ModuleNotFoundError) -> str | None:
    """The one line for a module of `extra` that is not installed; None when the missing module
    is kiln's own (a bug to show whole, not an install to suggest)."""
    name = exc.name or ""
    if not name or name.partition(".")[0] in KILN_PACKAGES:
        return None
    return f"kiln {verb}: needs the {extra} extra ({name} is missing): {install_line(extra)}"


def worker_settings(**overrides: Any) -> Any:
    """KILN_* settings, with command-line flags (validated the same way) over them. The worker
    extra's: pydantic-settings reads them."""
    from worker.settings import Settings

    return Settings(**{k: v for k, v in overrides.items() if v is not None})
