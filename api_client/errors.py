"""Errors the client raises: a request refused before it runs, or a job that failed in a worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One broken rule: which field, what value it had, and the rule it broke."""

    field: str
    value: Any
    rule: str

    def __str__(self) -> str:
        return f"{self.field}={self.value!r}: {self.rule}"


class KilnError(Exception):
    """Base class of every error kiln raises on purpose."""


class RequestRejected(KilnError):
    """The request breaks its manifest or the request schema; nothing was rendered."""

    def __init__(self, problems: list[Problem], model: str | None = None) -> None:
        self.problems = problems
        self.model = model
        where = f" for model {model!r}" if model else ""
        lines = "; ".join(str(p) for p in problems)
        super().__init__(f"request rejected{where}: {lines}")


class RenderFailed(KilnError):
    """The job reached a worker and ended without a result; carries the worker's message."""

    def __init__(self, job_id: str, message: str, status: str = "failed") -> None:
        self.job_id = job_id
        self.message = message
        self.status = status
        super().__init__(f"job {job_id} {status}: {message}")


class JobTimeout(KilnError):
    """wait() gave up before the job ended; the job itself goes on."""


class UnknownJob(KilnError):
    """No job with that id exists in Redis (never submitted, or its record expired)."""


def problem(field: str, value: Any, rule: str) -> Problem:
    return Problem(field=field, value=value, rule=rule)
