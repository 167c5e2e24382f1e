"""Human output for the command line: progress while waiting, results and model tables."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from api_client import KilnJob, ModelInfo, RenderResult
from api_client.errors import JobTimeout
from api_client.events import BLOCK_SLICE_S
from api_client.schema import PHASES

console = Console(stderr=True)


def wait_with_progress(job: KilnJob, timeout: float, quiet: bool = False) -> RenderResult:
    """Follow the job's events; draw {phase, step/steps} as a bar on stderr unless quiet."""
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
        transient=True,
    ) as bar:
        task = bar.add_task(f"{job.id[:8]} queued", total=None)

        def show(phase: str, step: int, steps: int | None) -> None:
            bar.update(task, description=f"{job.id[:8]} {phase}", completed=step, total=steps)

        return follow_job(job, timeout, show)


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
    out = wide_console()
    out.print(
        f"[bold green]done[/] {result.job_id}  {result.model}  seed {result.seed}  "
        f"{result.steps} steps  guidance {result.guidance}  {result.width}x{result.height}"
    )
    for image in result.images:
        out.print(f"  {image.path or image.uri}  sha256 {image.sha256[:16]}")
    out.print(
        f"  rung {result.rung}  device {result.device}  dtype {result.dtype}  "
        f"compiled {result.compiled}  attempts {[a.outcome for a in result.attempts]}"
    )
    table = Table(*[phase_header(p) for p in PHASES], title="timings (s)")
    table.add_row(*[f"{getattr(result.timings, p):.3f}" for p in PHASES])
    out.print(table)


def print_models(infos: list[ModelInfo]) -> None:
    table = Table(
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
    for info in infos:
        m = info.manifest
        eta = info.default_eta_s
        now = [info.eta_now_s(lane) for lane in ("interactive", "batch")]
        served = "yes" if info.workers else "no live worker"
        table.add_row(
            m.id,
            m.family,
            served,
            ", ".join(m.modes),
            ", ".join(sorted(m.loras)) or "-",
            f"{m.steps.default} steps, g {m.guidance.default}",
            " ".join(f"{w}x{h}" for w, h in m.resolutions),
            str(len(info.workers)) + (f" ({len(info.blocked)} blocked)" if info.blocked else ""),
            ", ".join(info.resident_on) or "-",
            f"{eta:.2f} s" if eta is not None else "not measured",
            f"{info.queued.get('interactive', 0)}, {info.queued.get('batch', 0)}",
            ", ".join(f"{s:.2f} s" for s in now if s is not None) or "not measured",
        )
    console = wide_console()
    console.print(table)
    blocked = {name: why for info in infos for name, why in info.blocked.items()}
    for name, why in sorted(blocked.items()):
        console.print(f"worker {name} takes no jobs: {why}", soft_wrap=True)


SHORT = {"queue_wait": "wait", "text_encode": "text", "image_encode": "encode"}


def phase_header(phase: str) -> str:
    return SHORT.get(phase, phase)


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
