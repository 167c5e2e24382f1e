"""`kiln bench`: a prompt suite over a matrix of models, steps, sizes and settings, measured in one
run so ratios compare like with like; medians and p90 with cold runs excluded, and a linear fit
seconds = fixed + steps * per_step per model and size, a fit that is noise called so. Before it
starts it says how many renders and how long (worker.ops.forecast), and while it runs it draws a
bar on stderr and a line as each cell ends, the estimate updated as it measures.

Over 400 lines because the matrix grammar, the progress, the two ways to run it (renderer,
queue), the report tables and the chart's data belong to one verb and change together."""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_client.schema import PHASES
from worker.ops.forecast import Estimate, duration, published_fits
from worker.ops.report import (
    BenchLine,
    BenchPoint,
    fit_note,
    percentile,
    write_bench_chart,
    write_csv,
)
from worker.render.timings import TimingRecord, linear_fit
from worker.settings import Settings

if TYPE_CHECKING:
    from rich.console import Console

Request = tuple["Cell", dict[str, Any]]


class Cell(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    steps: list[int] = Field(min_length=1)
    sizes: list[tuple[int, int]] = Field(min_length=1)
    guidance: float | None = None
    true_cfg: float | None = None  # FLUX.1 and Qwen-Image: a suite's negative prompts need it
    num_images: int = 1
    settings: dict[str, Any] = Field(default_factory=dict)  # Settings fields, e.g. memory_mode

    @property
    def settings_label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(self.settings.items())) or "defaults"


class Matrix(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    repeat: int = Field(1, ge=1)
    cells: list[Cell] = Field(min_length=1)


class Suite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    prompts: list[dict[str, str]] = Field(min_length=1)


@dataclass
class Group:
    """The runs of one (model, size, steps, settings) point of the matrix."""

    model: str
    size: tuple[int, int]
    steps: int
    settings: str
    records: list[TimingRecord] = field(default_factory=list)

    @property
    def warm(self) -> list[TimingRecord]:
        return [r for r in self.records if r.steady]


class BenchInputInvalid(ValueError):
    """A suite or matrix file is missing or breaks its schema; names the file and the fields."""


def load_inputs(suite_path: Path, matrix_path: Path) -> tuple[Suite, Matrix]:
    return _load(Suite, suite_path), _load(Matrix, matrix_path)


def _load(kind: type[Any], path: Path) -> Any:
    try:
        return kind.model_validate_json(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BenchInputInvalid(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(file)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise BenchInputInvalid(f"{path}: {problems}") from None


def plan(suite: Suite, matrix: Matrix) -> list[Request]:
    """Every request of the run, in order: cell by cell, so a cell's first job is its cold one."""
    requests = []
    for cell in matrix.cells:
        for steps, (width, height) in product(cell.steps, cell.sizes):
            for _ in range(matrix.repeat):
                for index, prompt in enumerate(suite.prompts):
                    request: dict[str, Any] = {
                        "model": cell.model,
                        "steps": steps,
                        "width": width,
                        "height": height,
                        "seed": index,
                        "num_images": cell.num_images,
                        **prompt,
                    }
                    if cell.guidance is not None:
                        request["guidance"] = cell.guidance
                    if cell.true_cfg is not None:
                        request["true_cfg"] = cell.true_cfg
                    requests.append((cell, request))
    return requests


@contextlib.contextmanager
def _logs_above_the_bar() -> Iterator[None]:
    """While the bar is drawn rich has swapped sys.stderr for a proxy that prints above it, but
    log handlers hold the stream they were made with: point those at the proxy meanwhile."""
    from rich.file_proxy import FileProxy

    proxy = sys.stderr
    if not isinstance(proxy, FileProxy):
        yield
        return
    real = proxy.rich_proxied_file
    moved = [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.StreamHandler) and h.stream is real
    ]
    for handler in moved:
        handler.setStream(proxy)
    try:
        yield
    finally:
        for handler in moved:
            handler.setStream(real)


def _point(cell: Cell, request: dict[str, Any]) -> str:
    where = "" if not cell.settings else f" ({cell.settings_label})"
    size = f"{request['width']}x{request['height']}"
    return f"{request['model']} {size} {request['steps']} steps{where}"


class BenchMonitor:
    """The run as it goes: a bar on stderr, drawn on a terminal only, naming the point being
    rendered with the time left by the fits; and a line on stdout as each cell ends, with the
    estimate of what is left as measured so far."""

    def __init__(
        self,
        requests: list[Request],
        estimate: Estimate,
        out: Console,
        bar_console: Console | None = None,
    ) -> None:
        from rich import progress as rp
        from rich.console import Console

        self.requests, self.estimate, self.out = requests, estimate, out
        bar_console = bar_console or Console(stderr=True)
        self.bar = rp.Progress(
            rp.TextColumn("[bold]{task.description}"),
            rp.BarColumn(),
            rp.MofNCompleteColumn(),
            rp.TimeElapsedColumn(),
            rp.TextColumn("{task.fields[left]}"),
            console=bar_console,
            disable=not bar_console.is_terminal,
            transient=True,
            redirect_stdout=out.is_terminal,  # stdout to a file stays in the file
        )
        self.task = self.bar.add_task(
            "starting", total=len(requests), left=estimate.of(requests).short
        )
        self.cells = len({id(cell) for cell, _ in requests})
        self._stack = contextlib.ExitStack()
        self._cell_number = 0
        self._cell_records: list[TimingRecord] = []
        self._cell_started = 0.0

    def __enter__(self) -> BenchMonitor:
        self._stack.enter_context(self.bar)
        self._stack.enter_context(_logs_above_the_bar())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def start(self, index: int) -> None:
        cell, request = self.requests[index]
        if index == 0 or self.requests[index - 1][0] is not cell:
            self._cell_started = time.perf_counter()  # a cell's time: its loads and renders
        self.bar.update(self.task, description=_point(cell, request))

    def done(self, index: int, record: TimingRecord) -> None:
        cell, _ = self.requests[index]
        self.estimate.add(cell, record)
        self._cell_records.append(record)
        rest = self.requests[index + 1 :]
        left = self.estimate.of(rest)
        self.bar.update(self.task, advance=1, left=left.short)
        if rest and rest[0][0] is cell:
            return
        self._cell_number += 1
        records, self._cell_records = self._cell_records, []
        failed = sum(1 for r in records if r.status != "done")
        sizes = ", ".join(f"{w}x{h}" for w, h in cell.sizes)
        line = (
            f"[{self._cell_number}/{self.cells}] {cell.model} {sizes} steps "
            f"{', '.join(map(str, cell.steps))} ({cell.settings_label}): {len(records)} renders "
            f"in {duration(time.perf_counter() - self._cell_started)}"
            + (f", {failed} failed" if failed else "")
            + (f"; {left.renders} left, {left}" if rest else "")
        )
        self.out.print(line, markup=False, highlight=False, soft_wrap=True)


@dataclass(frozen=True)
class Run:
    cell: Cell
    request: dict[str, Any]
    record: TimingRecord


def run_in_process(
    base: Settings, requests: list[Request], manifests: dict[str, Any], monitor: BenchMonitor
) -> list[Run]:
    """Render directly (no queue), one Renderer per distinct settings override."""
    from worker import logs
    from worker.pipelines.loading import import_pipeline_classes
    from worker.render.context import LocalContext
    from worker.render.renderer import Renderer

    import_pipeline_classes(list(manifests.values()))
    logs.route_library_logs()  # their warnings through kiln's handler, so above the bar
    renderers: dict[str, Renderer] = {}
    finished: list[TimingRecord] = []
    done = []
    for index, (cell, request) in enumerate(requests):
        monitor.start(index)
        key = json.dumps(cell.settings, sort_keys=True)
        if key not in renderers:
            for other in renderers.values():  # one set of resident pipelines at a time
                other.cache.evict_others(keep=None)
            renderers[key] = Renderer(
                base.model_copy(update=cell.settings), manifests, on_record=finished.append
            )
        renderer = renderers[key]
        # A failed point is recorded (status, error) and reported; the run goes on.
        with contextlib.suppress(Exception):
            renderer.render(request, LocalContext(f"bench-{uuid.uuid4().hex[:12]}"))
        done.append(Run(cell, request, finished[-1]))
        monitor.done(index, finished[-1])
    return done


def run_through_queue(
    base: Settings, requests: list[Request], monitor: BenchMonitor, timeout: float
) -> list[Run]:
    """Submit through the client and wait, so the numbers include the real dispatch path."""
    from api_client import KilnClient, RenderFailed

    client = KilnClient(base.redis_url, manifests_dir=base.manifests)
    done = []
    seen: set[tuple[str, int, int]] = set()
    for index, (cell, request) in enumerate(requests):
        if cell.settings:
            raise ValueError(
                "--through-queue runs with the workers' settings; cells may not set any"
            )
        monitor.start(index)
        job = client.submit(request)
        record = TimingRecord(
            job_id=job.id,
            model=request["model"],
            steps=request["steps"],
            width=request["width"],
            height=request["height"],
            num_images=request["num_images"],
        )
        try:
            result = job.wait(timeout=timeout)
            record.status, record.timings, record.rung = "done", result.timings, result.rung
            # The result carries no cold flag; a load, or the first job of a shape here, is cold.
            shape = (result.model, result.width, result.height)
            record.cold = result.timings.load > 0 or shape not in seen
            seen.add(shape)
        except RenderFailed as exc:
            record.error = exc.message
        done.append(Run(cell, request, record))
        monitor.done(index, record)
    return done


def group(done: list[Run]) -> list[Group]:
    """Runs by the point they were asked for (a rejected request's record has no size)."""
    groups: dict[tuple[Any, ...], Group] = {}
    for run in done:
        r = run.request
        key = (r["model"], r["width"], r["height"], r["steps"], run.cell.settings_label)
        if key not in groups:
            groups[key] = Group(
                r["model"], (r["width"], r["height"]), r["steps"], run.cell.settings_label
            )
        groups[key].records.append(run.record)
    return list(groups.values())


def fit_lines(groups: list[Group]) -> list[tuple[Group, BenchLine]]:
    """Warm totals against steps per model, size and settings, and their least-squares line;
    each with the first group of its line."""
    by_line: dict[tuple[Any, ...], tuple[Group, list[tuple[int, float]]]] = {}
    for g in groups:
        _, samples = by_line.setdefault((g.model, g.size, g.settings), (g, []))
        samples.extend((g.steps, r.timings.total) for r in g.warm)
    lines = []
    for first, samples in by_line.values():
        if samples:
            where = "" if first.settings == "defaults" else f" {first.settings}"
            label = f"{first.model} {first.size[0]}x{first.size[1]}{where}"
            lines.append((first, BenchLine(label, samples, linear_fit(samples))))
    return lines


POINT_COLUMNS = (
    "model",
    "size",
    "steps",
    "settings",
    "warm",
    "failed",
    "median total",
    "p90 total",
    "denoise/step",
    "vs first row of model",
)
FIT_COLUMNS = ("model", "size", "settings", "fixed s", "s per step", "points", "note")


def render_tables(groups: list[Group]) -> list[Any]:
    from rich.table import Table

    points = Table(*POINT_COLUMNS, title="kiln bench: per point (cold runs excluded)")
    baseline: dict[str, float] = {}
    for g in groups:
        totals = [r.timings.total for r in g.warm]
        failed = sum(1 for r in g.records if r.status != "done")
        point = [g.model, f"{g.size[0]}x{g.size[1]}", str(g.steps), g.settings]
        if not totals:
            points.add_row(*point, "0", str(failed), "-", "-", "-", "-")
            continue
        median = statistics.median(totals)
        denoise = statistics.median(r.timings.denoise / max(r.steps or 1, 1) for r in g.warm)
        ratio_key = f"{g.model}:{g.size}:{g.steps}"
        ratio = median / baseline[ratio_key] if ratio_key in baseline else 1.0
        baseline.setdefault(ratio_key, median)
        points.add_row(
            *point,
            str(len(totals)),
            str(failed),
            f"{median:.3f}",
            f"{percentile(totals, 90):.3f}",
            f"{denoise:.4f}",
            f"{ratio:.2f}x",
        )
    fits = Table(
        *FIT_COLUMNS, title="linear fit of warm totals: seconds = fixed + steps x per_step"
    )
    for first, line in fit_lines(groups):
        # A fit that is noise shows as such, never as numbers: its note says why.
        note = line.note if line.fit is None else fit_note(line.fit)
        shown = ("-", "-") if line.fit is None else ("noise", "noise")
        if line.fit is not None and note is None:
            shown = (f"{line.fit[0]:.3f}", f"{line.fit[1]:.4f}")
        size = f"{first.size[0]}x{first.size[1]}"
        fits.add_row(first.model, size, first.settings, *shown, str(len(line.samples)), note or "")
    return [points, fits]


def chart_data(groups: list[Group]) -> tuple[list[BenchPoint], list[BenchLine]]:
    """One bar a point: by model and settings in the order they ran, then by size and steps."""
    models = list(dict.fromkeys(g.model for g in groups))
    settings = list(dict.fromkeys(g.settings for g in groups))
    points = []
    for g in sorted(
        groups, key=lambda g: (models.index(g.model), settings.index(g.settings), g.size, g.steps)
    ):
        if g.warm:
            label = f"{g.size[0]}x{g.size[1]}, {g.steps} st"
            if g.settings != "defaults":
                label += f"\n{g.settings}"
            phases = {p: statistics.median(getattr(r.timings, p) for r in g.warm) for p in PHASES}
            points.append(BenchPoint(g.model, label, phases))
    return points, [line for _, line in fit_lines(groups)]


def run_bench(
    settings: Settings,
    suite_path: Path,
    matrix_path: Path,
    out: Path | None,
    through_queue: bool,
    timeout: float = 600.0,
) -> int:
    from worker.manifest import load_manifests
    from worker.ops.display import wide_console

    console = wide_console()
    try:
        suite, matrix = load_inputs(suite_path, matrix_path)
    except BenchInputInvalid as exc:
        console.print(f"kiln bench: {exc}")
        return 2
    out = out or Path("bench") / "results" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    log = out / "timings.jsonl"
    settings = settings.model_copy(update={"timings_log": log, "output_dir": out / "images"})
    requests = plan(suite, matrix)
    points = len({(id(c), r["steps"], r["width"], r["height"]) for c, r in requests})
    estimate = Estimate(published_fits(settings.redis_url))
    expected = estimate.of(requests)
    console.print(
        f"kiln bench: {len(requests)} renders ({points} points from {len(matrix.cells)} cells"
        f" x {len(suite.prompts)} prompts x repeat {matrix.repeat})"
        f" {'through the queue' if through_queue else 'in process'}",
        markup=False,
    )
    source = (
        "by the workers' timing fits in kiln:fits"
        if expected.known
        else "kiln:fits has no timing fit for these models and sizes"
    )
    console.print(
        f"expected: {expected} ({source}; model loads not counted; updated as it measures)",
        markup=False,
        soft_wrap=True,
    )
    started = time.perf_counter()
    with BenchMonitor(requests, estimate, console) as monitor:
        if through_queue:
            done = run_through_queue(settings, requests, monitor, timeout)
        else:
            manifests = load_manifests(settings.manifests, sorted({c.model for c in matrix.cells}))
            done = run_in_process(settings, requests, manifests, monitor)
    groups = group(done)
    for table in render_tables(groups):
        console.print(table)
    records = [run.record for run in done]
    failures: dict[str, list[str]] = {}  # why -> the model of each render that failed so
    for run in done:
        if run.record.status != "done":
            failures.setdefault(run.record.error or run.record.status, []).append(run.cell.model)
    for error, models in failures.items():
        where = ", ".join(sorted(set(models)))
        console.print(f"failed {len(models)} ({where}): {error}", markup=False, soft_wrap=True)
    if through_queue:
        log.write_text("".join(r.model_dump_json() + "\n" for r in records))
    write_csv(records, out / "timings.csv")
    write_bench_chart(*chart_data(groups), out / "phases.png")
    took = f"{len(records)} renders in {duration(time.perf_counter() - started)}"
    if not expected.unknown:
        took += f" (expected {expected})"
    console.print(
        f"{took}; records {log}, CSV {out / 'timings.csv'}, chart {out / 'phases.png'}",
        markup=False,
        soft_wrap=True,
    )
    return 1 if any(r.status != "done" for r in records) else 0
