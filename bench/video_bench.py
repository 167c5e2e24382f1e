"""Issue 41's video measurements on this machine: tiny-wan's and tiny-ltx's phase timings per
frame count, the video encode's share of a job per container, and the peak's growth with frames.

    .venv/bin/python bench/video_bench.py                       # 9, 17, 33 frames, 3 passes
    .venv/bin/python bench/video_bench.py --frames 9,17 --passes 2 --json out.json

Each (model, frames) cell runs in a fresh process (this script again, with --cell) through
kiln's own Renderer at 64x64 and 4 steps: one cold job (the load; left out), then `repeats`
rounds of one warm job per format (mp4, webm, animated webp). That is done `passes` times, every
cell once a pass, the order reversed each pass, so a burst of load from elsewhere on a shared
machine falls on every frame count alike rather than on the cell that ran then. Phases are
medians over a cell's warm jobs of all passes; the encode's share is video_encode / total per
format. A fresh process per cell because on a CPU the record's peak_memory_bytes is the
process's resident-set high-water mark (worker.memory.device.peak_bytes: VmHWM, reset through
/proc/self/clear_refs when the job's text encode starts, read after its decode): heap a larger
job freed but the allocator kept would lift a smaller job's peak in the same process. That peak
is the whole process (torch, the loaded pipeline, Python), not the job's own tensors; its slope
over frames is the job's growth.

The fits are `kiln bench`'s least squares (worker.render.timings.linear_fit; a negative slope
or intercept called noise, as worker.ops.report.fit_note calls one over steps): peak_bytes =
a + b * frames and total_s = a + b * frames over every warm job. Prints markdown tables for
bench/RESULTS.md and, with --json, writes the raw cells.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from worker.render.timings import linear_fit  # noqa: E402

FORMATS = ("mp4", "webm", "webp")
# The phases a video job spends its time in (queue_wait, load, upscale and image_encode are 0
# for a warm job on one renderer).
PHASES = ("text_encode", "denoise", "decode", "video_encode", "save", "total")
SIZE = 64
MB = 1e6


@dataclass
class Job:
    """What one warm job's record says: its format, phase seconds and peak."""

    fmt: str
    seconds: dict[str, float]
    per_step_s: float
    peak_bytes: int | None


@dataclass
class Cell:
    """One (model, frames) point: its cold job's total and its warm jobs."""

    model: str
    frames: int
    cold_s: list[float] = field(default_factory=list)  # each pass's cold job's total
    jobs: list[Job] = field(default_factory=list)

    def median(self, phase: str, fmt: str | None = None) -> float:
        values = [j.seconds[phase] for j in self.jobs if fmt is None or j.fmt == fmt]
        return statistics.median(values)

    def share(self, fmt: str) -> float:
        """The encode's median share of a job in this container: video_encode / total."""
        return statistics.median(
            j.seconds["video_encode"] / j.seconds["total"] for j in self.jobs if j.fmt == fmt
        )

    def peak(self) -> int | None:
        peaks = [j.peak_bytes for j in self.jobs if j.peak_bytes is not None]
        return int(statistics.median(peaks)) if peaks else None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cell:
        model, frames = args.cell.split(":")
        cell = run_cell(model, int(frames), args.repeats, args.steps, args.models_dir)
        args.json.write_text(json.dumps(asdict(cell)) + "\n")
        return 0
    # 1. The tiny models, built once (seconds), so no cell's cold job includes a build.
    from worker.pipelines.tiny import build_tiny_models

    models = args.models.split(",")
    build_tiny_models(args.models_dir, [m.removeprefix("tiny-") for m in models])
    # 2. Every cell in its own process once a pass, the order reversed each pass.
    load_before, started = os.getloadavg()[0], time.perf_counter()
    frames = sorted(int(f) for f in args.frames.split(","))
    cells = {(model, n): Cell(model, n) for model in models for n in frames}
    order = list(cells)
    for number in range(args.passes):
        for key in order if number % 2 == 0 else order[::-1]:
            ran = _spawn(*key, args)
            cells[key].cold_s += ran.cold_s
            cells[key].jobs += ran.jobs
    took, load_after = time.perf_counter() - started, os.getloadavg()[0]
    # 3. The tables, and the raw cells if asked.
    print(report(list(cells.values()), args.steps, args.repeats * args.passes))
    print(
        f"\n{len(cells)} cells in {took:.0f} s; load average {load_before:.2f} before, "
        f"{load_after:.2f} after"
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(c) for c in cells.values()], indent=2) + "\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    from worker.settings import Settings

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="tiny-wan,tiny-ltx", help="tiny video models")
    parser.add_argument("--frames", default="9,17,33", help="frame counts (each family's rule)")
    parser.add_argument("--passes", type=int, default=3, help="fresh processes a cell")
    parser.add_argument("--repeats", type=int, default=1, help="warm rounds of every format a pass")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps a job")
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=Settings().models_dir,
        help="where the tiny models are (built if missing); default KILN_MODELS_DIR's",
    )
    parser.add_argument("--json", type=Path, help="write the cells here as JSON")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # MODEL:FRAMES, in a child process
    return parser


def _spawn(model: str, frames: int, args: argparse.Namespace) -> Cell:
    """One cell in a fresh process; its cells come back as JSON through a file."""
    with tempfile.TemporaryDirectory(prefix="kiln-video-bench-") as tmp:
        out = Path(tmp) / "cell.json"
        command = [
            sys.executable,
            __file__,
            *("--cell", f"{model}:{frames}", "--json", str(out)),
            *("--repeats", str(args.repeats), "--steps", str(args.steps)),
            *("--models-dir", str(args.models_dir)),
        ]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"cell {model}:{frames} failed:\n{done.stderr[-3000:]}")
        raw = json.loads(out.read_text())
    print(f"  {model} {frames} frames: {len(raw['jobs'])} warm jobs", file=sys.stderr)
    return Cell(raw["model"], raw["frames"], raw["cold_s"], [Job(**j) for j in raw["jobs"]])


def run_cell(model: str, frames: int, repeats: int, steps: int, models_dir: Path) -> Cell:
    """In this process: one cold job, then repeats rounds of a warm job in every format."""
    from worker.logs import quiet_libraries

    quiet_libraries()  # before torch and diffusers are imported
    from worker.manifest import load_manifests
    from worker.render.context import LocalContext
    from worker.render.renderer import Renderer
    from worker.render.timings import TimingRecord
    from worker.settings import Settings

    records: list[TimingRecord] = []
    cell = Cell(model, frames)
    with tempfile.TemporaryDirectory(prefix="kiln-video-bench-out-") as out:
        settings = Settings(
            models_dir=models_dir,
            output_dir=Path(out),
            timings_log=Path(out) / "timings.jsonl",
        )
        renderer = Renderer(
            settings, load_manifests(settings.manifests, [model]), on_record=records.append
        )
        rounds = [("mp4", "cold")] + [(fmt, "warm") for _ in range(repeats) for fmt in FORMATS]
        for index, (fmt, kind) in enumerate(rounds):
            request = {
                "model": model,
                "prompt": "a paper lantern drifting over a river at night",
                "seed": index,
                "steps": steps,
                "width": SIZE,
                "height": SIZE,
                "frames": frames,
                "output_format": fmt,
            }
            result = renderer.render(request, LocalContext(f"video-bench-{index}"))
            if [video.frames for video in result.videos] != [frames]:
                raise RuntimeError(f"{model}: asked for {frames} frames, got {result.videos}")
            record = records[-1]
            if kind == "cold":
                cell.cold_s.append(record.timings.total)
                continue
            timings = record.timings.model_dump()
            cell.jobs.append(
                Job(
                    fmt,
                    {phase: timings[phase] for phase in PHASES},
                    record.per_step_s or 0.0,
                    record.peak_memory_bytes,
                )
            )
    return cell


def fit(points: list[tuple[int, float]]) -> tuple[tuple[float, float] | None, str]:
    """kiln bench's least-squares line y = a + b * frames, and what to say of it: "" for a line
    to read, else why it is none (one frame count) or noise (a negative slope or intercept: the
    spread between jobs is larger than what the frames add)."""
    line = linear_fit(points)
    if line is None:
        return None, "one frame count: no fit"
    if line[1] < 0:
        return line, f"slope negative ({line[1]:.4g} a frame): noise, not a measurement"
    if line[0] < 0:
        return line, f"intercept negative ({line[0]:.4g}): noise, not a measurement"
    return line, ""


def report(cells: list[Cell], steps: int, repeats: int) -> str:
    """Markdown: phases per cell, the encode's share per format, and the two fits per model."""
    lines = [
        f"Phase medians (s) at {SIZE}x{SIZE}, {steps} steps, {repeats} warm rounds x "
        f"{len(FORMATS)} formats a cell (fastest: the least contended warm job; cold job: the"
        " median of its passes' first jobs):",
        "",
        "| model | frames | text_encode | denoise | per step | decode | video_encode | total |"
        " fastest total | peak MB | cold job |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        peak = c.peak()
        per_step = statistics.median(j.per_step_s for j in c.jobs)
        phases = " | ".join(f"{c.median(p):.3f}" for p in ("text_encode", "denoise"))
        lines.append(
            f"| {c.model} | {c.frames} | {phases} | {per_step:.3f} | {c.median('decode'):.3f} | "
            f"{c.median('video_encode'):.3f} | {c.median('total'):.3f} | "
            f"{min(j.seconds['total'] for j in c.jobs):.3f} | "
            f"{'-' if peak is None else f'{peak / MB:.0f}'} | {statistics.median(c.cold_s):.1f} |"
        )
    lines += [
        "",
        "The encode's share of a job (median video_encode / total, with the median encode s):",
        "",
        "| model | frames | " + " | ".join(FORMATS) + " |",
        "|---|---|" + "---|" * len(FORMATS),
    ]
    for c in cells:
        shares = " | ".join(
            f"{c.share(fmt):.1%} ({c.median('video_encode', fmt):.3f} s)" for fmt in FORMATS
        )
        lines.append(f"| {c.model} | {c.frames} | {shares} |")
    lines += ["", "Least-squares fits over every warm job (`kiln bench`'s linear_fit):", ""]
    for model in dict.fromkeys(c.model for c in cells):
        lines += _fit_lines(model, [c for c in cells if c.model == model])
    return "\n".join(lines)


def _fit_lines(model: str, cells: list[Cell]) -> list[str]:
    peaks = [(c.frames, j.peak_bytes / MB) for c in cells for j in c.jobs if j.peak_bytes]
    totals = [(c.frames, j.seconds["total"]) for c in cells for j in c.jobs]
    out = []
    for what, unit, points in (("peak", "MB", peaks), ("total", "s", totals)):
        line, note = fit(points)
        if line is None:
            out.append(f"- {model} {what}: {note if points else 'none recorded'}")
            continue
        said = f"{what} = {line[0]:.3f} {unit} + {line[1]:.4f} {unit} x frames ({len(points)} jobs)"
        out.append(f"- {model} {said}" + (f": {note}" if note else ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
