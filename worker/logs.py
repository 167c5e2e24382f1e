"""Logging: structlog JSON lines (or console) on stdout for kiln's records, plain stdlib for RQ."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(log_format: str = "json", level: int = logging.INFO, quiet: bool = False) -> None:
    """quiet: drop kiln's per-job JSON lines from stdout (bench and profile print tables instead;
    the records still go to the timings log)."""
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.WARNING if quiet else logging.INFO
        ),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
