"""The client verbs as a newcomer meets them (issue 40): `kiln models` fits the terminal with the
served models first; `kiln submit` without --wait warns on stderr when no live worker serves
the model; `kiln job ID` exits as the README's exit codes say; `kiln top --once` keeps a failed
job's message in its own column, cut; a progress event never passes its step count (tiny-sd15
runs PNDM, which calls back steps + 1 times). Real `kiln` processes on a real Redis."""

from __future__ import annotations

import json
import time
from typing import Any

from redis import Redis
from rich.console import Console

from api_client.schema import JobEvent
from tests.conftest import kiln
from tests.support.fleet import live_worker
from tests.support.inprocess import make_renderer, make_worker
from worker.ops.top import ERROR_CHARS, Frame, render
from worker.render.context import LocalContext

SUBMIT = ("submit", "a quiet harbour", "--model", "tiny-sd15", "--steps", "2")


def test_models_fits_columns_and_lists_the_served_models_first(
    kiln_env: dict[str, str], redis_conn: Redis, settings: Any
) -> None:
    make_worker(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])  # publishes
    live_worker(redis_conn, ["tiny-sdxl"])
    narrow = kiln("models", env={**kiln_env, "COLUMNS": "80"}, check=True).stdout.splitlines()
    assert all(len(line) <= 80 for line in narrow), "\n".join(narrow)
    header, first, *rest = narrow
    assert header.split()[:2] == ["model", "served"], header
    assert first.startswith("tiny-sdxl ") and " yes " in first, narrow  # served, though not first
    assert any(line.startswith("tiny-sd15 ") and "no live worker" in line for line in rest)
    assert narrow[-1].startswith("left out to fit: ") and "kiln models --json" in narrow[-1]
    # A pipe with COLUMNS unset gets whole rows, every column.
    whole = kiln("models", env={k: v for k, v in kiln_env.items() if k != "COLUMNS"}, check=True)
    lines = whole.stdout.splitlines()
    assert "ETA submitted now (interactive, batch)" in lines[0] and max(map(len, lines)) > 120
    assert not any(line.startswith("left out") for line in lines)


def test_submit_warns_when_no_worker_serves_and_job_exits_1_for_an_undone_job(
    kiln_env: dict[str, str], redis_conn: Redis
) -> None:
    queued = kiln(*SUBMIT, env=kiln_env)
    assert queued.returncode == 0 and queued.stdout.startswith("queued "), queued
    job_id = queued.stdout.split()[1]
    [warning] = queued.stderr.strip().splitlines()
    assert warning.startswith(f"kiln submit: warning: job {job_id} waits in its queue: ")
    assert "no live worker serves tiny-sd15" in warning and f"kiln cancel {job_id}" in warning
    assert kiln("job", job_id, env=kiln_env).returncode == 0  # queued: nothing wrong yet
    assert kiln("cancel", job_id, env=kiln_env).returncode == 0
    for extra in ((), ("--json",)):
        shown = kiln("job", job_id, *extra, env=kiln_env)
        assert shown.returncode == 1 and "canceled" in shown.stdout, (extra, shown)
    # A served model: no warning.
    live_worker(redis_conn, ["tiny-sd15"])
    served = kiln(*SUBMIT, "--json", env=kiln_env)
    assert served.returncode == 0 and served.stderr.strip() == "", served.stderr
    assert json.loads(served.stdout)["job_id"]


def test_top_once_cuts_a_failed_jobs_message_inside_its_own_column() -> None:
    error = "RuntimeError: " + "a long reason " * 20 + "\nTraceback line two"
    failed = JobEvent(
        kind="failed", job_id="j-failed", model="tiny-sd15", at=time.time(), error=error
    )
    console = Console(width=10_000, color_system=None)
    with console.capture() as captured:
        console.print(render(Frame(time.time(), [], [], [failed]), plain=True), crop=False)
    lines = [line.rstrip() for line in captured.get().splitlines()]
    header = next(line for line in lines if line.startswith("ended"))
    [row] = [line for line in lines if "j-failed" in line]
    assert header.split()[-1] == "error" and row.index("RuntimeError") == header.index("error")
    message = row[header.index("error") :]
    assert len(message) == ERROR_CHARS and message.endswith("...") and "two" not in row


class Recorded(LocalContext):
    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.steps: list[tuple[str, int, int]] = []

    def progress(self, phase: str, step: int, steps: int, preview: str | None = None) -> None:
        self.steps.append((phase, step, steps))


def test_progress_never_passes_its_step_count(settings: Any) -> None:
    renderer = make_renderer(settings, ["tiny-sd15"])
    ctx = Recorded("pndm-steps")
    result = renderer.render({"model": "tiny-sd15", "prompt": "x", "steps": 3, "seed": 1}, ctx)
    denoise = [(step, steps) for phase, step, steps in ctx.steps if phase == "denoise"]
    assert [s for s in denoise if s[0] > 0] == [(1, 3), (2, 3), (3, 3), (3, 3)], denoise  # PNDM
    assert result.steps == 3
