"""The client verbs' output in plain text: a job's progress while --wait follows it, a result, a
job's snapshot, the models table. The base install has no rich (the worker extra brings it), so
these write with print() alone: aligned columns, and on a terminal one progress line redrawn."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from api_client import KilnJob, ModelInfo, RenderResult
from api_client.errors import JobTimeout
from api_client.events import BLOCK_SLICE_S
from api_client.schema import PHASE_HEADERS, PHASES, JobSnapshot

MIN_CELL = 8  # a column cut to fit the terminal keeps at least this many characters


def wait_with_progress(job: KilnJob, timeout: float, quiet: bool = False) -> RenderResult:
    """Follow the job's events; on a terminal (and unless quiet) redraw one line on stderr,
    `<id> <phase> <step>/<steps>`, cleared when the job ends."""
    if quiet or not sys.stderr.isatty():
        return follow_job(job, timeout, lambda phase, step, steps: None)
    width = 0

    def show(phase: str, step: int, steps: int | None) -> None:
        nonlocal width
        line = f"{job.id[:8]} {phase}" + (f" {step}/{steps}" if steps else "")
        sys.stderr.write("\r" + line.ljust(width))
        sys.stderr.flush()
        width = max(width, len(line))

    show("queued", 0, None)
    try:
        return follow_job(job, timeout, show)
    finally:
        sys.stderr.write("\r" + " " * width + "\r")
        sys.stderr.flush()


def follow_job(
    job: KilnJob, timeout: float, show: Callable[[str, int, int | None], None]
) -> RenderResult:
    """Show (phase, step, steps) from the job's event stream as its worker writes them (a
    blocking XREAD, no polling of job.progress()) and return its result: the done event carries
    it. A failed or stopped job raises RenderFailed with its worker's message. After every
    BLOCK_SLICE_S without an event the job's status is read once, for jobs that end without one
    (a record quarantined, a job deleted)."""
    deadline, after = time.monotonic() + timeout, "0"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise JobTimeout(f"job {job.id} still {job.status()} after {timeout:.0f} s")
        for event in job.events(after=after, timeout=min(remaining, BLOCK_SLICE_S)):
            after = event.id or after
            if event.kind == "done" and event.result is not None:
                return event.result
            if event.terminal:
                break  # the job's record says why (RenderFailed below)
            if event.kind == "queued":  # again, after a shutdown put it back
                show("queued", 0, None)
            elif event.phase is not None:
                show(event.phase, event.step or 0, event.steps or None)
        result = job.result()  # RenderFailed for a failed, stopped or canceled job
        if result is not None:
            return result


def print_result(result: RenderResult) -> None:
    print(
        f"done {result.job_id}  {result.model}  seed {result.seed}  {result.steps} steps  "
        f"guidance {result.guidance}  {result.width}x{result.height}"
    )
    for image in result.images:
        print(f"  {image.path or image.uri}  sha256 {image.sha256[:16]}")
    for video in result.videos:
        print(
            f"  {video.path or video.uri}  {video.frames} frames at {video.fps} fps,"
            f" {video.duration_s:g} s  sha256 {video.sha256[:16]}"
        )
    print(
        f"  rung {result.rung}  device {result.device}  dtype {result.dtype}  "
        f"compiled {result.compiled}  attempts {[a.outcome for a in result.attempts]}"
    )
    print("timings (s)")
    timings = [f"{getattr(result.timings, p):.3f}" for p in PHASES]
    print_table([PHASE_HEADERS[p] for p in PHASES], [timings], indent="  ")


def print_snapshot(snapshot: JobSnapshot) -> None:
    """`kiln job ID`: one line (status, model, position, progress, ETA, error), then the
    result when there is one."""
    parts = [f"{snapshot.id}: {snapshot.status}"]
    if snapshot.model:
        parts.append(f"model {snapshot.model}")
    if snapshot.position is not None:
        parts.append(f"{snapshot.position} ahead in its queue")
    if snapshot.progress is not None:
        p = snapshot.progress
        parts.append(f"{p.phase} {p.step}/{p.steps}")
    if snapshot.eta_s is not None:
        parts.append(f"ETA {snapshot.eta_s:.1f} s")
    if snapshot.error:
        parts.append(f"error: {snapshot.error}")
    print(", ".join(parts))
    if snapshot.result is not None:
        print_result(snapshot.result)


MODEL_COLUMNS = (
    "model",
    "family",
    "served",
    "modes",
    "LoRAs",
    "default",
    "sizes",
    "workers",
    "resident",
    "ETA (default job)",
    "queued (interactive, batch)",
    "ETA submitted now (interactive, batch)",
)


# The models table's columns a narrow terminal loses first (the rest: model, served, modes, ETA).
MODEL_OPTIONAL = (
    "resident",
    "ETA submitted now (interactive, batch)",
    "LoRAs",
    "family",
    "sizes",
    "workers",
    "queued (interactive, batch)",
    "default",
)


def print_models(infos: list[ModelInfo]) -> None:
    """`kiln models`: the served models first, the table cut to the terminal's width."""
    rows = []
    for info in sorted(infos, key=lambda i: (not i.workers, i.manifest.id)):
        m = info.manifest
        eta = info.default_eta_s
        now = [info.eta_now_s(lane) for lane in ("interactive", "batch")]
        rows.append(
            [
                m.id,
                m.family,
                "yes" if info.workers else "no live worker",
                ", ".join(m.modes),
                ", ".join(sorted(m.loras)) or "-",
                f"{m.steps.default} steps, g {m.guidance.default}",
                " ".join(f"{w}x{h}" for w, h in m.resolutions),
                str(len(info.workers))
                + (f" ({len(info.blocked)} blocked)" if info.blocked else ""),
                ", ".join(info.resident_on) or "-",
                f"{eta:.2f} s" if eta is not None else "not measured",
                f"{info.queued.get('interactive', 0)}, {info.queued.get('batch', 0)}",
                ", ".join(f"{s:.2f} s" for s in now if s is not None) or "not measured",
            ]
        )
    width = terminal_width()
    hidden = print_table(MODEL_COLUMNS, rows, width=width, optional=MODEL_OPTIONAL)
    if hidden:
        named = f"left out to fit: {', '.join(hidden)} (all in kiln models --json)"
        short = f"left out to fit: {len(hidden)} columns (all in kiln models --json)"
        print(named if len(named) <= (width or 0) else short)
    blocked = {name: why for info in infos for name, why in info.blocked.items()}
    for name, why in sorted(blocked.items()):
        print(f"worker {name} takes no jobs: {why}")


def terminal_width() -> int | None:
    """COLUMNS, or the terminal's width; None for a pipe with COLUMNS unset (whole rows)."""
    return shutil.get_terminal_size((0, 0)).columns or None


def print_table(
    headers: Sequence[str],
    rows: list[list[str]],
    indent: str = "",
    *,
    width: int | None = None,
    optional: Sequence[str] = (),
) -> list[str]:
    """Columns left-aligned to their widest cell, two spaces apart, in at most width characters:
    the optional columns go first (in that order) until the rest fit, then the widest column's
    cells are cut, ending "...". The headers of the columns left out."""
    table = [list(headers), *[[str(cell) for cell in row] for row in rows]]
    hidden: list[str] = []

    def widths() -> list[int]:
        return [max(len(cell) for cell in column) for column in zip(*table, strict=True)]

    def over() -> int:
        return len(indent) + sum(widths()) + 2 * (len(table[0]) - 1) - (width or 10**9)

    for name in optional:
        if over() <= 0 or len(table[0]) == 1:
            break
        at = table[0].index(name)
        hidden.append(name)
        table = [row[:at] + row[at + 1 :] for row in table]
    while over() > 0:
        sizes = widths()
        at = sizes.index(max(sizes))
        cut = max(sizes[at] - over(), MIN_CELL)
        if cut >= sizes[at]:
            break  # nothing left to cut: the terminal is narrower than the shortest table
        table = [[*row[:at], _cut(row[at], cut), *row[at + 1 :]] for row in table]
    sizes = widths()
    for row in table:
        print(indent + "  ".join(c.ljust(w) for c, w in zip(row, sizes, strict=True)).rstrip())
    return hidden


def _cut(cell: str, most: int) -> str:
    return cell if len(cell) <= most else cell[: most - 3].rstrip() + "..."


def model_json(info: ModelInfo) -> dict[str, Any]:
    """`kiln models --json`: one object a model."""
    return {
        "id": info.manifest.id,
        "family": info.manifest.family,
        "served": bool(info.workers),
        "modes": list(info.manifest.modes),
        "loras": sorted(info.manifest.loras),
        "default_steps": info.manifest.steps.default,
        # An upscaler has none: each job is its image's size.
        "default_size": list(info.manifest.default_size) if info.manifest.resolutions else None,
        "workers": info.workers,
        "resident_on": info.resident_on,
        "eta_s": info.default_eta_s,
        "queued": info.queued,
        "blocked": info.blocked,
        "eta_now_s": {lane: info.eta_now_s(lane) for lane in info.queued},
        "fits": {f"{w}x{h}": fit.model_dump() for (w, h), fit in info.fits.items()},
    }
