"""Logging: one line per event in one format, KILN_LOG_FORMAT's (json or console), redacted.

kiln's structlog events (the timing records among them) go to stdout. Everything that reaches
the stdlib `logging` module (kiln's modules, RQ, redis, the ML libraries, and `warnings.warn`
through logging.captureWarnings) goes to stderr through structlog's ProcessorFormatter, so an
operator's log shipper reads JSON objects from both streams, tracebacks included (as a string
field, never as extra lines).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any, TextIO

import structlog
from structlog.typing import Processor

from api_client.redact import redact
from worker import quiet


def quiet_libraries() -> None:
    """The stack's harmless import-time notices dropped one message at a time (worker/quiet.py
    says which and why); everything else those libraries log still shows."""
    quiet.install()


class Redactor(logging.Filter):
    """Masks URL passwords and the given secrets in every record, kiln's and the libraries'."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = list(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, None
        return True

    def __call__(self, _logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
        """The same as a structlog processor, for every string value of an event."""
        for key, value in event.items():
            if isinstance(value, str):
                event[key] = redact(value, self.secrets)
        return event


class KilnHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root logger's handler that configure() installs (and replaces when called again)."""


def configure(
    log_format: str = "json",
    level: int = logging.INFO,
    quiet: bool = False,
    secrets: Iterable[str] = (),
) -> None:
    """quiet: drop kiln's per-job JSON lines from stdout (bench and profile print tables instead;
    the records still go to the timings log). secrets: values never to print (Settings.secrets)."""
    quiet_libraries()
    redactor = Redactor(secrets)
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    # Tracebacks become a string field before redaction, so a URL in one is masked too.
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            stamp,
            structlog.processors.format_exc_info,
            redactor,
            _renderer(log_format, sys.stdout),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.WARNING if quiet else logging.INFO
        ),
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            stamp,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            redactor,
            _renderer(log_format, sys.stderr),
        ],
    )
    handler = KilnHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(redactor)  # the message before anything reads it; the chain, the rest
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, KilnHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # warnings.warn from here on is a log record like any other, not a bare line on stderr.
    logging.captureWarnings(True)
    route_library_logs()


def route_library_logs() -> None:
    """diffusers and transformers log through a stderr handler of their own and keep their
    records from the root logger: once they are imported, send those through kiln's handler.
    Importing them here would load torch, so the worker calls this after its heavy imports."""
    for name in ("diffusers.utils.logging", "transformers.utils.logging"):
        module = sys.modules.get(name)
        if module is not None:
            module.disable_default_handler()
            module.enable_propagation()


def _renderer(log_format: str, stream: TextIO) -> Processor:
    if log_format == "json":
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=stream.isatty())
