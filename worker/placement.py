"""Where a job runs, for Renderer: the memory kiln may plan with, the rung (the request's pin,
else the ladder's choice from declared or measured needs), the measurements each job leaves
(worker.peaks), and making room by eviction. A mixin of Renderer, whose attributes it uses."""

from __future__ import annotations

import dataclasses
import functools
import logging

from redis import Redis

from api_client.connection import connect
from api_client.manifest import Manifest
from api_client.schema import RenderRequest, Rung
from worker import device as dev
from worker.device import DeviceInfo
from worker.errors import PinRefused
from worker.ladder import (
    GB,
    Fit,
    RungChoice,
    RungMemory,
    choose_rung,
    pick_rung,
    rung_need_gb,
    usable_gb,
)
from worker.loading import choose_dtype, fit_for
from worker.peaks import Peak, PeakBook, Shape, card_kind, component_bytes, lowest_need_gb
from worker.resident import DTYPE_NAMES, LoadedPipeline, PipelineCache, release_memory
from worker.settings import Settings
from worker.switches import compile_plan
from worker.timings import Stopwatch, TimingRecord

log = logging.getLogger(__name__)


class Placement:
    """Renderer's memory and rung decisions. The attributes below are Renderer's."""

    settings: Settings
    manifests: dict[str, Manifest]
    info: DeviceInfo
    cache: PipelineCache
    rungs: RungMemory

    @functools.cached_property
    def _redis(self) -> Redis:
        """Where uploaded inputs are read from: the worker's Redis, opened at the first one."""
        return connect(self.settings.redis_url)

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

    # -- steps 3 and 4 ------------------------------------------------------------------------

    def _choose_rung(self, manifest: Manifest, request: RenderRequest) -> RungChoice:
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
        fit = fit_for(manifest, self.info, self.settings)
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
        size = (request.width or 0, request.height or 0)
        ceiling = self.rungs.get(manifest.id, *size, usable_gb=grown)
        ceilings = self.rungs.ceilings(manifest.id)
        choice = choose_rung(manifest, self.cache.get(manifest.id), ceiling, ceilings, room, fit)
        return dataclasses.replace(
            choice, measured=choice.rung in fit.measured, full_need_gb=fit.measured.get("full")
        )

    def cannot_fit(self) -> str | None:
        """Why this worker must take no job now: every served model's measured need at the
        lowest rung is above the memory it could have (evicting everything); None otherwise,
        and while any model's need is only the manifest's estimate (that one is tried)."""
        needs = {}
        for manifest in self.manifests.values():
            if manifest.benchmark_only:
                continue
            need = lowest_need_gb(self.peaks, manifest.id)
            if need is None:  # an estimate only: no memory probe before every dequeue
                return None
            needs[manifest.id] = need
        room = self.usable_gb()
        if not needs or min(needs.values()) <= room:
            return None
        over = "; ".join(f"{model} needs {need:.2f} GB" for model, need in needs.items())
        return f"waiting for memory: {room:.2f} GB usable, and {over} at its lowest rung"

    def _shape(self, request: RenderRequest, fit: Fit) -> Shape:
        """What a job's memory depends on besides its rung (worker.peaks)."""
        manifest = self.manifests[request.model]
        return Shape(
            model=manifest.id,
            width=request.width or 0,
            height=request.height or 0,
            dtype=DTYPE_NAMES[choose_dtype(manifest, self.info)[0]],
            quantized=tuple(sorted(fit.quantized.items())),
            mode=request.mode or "txt2img",
        )

    @functools.cached_property
    def peaks(self) -> PeakBook:
        """This card kind's measurements, read from Redis at the first job that plans a rung."""
        try:
            connection: Redis | None = self._redis
        except Exception as exc:  # no Redis: this process's own measurements only
            log.warning("peaks: no Redis (%s)", exc)
            connection = None
        book = PeakBook(connection, card_kind(self.info.name, self.info.simulated))
        book.read()
        return book

    def _measure_oom(self, request: RenderRequest, record: TimingRecord, usable: float) -> None:
        fit = fit_for(self.manifests[request.model], self.info, self.settings)
        shape = self._shape(request, fit)
        for rung in {a.rung for a in record.attempts if a.outcome == "oom"}:
            self.peaks.observe_oom(shape, rung, usable)

    def _measure(
        self, loaded: LoadedPipeline, request: RenderRequest, record: TimingRecord, start: int
    ) -> None:
        """After a job: its pipeline's bytes at this rung and what the job added, into the book."""
        if record.peak_memory_bytes is None:
            return
        weights, largest = component_bytes(loaded.pipe)
        fit = fit_for(loaded.manifest, self.info, self.settings)
        measured = Peak(
            resident_bytes=loaded.device_bytes,
            working_bytes=max(record.peak_memory_bytes - start, 0),
            weights_bytes=weights,
            largest_bytes=largest,
        )
        self.peaks.observe(self._shape(request, fit), loaded.rung, measured)

    def _make_room(self, manifest: Manifest, rung: Rung) -> None:
        """Evict least recently used pipelines until this rung's estimate fits."""
        need = int(rung_need_gb(manifest, rung, fit_for(manifest, self.info, self.settings)) * GB)
        free_now = int(self.usable_gb(reclaim=False) * GB)
        evicted = self.cache.evict_beyond(self.settings.max_resident, keep=manifest.id)
        evicted += self.cache.evict_lru_until(need, free_now, keep=manifest.id)
        if evicted:
            log.info("evicted %s to make room for %s at %s", evicted, manifest.id, rung)

    def _free(self, keep: str | None) -> None:
        """After an OOM: evict every other pipeline, collect garbage, empty the allocator cache."""
        self.cache.evict_others(keep=keep)
        release_memory(self.info)

    def _reclaim(self, watch: Stopwatch, keep: str) -> None:
        with watch.phase("load"):
            self._free(keep=keep)
