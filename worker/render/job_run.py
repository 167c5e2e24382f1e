"""One job's run as the renderer hands it down: built once in Renderer.render when the job's
request is validated and its inputs read, then passed whole to planning, the load, each
attempt, generation and saving, instead of the same five values at every call."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from api_client.manifest import Manifest
from api_client.schema import RenderRequest
from worker.memory.ladder import Ladder, RungChoice
from worker.pipelines.step_cache import StepCacheDecision
from worker.render.context import JobContext
from worker.render.inputs import JobInputs
from worker.render.timings import Stopwatch, TimingRecord


@dataclass(frozen=True)
class RungPlan:
    """A diffusion job's plan (step 5): its rung, the ladder that tries it, its step cache."""

    choice: RungChoice  # the rung planned and why (a reload is told its lower rung)
    ladder: Ladder
    step_cache: StepCacheDecision  # whether its denoise reuses steps, and why


@dataclass
class JobRun:
    """One job from its validated request to its record."""

    ctx: JobContext  # whoever runs it: progress, stop requests, the lease
    request: RenderRequest  # resolved against its manifest
    manifest: Manifest
    inputs: JobInputs  # img2img's, inpaint's, edit's, the controls' and the reference's images
    watch: Stopwatch  # its phases' time
    record: TimingRecord  # its one account, filled in as it runs
    started_at: datetime
    digest: str  # request_digest(request): what its result.json is matched by after a crash
    planned: RungPlan | None = None  # a diffusion job's, once step 5 has chosen (Renderer._plan)

    @property
    def plan(self) -> RungPlan:
        """The rung plan; only a diffusion job past step 5 has one."""
        if self.planned is None:
            raise RuntimeError(f"job {self.ctx.job_id}: no rung planned (step 5 has not run)")
        return self.planned

    @property
    def pin(self) -> bool | None:
        """The request's compile pin (a replay's); None: this worker's compile policy."""
        return self.request.compile
