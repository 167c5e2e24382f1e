"""Logging: structlog JSON lines (or console) on stdout for kiln's records, plain stdlib for RQ."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any

import structlog

from api_client.redact import redact

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
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redactor,
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
    for handler in logging.getLogger().handlers:
        for old in [f for f in handler.filters if isinstance(f, Redactor)]:
            handler.removeFilter(old)
        handler.addFilter(redactor)
