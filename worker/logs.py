"""Logging: structlog JSON lines (or console) on stdout for kiln's records, plain stdlib for RQ."""

from __future__ import annotations

import logging
import os
import sys

import structlog

# Import-time notices from the stack that say nothing about a job: torchao's CPU wheel lacking
# its CUDA kernels, a torch deprecation note, diffusers' torchao serialization notice,
# transformers' torchvision fallback. Real errors from these libraries still show.
QUIET_LIBRARIES = (
    "torchao",
    "torch.utils._pytree",
    "diffusers.quantizers.torchao.torchao_quantizer",
)


def quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(logging.ERROR)


def configure(log_format: str = "json", level: int = logging.INFO, quiet: bool = False) -> None:
    """quiet: drop kiln's per-job JSON lines from stdout (bench and profile print tables instead;
    the records still go to the timings log)."""
    quiet_libraries()
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
