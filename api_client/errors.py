"""Errors the client raises: a request refused before it runs, or a job that failed in a worker."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar


class Named(Protocol):
    """A request's choice of a manifest's entry (a LoRA, a ControlNet), by name."""

    @property
    def name(self) -> str: ...


C = TypeVar("C", bound=Named)
T = TypeVar("T")

# Longest a client-supplied value or key is echoed in an error, a record or a log line.
ECHO_LIMIT = 200
MESSAGE_LIMIT = 2000  # a whole message made of such echoes (RequestRejected lists at most 8)


def short(value: Any, limit: int = ECHO_LIMIT) -> Any:
    """A value fit to echo: text (or the repr of a container or bytes) longer than limit is cut,
    with its original length noted; anything else is returned as it is. A 10 MB model name must
    not become a 10 MB error in Redis, a 20 MB timing line and 30 MB on stdout."""
    if isinstance(value, str):
        return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} chars)"
    if isinstance(value, (dict, list, tuple, set, bytes, bytearray)):
        text = repr(value)
        return value if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
    return value


@dataclass(frozen=True)
class Problem:
    """One broken rule: which field, what value it had, and the rule it broke."""

    field: str
    value: Any
    rule: str

    def __str__(self) -> str:
        return f"{short(self.field)}={short(self.value)!r}: {short(self.rule, 4 * ECHO_LIMIT)}"


def named_entries(
    choices: Iterable[C], entries: Mapping[str, T], field: str, problems: list[Problem]
) -> Iterator[tuple[str, C, T]]:
    """A request's list of choices by name (loras, controls) against a manifest's entries: each
    known one, named once, with its field ("loras.0") and entry; an unknown name or one named
    twice is a problem instead."""
    seen: set[str] = set()
    for index, choice in enumerate(choices):
        at = f"{field}.{index}"
        entry = entries.get(choice.name)
        if entry is None:
            allowed = ", ".join(sorted(entries))
            problems.append(Problem(f"{at}.name", choice.name, f"must be one of {allowed}"))
        elif choice.name in seen:
            problems.append(Problem(f"{at}.name", choice.name, "is named twice"))
        else:
            seen.add(choice.name)
            yield at, choice, entry


class KilnError(Exception):
    """Base class of every error kiln raises on purpose."""


class RequestRejected(KilnError):
    """The request breaks its manifest or the request schema; nothing was rendered."""

    def __init__(self, problems: list[Problem], model: str | None = None) -> None:
        self.problems = problems
        self.model = model
        where = f" for model {short(model)!r}" if model else ""
        lines = "; ".join(str(p) for p in problems[:8])
        if len(problems) > 8:
            lines += f"; and {len(problems) - 8} more"
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
