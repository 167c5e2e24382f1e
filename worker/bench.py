"""`kiln bench`: a prompt suite over a matrix of models, steps, sizes and settings, measured in one
run so ratios compare like with like; medians and p90 with cold runs excluded, and a linear fit
seconds = fixed + steps * per_step per model and size.

Over 300 lines because the matrix grammar, the two ways to run it (renderer, queue) and the
report tables belong to one verb and change together."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import uuid
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from worker.report import percentile, summarize, write_chart, write_csv
from worker.settings import Settings
from worker.timings import TimingRecord, linear_fit


class Cell(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    steps: list[int] = Field(min_length=1)
    sizes: list[tuple[int, int]] = Field(min_length=1)
    guidance: float | None = None
    num_images: int = 1
    settings: dict[str, Any] = Field(default_factory=dict)  # Settings fields, e.g. memory_mode


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


def plan(suite: Suite, matrix: Matrix) -> list[tuple[Cell, dict[str, Any]]]:
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
                    requests.append((cell, request))
    return requests


def run_in_process(
    base: Settings,
    requests: list[tuple[Cell, dict[str, Any]]],
    manifests: dict[str, Any],
    on_done: Any,
) -> list[tuple[Cell, TimingRecord]]:
    """Render directly (no queue), one Renderer per distinct settings override."""
    from worker.context import LocalContext
    from worker.render import Renderer

    renderers: dict[str, Renderer] = {}
    finished: list[TimingRecord] = []
    done = []
    for cell, request in requests:
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
        done.append((cell, finished[-1]))
        on_done()
    return done


def run_through_queue(
    base: Settings, requests: list[tuple[Cell, dict[str, Any]]], on_done: Any, timeout: float
) -> list[tuple[Cell, TimingRecord]]:
    """Submit through the client and wait, so the numbers include the real dispatch path."""
    from api_client import KilnClient, RenderFailed

    client = KilnClient(base.redis_url, manifests_dir=base.manifests)
    done = []
    seen: set[tuple[str, int, int]] = set()
    for cell, request in requests:
        if cell.settings:
            raise ValueError(
                "--through-queue runs with the workers' settings; cells may not set any"
            )
        job = client.submit(request)
        record = TimingRecord(
            job_id=job.id,
            model=request["model"],
            steps=request["steps"],
            width=request["width"],
            height=request["height"],
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
        done.append((cell, record))
        on_done()
    return done


def group(done: list[tuple[Cell, TimingRecord]]) -> list[Group]:
    groups: dict[tuple[Any, ...], Group] = {}
    for cell, record in done:
        settings = ", ".join(f"{k}={v}" for k, v in sorted(cell.settings.items())) or "defaults"
        key = (record.model, record.width, record.height, record.steps, settings)
        if key not in groups:
            groups[key] = Group(
                str(record.model),
                (record.width or 0, record.height or 0),
                record.steps or 0,
                settings,
            )
        groups[key].records.append(record)
    return list(groups.values())


def render_tables(groups: list[Group]) -> list[Any]:
    from rich.table import Table

    points = Table(
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
        title="kiln bench: per point (cold runs excluded)",
    )
    baseline: dict[str, float] = {}
    for g in groups:
        totals = [r.timings.total for r in g.warm]
        failed = sum(1 for r in g.records if r.status != "done")
        if not totals:
            points.add_row(
                g.model,
                f"{g.size[0]}x{g.size[1]}",
                str(g.steps),
                g.settings,
                "0",
                str(failed),
                "-",
                "-",
                "-",
                "-",
            )
            continue
        median = statistics.median(totals)
        per_step = statistics.median(r.timings.denoise / max(r.steps or 1, 1) for r in g.warm)
        ratio_key = f"{g.model}:{g.size}:{g.steps}"
        ratio = median / baseline[ratio_key] if ratio_key in baseline else None
        baseline.setdefault(ratio_key, median)
        points.add_row(
            g.model,
            f"{g.size[0]}x{g.size[1]}",
            str(g.steps),
            g.settings,
            str(len(totals)),
            str(failed),
            f"{median:.3f}",
            f"{percentile(totals, 90):.3f}",
            f"{per_step:.4f}",
            f"{ratio:.2f}x" if ratio is not None else "1.00x",
        )
    fits = Table(
        "model",
        "size",
        "settings",
        "fixed s",
        "s per step",
        "points",
        title="linear fit of warm totals: seconds = fixed + steps x per_step",
    )
    by_line: dict[tuple[Any, ...], list[tuple[int, float]]] = {}
    for g in groups:
        by_line.setdefault((g.model, g.size, g.settings), []).extend(
            (g.steps, r.timings.total) for r in g.warm
        )
    for (model, size, settings), pts in by_line.items():
        fit = linear_fit(pts)
        if fit is not None:
            fits.add_row(
                model,
                f"{size[0]}x{size[1]}",
                settings,
                f"{fit[0]:.3f}",
                f"{fit[1]:.4f}",
                str(len(pts)),
            )
    return [points, fits]


def run_bench(
    settings: Settings,
    suite_path: Path,
    matrix_path: Path,
    out: Path | None,
    through_queue: bool,
    timeout: float = 600.0,
) -> int:
    from rich.progress import Progress

    from worker.display import wide_console
    from worker.manifest import load_manifests

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
    console.print(
        f"kiln bench: {len(requests)} jobs ({len(matrix.cells)} cells x "
        f"{len(suite.prompts)} prompts"
        f" x repeat {matrix.repeat}) {'through the queue' if through_queue else 'in process'}"
    )
    started = time.perf_counter()
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("rendering", total=len(requests))

        def advance() -> None:
            bar.advance(task)

        if through_queue:
            done = run_through_queue(settings, requests, advance, timeout)
        else:
            manifests = load_manifests(settings.manifests, sorted({c.model for c in matrix.cells}))
            done = run_in_process(settings, requests, manifests, advance)
    groups = group(done)
    for table in render_tables(groups):
        console.print(table)
    records = [record for _, record in done]
    if through_queue:
        log.write_text("".join(r.model_dump_json() + "\n" for r in records))
    write_csv(records, out / "timings.csv")
    write_chart(summarize(records), out / "phases.png")
    console.print(
        f"{len(records)} jobs in {time.perf_counter() - started:.1f} s; records {log}, "
        f"CSV {out / 'timings.csv'}, chart {out / 'phases.png'}"
    )
    return 1 if any(r.status != "done" for r in records) else 0
