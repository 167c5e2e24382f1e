"""Whole-model against regional compile (issue 16), through kiln's own renderer: for each model
and method, one fresh process with an empty Inductor cache runs a job at the manifest's first
size (the compile), one at each further size (the recompiles), then timed warm jobs.

    python bench/compile.py [--models tiny-sd15,tiny-flux] [--steps 8] [--json FILE]

Methods: eager (no compile), whole (`denoiser.compile()`), regional (`compile_repeated_blocks`,
fullgraph), and regional-dynamic (the same with `dynamic=True`, so sizes are symbolic from the
first compile instead of after the first recompile). Minutes on a CPU: each compile is real.
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

METHODS = ("eager", "whole", "regional", "regional-dynamic")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-sd15,tiny-flux")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=8, help="steps of the timed warm jobs")
    parser.add_argument("--warm-jobs", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_process(args.one[0], args.one[1], args.steps, args.warm_jobs)))
        return 0

    from worker.pipelines.tiny import build_tiny_models

    build_tiny_models(ROOT / "models")
    rows = []
    for model in args.models.split(","):
        for method in args.methods.split(","):
            rows.append(_in_fresh_process(model, method, args))
            _print_row(rows[-1])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _in_fresh_process(model: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """A new interpreter and an empty Inductor cache: every compile below is a cold one."""
    with tempfile.TemporaryDirectory(prefix="kiln-compile-bench-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "KILN_LOG_FORMAT": "json"}
        argv = [__file__, "--one", model, method, "--steps", str(args.steps)]
        argv += ["--warm-jobs", str(args.warm_jobs)]
        done = subprocess.run(
            [sys.executable, *argv], env=env, capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        return {"model": model, "method": method, "error": done.stderr.strip()[-2000:]}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def one_process(model: str, method: str, steps: int, warm_jobs: int) -> dict[str, Any]:
    """Run in the fresh process: the sizes in the manifest's order, then warm jobs at the first."""
    import logging

    from bench.harness import tiny_settings
    from worker.manifest import load_manifests
    from worker.pipelines import compile as kiln_compile
    from worker.render.context import LocalContext
    from worker.render.renderer import Renderer
    from worker.render.timings import TimingRecord

    logging.disable(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="kiln-compile-out-"))
    settings = tiny_settings(
        work,
        memory_mode="full",
        compile="off" if method == "eager" else "on",
    )
    manifest = load_manifests(settings.manifests, [model])[model]
    if method != "eager":
        compile_method = "whole" if method == "whole" else "regional"
        manifest = manifest.model_copy(update={"compile_method": compile_method})
    kiln_compile.DYNAMIC = True if method == "regional-dynamic" else None
    records: list[TimingRecord] = []
    renderer = Renderer(settings, {model: manifest}, on_record=records.append)

    def job(width: int, height: int, job_steps: int) -> tuple[float, TimingRecord]:
        payload = {"model": model, "prompt": "a lighthouse", "steps": job_steps, "seed": 3}
        payload.update(width=width, height=height)
        started = time.perf_counter()
        renderer.render(payload, LocalContext(f"bench-{time.time_ns()}"))
        return time.perf_counter() - started, records[-1]

    sizes = [tuple(size) for size in manifest.resolutions]
    first_s, first = job(*sizes[0], 2)
    later = []
    for width, height in sizes[1:]:
        seconds, record = job(width, height, 2)
        later.append(
            {"size": f"{width}x{height}", "s": round(seconds, 2), "causes": record.recompile_causes}
        )
    warm = [job(*sizes[0], steps)[1] for _ in range(warm_jobs)]
    return {
        "model": model,
        "method": method,
        "compiled": first.compiled,
        "how": next((n.reason for n in first.settings.applied if n.name == "compile"), "eager"),
        "first_job_s": round(first_s, 2),
        "first_load_s": round(first.timings.load, 2),
        "later_sizes": later,
        "graphs_after_first_job": warm[-1].recompiles,
        "steady_denoise_s": round(statistics.median(r.timings.denoise for r in warm), 4),
        "steady_step_s": round(statistics.median(r.per_step_s or 0.0 for r in warm), 4),
        "steps": steps,
    }


def _print_row(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['model']:<11} {row['method']:<17} ERROR {row['error'][-300:]}")
        return
    later = ", ".join(f"{s['size']} {s['s']:.1f} s" for s in row["later_sizes"])
    print(
        f"{row['model']:<11} {row['method']:<17} first {row['first_job_s']:>6.1f} s;"
        f" later sizes: {later}; graphs rebuilt {row['graphs_after_first_job']};"
        f" steady {row['steps']} steps {row['steady_denoise_s']:.3f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
