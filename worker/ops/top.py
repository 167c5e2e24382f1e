"""`kiln top`: a live view of a kiln Redis, like `rq info --interval` but knowing kiln: each
worker's device, profile, resident models and rungs (and those in its RAM cache or being read
ahead), running job with its phase and step, jobs done and free memory; each model's queue depth
and the ETA of a default job submitted now; the last jobs that ended, with their phases.

It reads only what workers publish, a bounded amount per refresh: the live workers' states
(ZRANGE + MGET, api_client.eta.live_workers), the newest entry of each running job's event stream
(XREVRANGE COUNT 1), the published manifests, each queue's LLEN and next-job ETA
(worker/queue/upkeep/backlog.py, at most eta.AHEAD_READ jobs read), and the newest LAST_SCAN
entries of each model's queue event stream. Never RQ's registries or Job readers (they run RQ's
clean-up), never a whole queue. A worker's state is refreshed every 10 s, so a job shorter than
that may end before top sees it run; it shows under the last jobs either way.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from api_client import events, keys
from api_client.eta import live_workers
from api_client.manifest import Manifest
from api_client.schema import PHASES, JobEvent, WorkerState
from worker.ops.display import phase_header
from worker.queue.upkeep.backlog import Backlog, backlogs

if TYPE_CHECKING:
    from redis import Redis

Parsed = TypeVar("Parsed", bound=BaseModel)
LAST_SCAN = 50  # newest entries read from each model's queue stream, for the last jobs
ERROR_CHARS = 60  # a failed or stopped job's message in the last jobs' error column
ONCE_WIDTH = 10_000  # --once: one line per row, whatever the terminal (scripts grep it)
# SIMPLE_HEAD's layout with an ASCII rule under the header, so --once prints plain ASCII tables.
PLAIN = box.Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)


@dataclass(frozen=True)
class Running:
    """A worker's running job as its newest event has it (None fields: not reported yet)."""

    id: str
    model: str | None
    kind: str | None  # started, progress, preview; a terminal kind when it just ended
    phase: str | None
    step: int | None
    steps: int | None


@dataclass(frozen=True)
class Frame:
    """Everything one refresh shows."""

    taken_at: float
    workers: list[tuple[WorkerState, Running | None]]
    queues: list[tuple[Backlog, list[str]]]  # with the workers serving each model
    ended: list[JobEvent]  # newest first


def snapshot(connection: Redis, last: int = 10) -> Frame:
    """One frame, read as the module docstring says."""
    states = sorted(live_workers(connection), key=lambda s: s.name)
    with connection.pipeline(transaction=False) as pipe:
        for state in states:
            if state.running:
                pipe.xrevrange(keys.events_key(state.running), count=1)
        newest = iter(pipe.execute())
    workers = [(s, _running(s.running, next(newest)) if s.running else None) for s in states]
    manifests = {
        _text(k): manifest
        for k, v in connection.hgetall(keys.MANIFESTS_KEY).items()
        if (manifest := _parsed(Manifest, v)) is not None
    }
    serving: dict[str, list[str]] = {}
    for state in states:
        for model in state.models:
            serving.setdefault(model, []).append(state.name)
    models = sorted(set(serving) | set(manifests))
    queues = [
        (backlog, serving.get(backlog.model, []))
        for backlog in backlogs(connection, models, manifests)
        if backlog.model in serving or backlog.depth
    ]
    ended = _ended(connection, [b.model for b, _ in queues], last)
    return Frame(time.time(), workers, queues, ended)


def _running(job_id: str, entries: Any) -> Running:
    event = _event(entries[0][1]) if entries else None
    if event is None:
        return Running(job_id, None, None, None, None, None)
    return Running(job_id, event.model, event.kind, event.phase, event.step, event.steps)


def _event(fields: dict[bytes, bytes]) -> JobEvent | None:
    return _parsed(JobEvent, fields.get(events.FIELD))


def _parsed(model: type[Parsed], raw: bytes | str | None) -> Parsed | None:
    """raw as model, or None: anyone with write access may have put anything there, and one bad
    entry must not stop the view."""
    try:
        return None if raw is None else model.model_validate_json(raw)
    except ValidationError:
        return None


def _ended(connection: Redis, models: list[str], last: int) -> list[JobEvent]:
    """The last jobs that ended on these models' queues, newest first."""
    with connection.pipeline(transaction=False) as pipe:
        for model in models:
            pipe.xrevrange(keys.queue_events_key(model), count=LAST_SCAN)
        streams = pipe.execute()
    ended = [
        event
        for entries in streams
        for _id, fields in entries
        if (event := _event(fields)) is not None and event.terminal
    ]
    return sorted(ended, key=lambda e: e.at, reverse=True)[:last]


def render(frame: Frame, plain: bool = False) -> Group:
    """The frame as three tables: workers, queues, last jobs (plain: ASCII rules)."""
    stamp = datetime.fromtimestamp(frame.taken_at, timezone.utc).strftime("%H:%M:%S UTC")
    title = Text(f"kiln top  {stamp}  {len(frame.workers)} workers, {len(frame.queues)} queues")
    style = PLAIN if plain else box.SIMPLE_HEAD
    return Group(title, _workers(frame, style), _queues(frame, style), _last_jobs(frame, style))


def _table(title: str, style: box.Box, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", box=style, show_edge=False, pad_edge=False)
    for column in columns:
        table.add_column(column, no_wrap=True)
    return table


def _workers(frame: Frame, style: box.Box) -> Table:
    table = _table(
        "workers", style, "worker", "device", "state", "resident", "running", "done", "free", "seen"
    )
    for state, running in frame.workers:
        device = f"{state.device_name} ({state.device})"
        if state.profile:
            device += f" as {state.profile}"
        resident = ", ".join(
            f"{model}@{state.rungs[model]}" if model in state.rungs else model
            for model in state.resident
        )
        # Off the device: its RAM cache, and the model it reads ahead into it (KILN_PREFETCH).
        held = [f"{model}@ram" for model in state.ram]
        held += [f"{state.reading}@reading"] if state.reading else []
        resident = ", ".join([resident, *held] if resident else held)
        table.add_row(
            state.name,
            device,
            # An older worker published RQ's enum as str() spells it (WorkerStatus.BUSY).
            state.state.removeprefix("WorkerStatus.").lower(),
            resident or "-",
            _describe(running),
            str(state.jobs_done),
            _gigabytes(state.free_bytes),
            f"{max(frame.taken_at - state.heartbeat, 0):.0f} s ago",
        )
    if not frame.workers:
        table.add_row("(no live workers)", *[""] * 7)
    return table


def _describe(running: Running | None) -> str:
    if running is None:
        return "-"
    where = f"{running.id} ({running.model})" if running.model else running.id
    if running.kind is None:
        return f"{where} starting"
    if running.kind == "progress" and running.phase:
        step = f" {running.step}/{running.steps}" if running.steps else ""
        return f"{where} {running.phase}{step}"
    return f"{where} {running.kind}"


def _queues(frame: Frame, style: box.Box) -> Table:
    table = _table("queues", style, "queue", "depth", "next default job", "workers")
    for backlog, serving in frame.queues:
        eta = "not measured" if backlog.eta_s is None else f"{backlog.eta_s:.1f} s"
        table.add_row(
            keys.queue_name(backlog.model), str(backlog.depth), eta, ", ".join(serving) or "none"
        )
    if not frame.queues:
        table.add_row("(no queues served)", "", "", "")
    return table


def _last_jobs(frame: Frame, style: box.Box) -> Table:
    phases = [phase_header(p) for p in PHASES]
    columns = ("ended", "job", "model", "status", "worker", "rung", *phases, "error")
    table = _table("last jobs", style, *columns)
    for event in frame.ended:
        ended = datetime.fromtimestamp(event.at, timezone.utc).strftime("%H:%M:%S")
        result = event.result
        if result is None:  # failed or stopped: no phases; the worker's message, cut to fit
            row = [ended, event.job_id, event.model or "", event.kind, "", ""]
            table.add_row(*row, *[""] * len(PHASES), _first_line(event.error or ""))
            continue
        seconds = [f"{getattr(result.timings, p):.2f}" for p in PHASES]
        row = [ended, event.job_id, result.model, event.kind, result.worker or "", result.rung]
        table.add_row(*row, *seconds, "")
    if not frame.ended:
        table.add_row("(none yet)", *[""] * (len(columns) - 1))
    return table


def _first_line(error: str) -> str:
    """An error's first line, at most ERROR_CHARS: `kiln job ID` shows the whole of it."""
    line = error.strip().splitlines()[0] if error.strip() else ""
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 3].rstrip() + "..."


def _gigabytes(count: int | None) -> str:
    return "-" if count is None else f"{count / 1e9:.1f} GB"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def run_top(connection: Redis, once: bool, interval_s: float, last: int) -> int:
    """--once: one frame as plain text on stdout; else redraw every interval_s until Ctrl-C."""
    if once:
        console = Console(width=ONCE_WIDTH, color_system=None, highlight=False)
        with console.capture() as frame:
            console.print(render(snapshot(connection, last), plain=True), crop=False)
        sys.stdout.write("".join(line.rstrip() + "\n" for line in frame.get().splitlines()))
        return 0
    with Live(render(snapshot(connection, last)), auto_refresh=False, screen=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                live.update(render(snapshot(connection, last)), refresh=True)
        except KeyboardInterrupt:
            return 0
