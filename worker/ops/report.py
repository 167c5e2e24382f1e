"""`kiln timings`: per-model phase medians and p90 from the timings log, drift, CSV and a chart;
and the chart `kiln bench` draws (one bar per point, the step fits with their noise called so)."""

from __future__ import annotations

import csv as csv_module
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from api_client.schema import PHASES
from worker.ops.display import phase_header, phase_table, wide_console
from worker.render.timings import TimingRecord, read_records


@dataclass(frozen=True)
class PhaseStats:
    median: float
    p90: float


@dataclass(frozen=True)
class ModelSummary:
    model: str
    jobs: int  # warm, done jobs the stats are made of
    cold: int
    failed: int
    phases: dict[str, PhaseStats]
    drift: float | None  # newest window's median total / oldest window's, when enough jobs


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; exact for small samples, no interpolation surprises."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def summarize(records: list[TimingRecord], window: int = 10) -> list[ModelSummary]:
    by_model: dict[str, list[TimingRecord]] = defaultdict(list)
    for record in records:
        by_model[record.model or "?"].append(record)
    summaries = []
    for model, group in sorted(by_model.items()):
        warm = [r for r in group if r.steady]
        phases = (
            {
                phase: PhaseStats(
                    statistics.median([getattr(r.timings, phase) for r in warm]),
                    percentile([getattr(r.timings, phase) for r in warm], 90),
                )
                for phase in PHASES
            }
            if warm
            else {}
        )
        drift = None
        if len(warm) >= 2 * window:
            old = statistics.median(r.timings.total for r in warm[:window])
            new = statistics.median(r.timings.total for r in warm[-window:])
            drift = new / old if old else None
        summaries.append(
            ModelSummary(
                model=model,
                jobs=len(warm),
                cold=sum(1 for r in group if r.cold and r.status == "done"),
                failed=sum(1 for r in group if r.status != "done"),
                phases=phases,
                drift=drift,
            )
        )
    return summaries


def summary_table(summaries: list[ModelSummary]) -> Table:
    table = Table(
        "model",
        "warm",
        "cold",
        "failed",
        *[phase_header(p) for p in PHASES],
        "drift",
        title="median / p90 seconds per phase (cold jobs excluded)",
    )
    for s in summaries:
        cells = [
            f"{s.phases[p].median:.3f} / {s.phases[p].p90:.3f}" if s.phases else "-" for p in PHASES
        ]
        drift = f"{(s.drift - 1) * 100:+.0f} %" if s.drift is not None else "-"
        table.add_row(s.model, str(s.jobs), str(s.cold), str(s.failed), *cells, drift)
    return table


def write_csv(records: list[TimingRecord], path: Path) -> None:
    fields = [
        "job_id",
        "model",
        "status",
        "cold",
        "width",
        "height",
        "steps",
        "num_images",
        "rung",
        "dtype",
        "compiled",
        "compile_s",
        "compile_source",
        "per_step_s",
        "peak_memory_bytes",
        "finished_at",
        *PHASES,
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv_module.writer(handle)
        writer.writerow(fields)
        for r in records:
            row = [getattr(r, f) for f in fields[: -len(PHASES)]]
            writer.writerow(row + [f"{getattr(r.timings, p):.6f}" for p in PHASES])


def write_chart(summaries: list[ModelSummary], path: Path) -> None:
    """Stacked bars of median phase seconds per model (queue wait and total left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in summaries if s.phases]
    stacked = [p for p in PHASES if p not in ("queue_wait", "total")]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(shown) + 2), 4.5))
    bottoms = [0.0] * len(shown)
    for phase in stacked:
        heights = [s.phases[phase].median for s in shown]
        ax.bar([s.model for s in shown], heights, bottom=bottoms, label=phase)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_ylabel("median seconds per job (warm)")
    ax.set_title("kiln: where a job's time goes")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


NOISE = "noise, more steps or repeats needed"


def fit_note(fit: tuple[float, float]) -> str | None:
    """Why a least-squares line seconds = fixed + steps x per_step is no measurement: a negative
    slope or intercept comes from noise (too few points, steps too close), not from the card."""
    fixed, per_step = fit
    if per_step < 0:
        return f"per-step fit negative: {NOISE}"
    if fixed < 0:
        return f"fixed part negative: {NOISE}"
    return None


@dataclass(frozen=True)
class BenchPoint:
    """One bar of the bench chart: a (model, size, steps, settings) point's warm medians."""

    model: str
    label: str  # the rest of the point: "128x128, 8 steps" and its settings when not defaults
    phases: dict[str, float]  # median seconds per phase, total included


@dataclass(frozen=True)
class BenchLine:
    """Warm totals of one model, size and settings against steps, and their fit if any."""

    label: str
    samples: list[tuple[int, float]]  # (steps, total seconds)
    fit: tuple[float, float] | None  # (fixed, per_step); None with one step count

    @property
    def note(self) -> str:
        if self.fit is None:
            steps = sorted({s for s, _ in self.samples})
            return f"one step count ({', '.join(map(str, steps)) or 'none warm'}): no fit"
        return fit_note(self.fit) or f"{self.fit[0]:.3f} s + {self.fit[1]:.4f} s/step"


def write_bench_chart(points: list[BenchPoint], lines: list[BenchLine], path: Path) -> list[str]:
    """Above, stacked median phases with one bar per point, grouped by model (a gap and the
    model's name over each group); below, warm totals against steps per line with the fitted
    line, a fit that is noise drawn as crosses only and labelled so. Returns the legend of the
    lower panel, one entry a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stacked = [
        phase
        for phase in PHASES
        if phase not in ("queue_wait", "total") and any(p.phases.get(phase) for p in points)
    ]
    order = list(dict.fromkeys(p.model for p in points))  # models in the order they ran
    points = sorted(points, key=lambda p: order.index(p.model))  # each model's bars together
    xs: list[float] = []
    groups: dict[str, list[float]] = {}
    x = 0.0
    for point in points:
        if xs and point.model not in groups:
            x += 0.8
        xs.append(x)
        groups.setdefault(point.model, []).append(x)
        x += 1.0
    fig, (bars, fits) = plt.subplots(
        2, 1, figsize=(max(7.0, 0.55 * len(points) + 3), 10), height_ratios=[3, 2]
    )
    bottoms = [0.0] * len(points)
    for phase in stacked:
        heights = [p.phases.get(phase, 0.0) for p in points]
        bars.bar(xs, heights, bottom=bottoms, width=0.8, label=phase)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, point, top in zip(xs, points, bottoms, strict=True):
        bars.text(
            x, top, f"{point.phases.get('total', 0.0):.2f}", ha="center", va="bottom", fontsize=7
        )
    bars.set_xticks(xs, [p.label for p in points], rotation=40, ha="right", fontsize=8)
    for model, spots in groups.items():
        bars.text(
            sum(spots) / len(spots),
            1.01,
            model,
            transform=bars.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=9,
            fontweight="bold",
        )
    for before, after in zip(list(groups.values()), list(groups.values())[1:], strict=False):
        bars.axvline((before[-1] + after[0]) / 2, color="0.8", linewidth=0.8)
    bars.set_ylabel("median seconds per job, warm (label: total)")
    bars.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    legend = []
    values = [t for line in lines for _, t in line.samples]
    for index, line in enumerate(lines):
        color = f"C{index % 10}"
        noise = line.fit is not None and fit_note(line.fit) is not None
        label = f"{line.label}: {line.note}"
        steps, totals = zip(*line.samples, strict=True)
        fits.scatter(
            steps, totals, color=color, s=14, alpha=0.7, marker="x" if noise else "o", label=label
        )
        if line.fit is not None and not noise:
            ends = [min(steps), max(steps)]
            fits.plot(ends, [line.fit[0] + s * line.fit[1] for s in ends], color=color)
        legend.append(label)
    if values and max(values) > 20 * max(min(values), 1e-6):
        fits.set_yscale("log")  # an outlier would flatten every other line
    fits.set_xlabel("steps")
    fits.set_ylabel("warm total seconds per job")
    fits.set_title("seconds = fixed + steps x per_step, per model, size and settings", fontsize=10)
    if lines:
        fits.legend(fontsize="x-small")
    fig.suptitle("kiln bench: where a job's time goes, per point")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return legend


def run_report(
    log: Path, csv: Path | None = None, chart: Path | None = None, last: int | None = None
) -> int:
    console = wide_console()
    if not log.is_file():
        console.print(f"kiln timings: no timings log at {log}")
        return 1
    records = list(read_records(log))
    if not records:
        console.print(f"kiln timings: {log} holds no timing records")
        return 1
    if last:
        console.print(
            phase_table(records[-last:], title=f"last {min(last, len(records))} jobs (seconds)")
        )
    summaries = summarize(records)
    console.print(summary_table(summaries))
    if csv:
        write_csv(records, csv)
        console.print(f"CSV: {csv}")
    if chart:
        write_chart(summaries, chart)
        console.print(f"chart: {chart}")
    return 0
