"""`kiln timings`: per-model phase medians and p90 from the timings log, drift, CSV and a chart."""

from __future__ import annotations

import csv as csv_module
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from api_client.schema import PHASES
from worker.display import phase_header, phase_table, wide_console
from worker.timings import TimingRecord, read_records


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
