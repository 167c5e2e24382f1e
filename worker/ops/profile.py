"""`kiln profile`: one render under torch.profiler after warm-up, as a table and a chrome trace.

Profiler wall time is perturbed attribution evidence, not a benchmark: use `kiln bench` for
headline numbers and this to see which operators a hot phase spends its time in.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch

from worker.manifest import load_manifests
from worker.render.context import LocalContext
from worker.render.renderer import Renderer
from worker.render.timings import TimingRecord
from worker.settings import Settings


def run_profile(
    settings: Settings, request: dict[str, Any], trace: Path | None, warmup: int = 1, rows: int = 25
) -> int:
    from worker.ops.display import phase_table, wide_console

    console = wide_console()
    finished: list[TimingRecord] = []
    manifests = load_manifests(settings.manifests, [request["model"]])
    renderer = Renderer(settings, manifests, on_record=finished.append)
    renderer.validate(request)  # a bad request is refused before anything loads
    # 1. Warm-up outside the profiler: load, compile and cache fill are not steady state.
    for _ in range(warmup):
        renderer.render(request, LocalContext(f"profile-warmup-{uuid.uuid4().hex[:8]}"))
    # 2. One profiled render, phases labelled with record_function.
    activities = [torch.profiler.ProfilerActivity.CPU]
    if renderer.info.torch_device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    renderer.profiling = True
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        renderer.render(request, LocalContext(f"profile-{uuid.uuid4().hex[:8]}"))
    renderer.profiling = False
    # 3. Report: the operators, then the (perturbed) phase timings of that run.
    sort_by = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    console.print(prof.key_averages().table(sort_by=sort_by, row_limit=rows))
    phases = [e for e in prof.key_averages() if e.key.startswith("kiln.")]
    for event in sorted(phases, key=lambda e: -e.cpu_time_total):
        console.print(f"{event.key:<20} {event.cpu_time_total / 1e6:8.3f} s host")
    console.print(phase_table(finished[-1:], title="profiled run (perturbed by the profiler)"))
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        console.print(f"chrome trace: {trace} (open in chrome://tracing or ui.perfetto.dev)")
    return 0
