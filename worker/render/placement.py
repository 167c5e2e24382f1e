"""Where a job runs: the Planner a Renderer owns. It knows the memory kiln may plan with, picks
each job's rung (the request's pin, else the ladder's choice from declared or measured needs),
keeps what each job teaches (its peaks, worker.memory.peaks; the rung an out of memory pushed a
size down to), and makes room for a load by eviction."""

from __future__ import annotations

import dataclasses
import functools
import logging

from redis import Redis

from api_client.connection import connect
from api_client.manifest import Manifest
from api_client.resolve import hires_size
from api_client.schema import Attempt, RenderRequest, Rung
from worker.errors import PinRefused
from worker.memory import device as dev
from worker.memory.device import DeviceInfo
from worker.memory.ladder import (
    GB,
    Fit,
    RungChoice,
    RungMemory,
    Size,
    choose_rung,
    pick_rung,
    rung_need_gb,
    usable_gb,
)
from worker.memory.peaks import Peak, PeakBook, Shape, card_kind, lowest_need_gb
from worker.pipelines import control, reference, step_cache
from worker.pipelines.loading import choose_dtype, fit_for
from worker.pipelines.release import release_memory
from worker.pipelines.resident import DTYPE_NAMES, LoadedPipeline, PipelineCache
from worker.pipelines.switches import compile_plan
from worker.settings import Settings

log = logging.getLogger(__name__)


class Planner:
    """A renderer's memory and rung decisions, over the pipelines its cache holds.

    manifests is the renderer's own mapping (the served models); rungs remembers the rung an out
    of memory pushed each size down to; peaks is this card kind's measurements, read from the
    worker's Redis at the first job that plans a rung unless a book is handed in."""

    def __init__(
        self,
        settings: Settings,
        manifests: dict[str, Manifest],
        info: DeviceInfo,
        cache: PipelineCache,
        rungs: RungMemory,
        peaks: PeakBook | None = None,
    ) -> None:
        self.settings = settings
        self.manifests = manifests
        self.info = info
        self.cache = cache
        self.rungs = rungs
        if peaks is not None:
            self.peaks = peaks

    def usable_gb(self, exclude: str | None = None, reclaim: bool = True) -> float:
        """Free memory now plus (reclaim) what evicting the other resident pipelines would free."""
        free = dev.free_bytes(self.info)
        if self.info.simulated is not None:  # a profile's free memory is before kiln loaded
            free = max(free - self.cache.resident_bytes(), 0)
        return usable_gb(
            free_bytes=free,
            reclaimable_bytes=self.cache.resident_bytes(exclude=exclude) if reclaim else 0,
            reserve_gb=self.settings.vram_reserve_gb,
            budget_gb=self.settings.vram_budget_gb,
            in_use_bytes=self.cache.resident_bytes(),
        )

    # -- the rung step ------------------------------------------------------------------------

    def choose_rung(self, manifest: Manifest, request: RenderRequest) -> RungChoice:
        """The request's pinned rung, else the worker's choice; a compile pin that rung cannot
        honour fails here, before anything is loaded or evicted."""
        choice = self._pinned_rung(manifest, request.rung) if request.rung else None
        choice = choice or self._worker_rung(manifest, request)
        compile_plan(manifest, choice.rung, self.info, self.settings, request.compile)
        return choice

    def _pinned_rung(self, manifest: Manifest, rung: Rung) -> RungChoice:
        mode = self.settings.memory_mode
        if mode not in ("auto", rung):
            raise PinRefused(
                f"model {manifest.id}: the request pins rung {rung}, but this worker is pinned"
                f" to {mode} (KILN_MEMORY_MODE={mode})"
            )
        return RungChoice(rung, f"pinned by the request (rung={rung})")

    def _worker_rung(self, manifest: Manifest, request: RenderRequest) -> RungChoice:
        fit = self.fit(manifest, request)
        # What this card kind measured for the job's shape replaces the manifest's figures.
        fit = dataclasses.replace(fit, measured=self.peaks.needs_gb(self._shape(request, fit)))
        if self.settings.memory_mode != "auto":
            return pick_rung(
                manifest, self.usable_gb(exclude=manifest.id), self.settings.memory_mode, fit
            )
        # Counting this model's own resident bytes as reclaimable: what it could have reloaded.
        room = self.usable_gb()
        # On a plain CPU the rungs save no memory and host memory drifts: no reason to forget.
        grown = room if self.info.accelerator else None
        ceiling = self.rungs.get(manifest.id, job_size(request), usable_gb=grown)
        ceilings = self.rungs.ceilings(manifest.id)
        choice = choose_rung(manifest, self.cache.get(manifest.id), ceiling, ceilings, room, fit)
        return dataclasses.replace(
            choice, measured=choice.rung in fit.measured, full_need_gb=fit.measured.get("full")
        )

    def serves(self, resident: LoadedPipeline, rung: Rung, pin: bool | None) -> bool:
        """Whether the resident pipeline renders this job as asked. Compile state is part of it,
        since it changes pixels: a pinned job takes a pipeline in its pinned state, and a job
        without a pin one in the state this worker's policy loads, so a pipeline a replay
        loaded eager does not stay eager for the jobs after it. Otherwise: reload."""
        if resident.rung != rung:
            return False
        if pin is not None:
            return resident.compiled == pin
        if resident.compile_pin is None:
            return True
        policy = compile_plan(resident.manifest, rung, self.info, self.settings)
        return resident.compiled == policy.compile

    def cannot_fit(self) -> str | None:
        """Why this worker must take no job now: every served model's measured need at the
        lowest rung is above the memory it could have (evicting everything); None otherwise,
        and while any model's need is only the manifest's estimate (that one is tried)."""
        needs = {}
        for manifest in self.manifests.values():
            if manifest.benchmark_only or manifest.family_row.tiles:
                continue  # an upscaler halves its tiles to fit: it never blocks the worker
            need = lowest_need_gb(self.peaks, manifest.id)
            if need is None:  # an estimate only: no memory probe before every dequeue
                return None
            needs[manifest.id] = need
        room = self.usable_gb()
        if not needs or min(needs.values()) <= room:
            return None
        over = "; ".join(f"{model} needs {need:.2f} GB" for model, need in needs.items())
        return f"waiting for memory: {room:.2f} GB usable, and {over} at its lowest rung"

    def fit(self, manifest: Manifest, request: RenderRequest) -> Fit:
        """How this card holds the model's weights for this job: fit_for, with the job's
        ControlNets and IP-Adapter beside the pipeline."""
        fit = fit_for(manifest, self.info, self.settings)
        beside = control.beside_gb(manifest, request) + reference.beside_gb(manifest, request)
        return dataclasses.replace(fit, beside_gb=beside)

    def _shape(self, request: RenderRequest, fit: Fit) -> Shape:
        """What a job's memory depends on besides its rung (worker.memory.peaks)."""
        manifest = self.manifests[request.model]
        return Shape(
            model=manifest.id,
            width=request.width or 0,
            height=request.height or 0,
            dtype=DTYPE_NAMES[choose_dtype(manifest, self.info)[0]],
            quantized=tuple(sorted(fit.quantized.items())),
            mode=request.mode or "txt2img",
            step_cache=step_cache.decide(manifest, self.settings, request).spec is not None,
            controls=control.sources(manifest, request),
            reference=request.reference is not None,
            hires="x".join(map(str, hires_size(request))) if request.hires else "",
            frames=request.frames or 0,
        )

    @functools.cached_property
    def peaks(self) -> PeakBook:
        """This card kind's measurements, read from Redis at the first job that plans a rung."""
        try:
            connection: Redis | None = connect(self.settings.redis_url, ride_out_restarts=True)
        except Exception as exc:  # no Redis: this process's own measurements only
            log.warning("peaks: no Redis (%s)", exc)
            connection = None
        book = PeakBook(connection, card_kind(self.info.name, self.info.simulated))
        book.read()
        return book

    # -- what a job teaches -------------------------------------------------------------------

    def remember(
        self, request: RenderRequest, choice: RungChoice, attempts: list[Attempt], rung: Rung
    ) -> None:
        """After a job's images: a rung an OOM pushed this size down to is a ceiling for the next
        jobs at it, and a floor under that rung's need for every worker on this card kind."""
        pushed_down = any(a.outcome == "oom" and a.rung != rung for a in attempts)
        if pushed_down and choice.usable_gb is not None:
            fit = fit_for(self.manifests[request.model], self.info, self.settings)
            shape = self._shape(request, fit)
            for failed in {a.rung for a in attempts if a.outcome == "oom"}:
                self.peaks.observe_oom(shape, failed, choice.usable_gb)
        self.rungs.remember(
            request.model,
            job_size(request),
            rung,
            pushed_down=pushed_down,
            usable_gb=choice.usable_gb or 0.0,
        )

    def measure(
        self, loaded: LoadedPipeline, request: RenderRequest, peak_bytes: int | None, start: int
    ) -> None:
        """After a job: its pipeline's bytes at this rung and what the job added (its peak less
        what was allocated when it started), into the book."""
        if peak_bytes is None:
            return
        weights, largest = loaded.weights_bytes
        fit = fit_for(loaded.manifest, self.info, self.settings)
        measured = Peak(
            resident_bytes=loaded.device_bytes,
            working_bytes=max(peak_bytes - start, 0),
            weights_bytes=weights,
            largest_bytes=largest,
        )
        self.peaks.observe(self._shape(request, fit), loaded.rung, measured)

    # -- room for a load ----------------------------------------------------------------------

    def make_room(self, manifest: Manifest, rung: Rung, request: RenderRequest) -> None:
        """Evict least recently used pipelines until this rung's estimate for the job fits."""
        need = int(rung_need_gb(manifest, rung, self.fit(manifest, request)) * GB)
        free_now = int(self.usable_gb(reclaim=False) * GB)
        evicted = self.cache.evict_beyond(self.settings.max_resident, keep=manifest.id)
        evicted += self.cache.evict_lru_until(need, free_now, keep=manifest.id)
        if evicted:
            log.info("evicted %s to make room for %s at %s", evicted, manifest.id, rung)

    def free(self, keep: str | None) -> None:
        """After an OOM: evict every other pipeline, collect garbage, empty the allocator cache."""
        self.cache.evict_others(keep=keep)
        release_memory(self.info)


def job_size(request: RenderRequest) -> Size:
    """What the ladder remembers a ceiling by: width, height and (a video's) frames."""
    return (request.width or 0, request.height or 0, request.frames or 0)
