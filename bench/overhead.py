"""kiln's own overhead, measured side by side in one run on the same model, request and seeds:

  bare    diffusers' own pipeline, from_pretrained and called in a loop, saving a PNG: the
          limit (not kiln's load: that one carries the manifest's LoRA slots, whose cost on a
          job that names no adapter is part of what is measured)
  engine  kiln's Renderer called directly (no queue)
  queue   submit() -> Redis -> `kiln worker` -> wait(), one job in flight
  naive   a fresh process per job that imports, loads and renders (what kiln exists to avoid)
  forking RQ's default forking Worker running the same render (reloads in every child)

bare, engine and queue take turns in blocks of --block jobs (5; 1 alternates every job, the
finest comparison), so drift hits all three alike.
The last line is machine-readable:
  queue_vs_bare=<x> engine_vs_bare=<x> naive_vs_queue=<x> redis_cmds_per_job=<n>
  redis_cmds_per_s_rendering=<n>
with Redis commands counted by INFO commandstats around the measured queue jobs (everything
the client and the worker sent, the worker's heartbeat thread included). The last number comes
from one job of --long-s seconds (40 steps paced by tests/fixtures/kiln_worker.py, the client
waiting on its events): its commands beyond the short jobs' fixed cost, per second rendered.

    python bench/overhead.py [--steps 8] [--jobs 20] [--block 5] [--naive-jobs 3] [--long-s 20]
                             [--json F]
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "tiny-sd15"
BLOCK = 5
LONG_STEPS = 40
PROMPT = "a lighthouse on a cliff at dusk"


def request(steps: int, size: int, seed: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "steps": steps,
        "width": size,
        "height": size,
        "seed": seed,
    }


def plain_pipeline(models_dir: str) -> Any:
    """The model as diffusers alone loads it: no LoRA slots, no kiln switches."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(
        str(Path(models_dir) / MODEL), safety_checker=None, requires_safety_checker=False
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def naive_job(models_dir: str, out_dir: str, steps: int, size: int, seed: int) -> str:
    """Import, load and render in this process, as a script without a resident worker would.
    Also the function RQ's forking worker runs (by import path, pickled arguments)."""
    import torch

    pipe = plain_pipeline(models_dir)
    image = pipe(
        PROMPT,
        num_inference_steps=steps,
        width=size,
        height=size,
        generator=torch.Generator("cpu").manual_seed(seed),
    ).images[0]
    path = Path(out_dir) / f"naive-{seed}-{time.time_ns()}.png"
    image.save(path, compress_level=4)
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--jobs", type=int, default=20, help="measured jobs per fast mode")
    parser.add_argument("--block", type=int, default=BLOCK, help="jobs per mode per turn")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--naive-jobs", type=int, default=3, help="jobs for naive and forking")
    parser.add_argument("--json", type=Path, help="write the measurements here too")
    parser.add_argument("--long-s", type=float, default=20.0, help="the long job's length")
    parser.add_argument(
        "--naive-one", nargs=3, metavar=("MODELS", "OUT", "SEED"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.naive_one:
        models, out, seed = args.naive_one
        naive_job(models, out, args.steps, args.size, int(seed))
        return 0
    work = Path(tempfile.mkdtemp(prefix="kiln-overhead-"))
    return run(args, work)


def run(args: argparse.Namespace, work: Path) -> int:
    from redis import Redis

    from bench.harness import MODELS_DIR, private_redis, running_worker
    from worker import logs

    logs.configure("json", quiet=True)  # the engine's records go to its log file, not stdout
    with private_redis(work) as url, running_worker(work, MODEL, url) as env:
        os.environ.update({k: v for k, v in env.items() if k.startswith("KILN_")})
        times = measure_fast(args, Redis.from_url(url), MODELS_DIR, work)
        times["naive"] = measure_naive(args, MODELS_DIR, work)
        times["forking"] = measure_forking(args, url, MODELS_DIR, work)
    pace = {"KILN_TEST_PACE_S": str(args.long_s / LONG_STEPS)}
    (work / "long").mkdir()
    with (
        private_redis(work / "long") as url,
        running_worker(work / "long", MODEL, url, "tests.fixtures.kiln_worker", pace),
    ):
        times.update(measure_long(args, Redis.from_url(url)))
    report(args, times)
    return 0


def measure_fast(
    args: argparse.Namespace, conn: Any, models_dir: Path, work: Path
) -> dict[str, Any]:
    """bare, engine and queue in turns, same request and seed in each round."""
    import torch

    from api_client import KilnClient
    from worker.manifest import load_manifests
    from worker.render.context import LocalContext
    from worker.render.renderer import Renderer
    from worker.settings import Settings

    settings = Settings(output_dir=work / "engine", timings_log=work / "engine" / "timings.jsonl")
    manifests = load_manifests(settings.manifests, [MODEL])
    renderer = Renderer(settings, manifests)
    bare_pipe = plain_pipeline(str(models_dir))
    client = KilnClient(connection=conn, manifests_dir=settings.manifests)
    (work / "bare").mkdir(exist_ok=True)

    @torch.inference_mode()  # as kiln's generate() runs it: the limit, not a slower baseline
    def bare(seed: int) -> None:
        image = bare_pipe(
            PROMPT,
            num_inference_steps=args.steps,
            width=args.size,
            height=args.size,
            generator=torch.Generator("cpu").manual_seed(seed),
        ).images[0]
        image.save(work / "bare" / f"{seed}.png", compress_level=4)

    def engine(seed: int) -> None:
        renderer.render(request(args.steps, args.size, seed), LocalContext(f"e-{time.time_ns()}"))

    def queue(seed: int) -> None:
        client.submit(request(args.steps, args.size, seed)).wait(timeout=120)

    modes = {"bare": bare, "engine": engine, "queue": queue}
    for seed in range(args.warmup):
        for fn in modes.values():
            fn(seed)
    # Modes take turns in blocks of --block jobs: drift on a shared machine hits all alike, and a
    # mode is not measured in the few ms after another process's torch threads stopped spinning.
    times: dict[str, Any] = {name: [] for name in modes}
    for first in range(0, args.jobs, args.block):
        for name, fn in modes.items():
            for seed in range(first, min(first + args.block, args.jobs)):
                start = time.perf_counter()
                fn(seed)
                times[name].append(time.perf_counter() - start)
    # Redis commands a job costs, counted around queue jobs run back to back (the client's and
    # the worker's, its heartbeat thread included), by command.
    before = _commands(conn)
    for seed in range(args.jobs):
        queue(seed)
    after = _commands(conn)
    per_command = {k: (after[k] - before.get(k, 0)) / args.jobs for k in after}
    times["redis_by_command"] = {k: v for k, v in sorted(per_command.items()) if v}
    times["redis_cmds"] = sum(per_command.values())
    return times


def measure_long(args: argparse.Namespace, conn: Any) -> dict[str, Any]:
    """One job of about --long-s seconds, waited on by its client: commands and seconds."""
    from api_client import KilnClient

    client = KilnClient(connection=conn)
    client.submit(request(2, args.size, 0)).wait(timeout=300)  # loaded and warm
    before = _commands(conn)
    result = client.submit(request(LONG_STEPS, args.size, 1)).wait(timeout=args.long_s * 5)
    after = _commands(conn)
    return {
        "long_s": result.timings.total,
        "long_cmds": sum(after.values()) - sum(before.values()),
    }


def _commands(conn: Any) -> dict[str, int]:
    stats = conn.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items() if k != "cmdstat_info"}


def measure_naive(args: argparse.Namespace, models_dir: Path, work: Path) -> list[float]:
    out = work / "naive"
    out.mkdir(exist_ok=True)
    times = []
    for seed in range(args.naive_jobs):
        argv = [sys.executable, __file__, "--naive-one", str(models_dir), str(out), str(seed)]
        argv += ["--steps", str(args.steps), "--size", str(args.size)]
        start = time.perf_counter()
        subprocess.run(argv, check=True, cwd=ROOT, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def measure_forking(
    args: argparse.Namespace, url: str, models_dir: Path, work: Path
) -> list[float]:
    """RQ's default Worker (fork per job, pickle) on its own queue, one job in flight."""
    from redis import Redis
    from rq import Queue

    out = work / "forking"
    out.mkdir(exist_ok=True)
    conn = Redis.from_url(url)
    queue = Queue("overhead-forking", connection=conn)
    code = (
        "import sys; from redis import Redis; from rq import Queue, Worker\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        f"c = Redis.from_url({url!r}); Worker([Queue('overhead-forking', connection=c)],"
        " connection=c).work()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    times = []
    try:
        for seed in range(args.naive_jobs):
            start = time.perf_counter()
            job = queue.enqueue(
                "bench.overhead.naive_job",
                str(models_dir),
                str(out),
                args.steps,
                args.size,
                seed,
                job_timeout=600,
            )
            while job.get_status(refresh=True) not in ("finished", "failed"):
                time.sleep(0.05)
            if job.get_status() == "failed":
                raise RuntimeError(f"forking worker job failed: {job.latest_result()}")
            times.append(time.perf_counter() - start)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return times


def report(args: argparse.Namespace, times: dict[str, Any]) -> None:
    def med(name: str) -> float:
        return statistics.median(times[name])

    def p90(name: str) -> float:
        ordered = sorted(times[name])
        return ordered[min(int(0.9 * len(ordered)), len(ordered) - 1)]

    print(f"{MODEL}, {args.size}x{args.size}, {args.steps} steps, one job in flight")
    print(f"{'mode':<8} {'jobs':>5} {'median s':>10} {'p90 s':>10} {'vs bare':>8}")
    for name in ("bare", "engine", "queue", "naive", "forking"):
        print(
            f"{name:<8} {len(times[name]):>5} {med(name):>10.4f} {p90(name):>10.4f}"
            f" {med(name) / med('bare'):>8.3f}"
        )
    by_command = ", ".join(f"{k} {v:.1f}" for k, v in times["redis_by_command"].items())
    print(f"redis commands per job: {by_command}")
    print(f"a {times['long_s']:.1f} s job: {times['long_cmds']} Redis commands in all")
    summary = {
        "queue_vs_bare": med("queue") / med("bare"),
        "engine_vs_bare": med("engine") / med("bare"),
        "naive_vs_queue": med("naive") / med("queue"),
        "redis_cmds_per_job": times["redis_cmds"],
        "redis_cmds_per_s_rendering": (times["long_cmds"] - times["redis_cmds"]) / times["long_s"],
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "times": times, "summary": summary},
                indent=2,
            )
        )
    print(
        f"queue_vs_bare={summary['queue_vs_bare']:.3f}"
        f" engine_vs_bare={summary['engine_vs_bare']:.3f}"
        f" naive_vs_queue={summary['naive_vs_queue']:.1f}"
        f" redis_cmds_per_job={summary['redis_cmds_per_job']:.1f}"
        f" redis_cmds_per_s_rendering={summary['redis_cmds_per_s_rendering']:.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
