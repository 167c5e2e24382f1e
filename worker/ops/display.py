"""Rich output for the operators' verbs (top, bench, timings, profile): phase tables fit to the
terminal. The client verbs print plain text (worker/cli/plain.py): they run without rich."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from api_client.schema import PHASE_HEADERS, PHASES


def phase_header(phase: str) -> str:
    return PHASE_HEADERS[phase]


def wide_console(stderr: bool = False) -> Console:
    """Tables of eight phases need more than 80 columns; pipes and CI get a fixed wide page."""
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=200)


def phase_table(records: list[Any], title: str) -> Table:
    table = Table(
        "job",
        "model",
        "size",
        "steps",
        "n",
        "rung",
        "cold",
        "status",
        *[phase_header(p) for p in PHASES],
        title=title,
    )
    for r in records:
        table.add_row(
            r.job_id[:8],
            r.model or "?",
            f"{r.width}x{r.height}" if r.width else "-",
            str(r.steps or "-"),
            str(r.num_images or "-"),
            r.rung or "-",
            "yes" if r.cold else "",
            r.status,
            *[f"{getattr(r.timings, p):.3f}" for p in PHASES],
        )
    return table
