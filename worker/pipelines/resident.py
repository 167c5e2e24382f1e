"""Pipelines resident in this worker: what a load produced (LoadedPipeline), the cache that keeps
them across jobs with least-recently-used eviction, and the release of their device memory.

The device cache, the host-RAM cache it evicts into and the release of
what they held are one lifecycle of a pipeline, read together."""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from api_client.manifest import Manifest
from api_client.schema import Rung, SettingsReport
from worker.memory import device as dev
from worker.memory.device import DeviceInfo
from worker.memory.partial import PartialSplit
from worker.memory.peaks import component_bytes, module_bytes
from worker.memory.rungs import RungSpec, rung_spec
from worker.pipelines.adapters import AdapterSlots
from worker.pipelines.families import FamilySpec, spec_for
from worker.pipelines.release import free, release_memory, to_host

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class Rendered(Protocol):
    """What made a job's images, as its record and the images' details read it: a resident
    pipeline (LoadedPipeline) or an upscaler (worker.pipelines.upscale.LoadedUpscaler)."""

    manifest: Manifest
    compiled: bool
    quantized: dict[str, str]
    settings: SettingsReport

    @property
    def rung(self) -> Rung: ...

    @property
    def dtype_name(self) -> str: ...

    @property
    def sampler(self) -> str: ...


@dataclass
class LoadedPipeline:
    """One pipeline on one rung, with what its load did; lives in the cache across jobs."""

    manifest: Manifest
    pipe: Any
    rung: Rung
    dtype: torch.dtype
    settings: SettingsReport
    compiled: bool = False
    # The request's compile pin this load honoured (a replay's); None: the worker's own policy.
    compile_pin: bool | None = None
    quantized: dict[str, str] = field(default_factory=dict)
    load_s: float = 0.0
    device_bytes: int = 0  # device memory this pipeline took at load (allocated after - before)
    warm_shapes: set[tuple[int, int, int]] = field(default_factory=set)  # (w, h, batch) seen
    recompiles: int = 0  # graphs Dynamo built for this pipeline after its first job
    cfg_seen: set[bool] = field(default_factory=set)  # guidance on, off, or both, so far
    mode_pipes: dict[str, Any] = field(default_factory=dict)  # img2img, inpaint: from_pipe views
    modes_seen: set[str] = field(default_factory=set)
    adapters: AdapterSlots | None = None  # LoRA slots, where the manifest allows loras
    adapter_sets: set[frozenset[str]] = field(default_factory=set)  # LoRA sets run, so far
    preview_vae: Any = None  # AutoencoderTiny when taesd_preview applies
    partial: PartialSplit | None = None  # at the partial rung: its denoiser's blocks, split
    # ControlNets read for its jobs, by checkpoint, placed on its rung (worker.pipelines.control);
    # dropped with it when it leaves the device: a later job reads them again.
    controlnets: dict[str, torch.nn.Module] = field(default_factory=dict)
    # Its IP-Adapter (a worker.pipelines.reference.ReferenceAdapter) once a job had a reference
    # image, placed and dropped as the ControlNets are.
    reference: torch.nn.Module | None = None
    # False for a pipeline read on the host and never placed (a prefetched one): its rung is
    # the first job's, and any rung's placement fits it (worker.pipelines.loading.place_read).
    placed: bool = True
    # The scheduler config its weights came with, before the manifest's scheduler: what a job's
    # sampler is built from (worker.pipelines.samplers). None: its scheduler's own config.
    scheduler_config: Any = None
    # How its family renders: looked up once, when the pipeline is read, and read from here on.
    spec: FamilySpec = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.spec = spec_for(self.manifest)

    @property
    def rung_spec(self) -> RungSpec:
        """Its rung's row of the rung table (worker.memory.rungs)."""
        return rung_spec(self.rung)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    @property
    def sampler(self) -> str:
        """The scheduler class it runs (the record's and the details' sampler)."""
        return type(self.pipe.scheduler).__name__

    @functools.cached_property
    def execution_device(self) -> torch.device:
        """Where the pipeline computes. diffusers' pipe._execution_device walks every module
        for offload hooks on each read (2.5 ms on the tiny UNet's 468 modules, measured here);
        a pipeline's placement is fixed for its life in the cache."""
        device: torch.device = self.pipe._execution_device
        return device

    @property
    def weights_bytes(self) -> tuple[int, int]:
        """(all components' and ControlNets', the largest one's) parameter and buffer bytes: what
        the planner measures a job's peak against."""
        weights, largest = self.pipeline_bytes
        beside = [module_bytes(module) for module in self.beside]
        return weights + sum(beside), max([largest, *beside])

    @property
    def beside(self) -> list[torch.nn.Module]:
        """The models loaded beside the pipeline for some jobs: ControlNets, the IP-Adapter."""
        held = list(self.controlnets.values())
        return held if self.reference is None else [*held, self.reference]

    @functools.cached_property
    def pipeline_bytes(self) -> tuple[int, int]:
        """(all components', the largest one's) bytes. Read once: walking every tensor took
        7.3 ms of each tiny-sd15 job (cProfile, bench/RESULTS.md), and a pipeline's weights keep
        their size for its life in the cache (quantized and given its adapter slots before its
        first job)."""
        return component_bytes(self.pipe)

    def novelty(
        self,
        width: int,
        height: int,
        count: int,
        cfg: bool,
        mode: str = "txt2img",
        loras: frozenset[str] = frozenset(),
    ) -> str:
        """What a job asks that no job before it on this pipeline did: why a compiled denoiser
        would build new graphs for it."""
        if self.modes_seen and mode not in self.modes_seen:
            return f"new mode {mode}"
        if (width, height) not in {(w, h) for w, h, _ in self.warm_shapes}:
            return f"new size {width}x{height}"
        if (width, height, count) not in self.warm_shapes:
            return f"new batch of {count} at {width}x{height}"
        if cfg not in self.cfg_seen:
            return f"guidance {'on' if cfg else 'off'} (CFG changes the denoiser's batch)"
        if self.adapter_sets and loras not in self.adapter_sets:
            return f"new adapter set {', '.join(sorted(loras)) or '(none)'}"
        return "no new size, batch, guidance, mode or adapters: a guard on another input failed"

    def pipe_for(self, mode: str) -> Any:
        """The pipeline that renders mode: the resident one for txt2img and for edit (an edit
        model's resident pipeline is its edit class); for img2img and inpaint the family's class
        built on the resident pipeline's own modules, so nothing is loaded or placed again, kept
        for the next job of that mode. Not diffusers' from_pipe: it ends by
        casting every module (.to(dtype), fp32 unless told), which torchao's quantized weights
        refuse (Int8Tensor has no aten.to) and which would undo a bf16 load."""
        if mode in ("txt2img", "edit", "txt2video"):
            return self.pipe
        derived = self.mode_pipes.get(mode)
        if derived is None:
            import diffusers

            pipeline_cls = getattr(diffusers, self.spec.modes[mode])
            modules, options = pipeline_cls._get_signature_keys(pipeline_cls)
            parts = {k: v for k, v in self.pipe.components.items() if k in modules}
            parts.update({k: v for k, v in self.pipe.config.items() if k in options})
            derived = pipeline_cls(**parts)
            derived.set_progress_bar_config(disable=True)
            self.mode_pipes[mode] = derived
        return derived

    @property
    def denoiser(self) -> torch.nn.Module:
        """The UNet or transformer: what compile, channels_last and attention switches act on."""
        module: torch.nn.Module = getattr(self.pipe, self.spec.denoiser)
        return module


@dataclass(frozen=True)
class Eviction:
    """One pipeline dropped from the cache, with the device memory measured around it."""

    model_id: str
    rung: Rung
    allocated_before: int
    allocated_after: int

    @property
    def freed_bytes(self) -> int:
        return max(self.allocated_before - self.allocated_after, 0)


class RamCache:
    """Evicted pipelines kept in host memory, least recently used first, up to a byte bound
    (KILN_RAM_CACHE_GB), so going back to a model is a placement, not a read from disk. Each
    is kept as it was loaded (quantized, switched, adapters in its slots, compile wrappers on)
    with its offload hooks off and its weights on the host; a prefetched one as it was read,
    never placed. The prefetcher's thread keeps while the render's takes: one lock."""

    def __init__(self, bound_bytes: int) -> None:
        self.bound_bytes = bound_bytes
        self._kept: OrderedDict[str, tuple[LoadedPipeline, int]] = OrderedDict()
        self._lock = threading.Lock()

    def fits(self, size: int) -> bool:
        return 0 < size <= self.bound_bytes

    def keep(self, loaded: LoadedPipeline, size: int) -> bool:
        """Take an evicted pipeline of size host bytes onto the host; False when it cannot fit."""
        if not self.fits(size):
            return False
        to_host(loaded)
        with self._lock:
            replaced = self._kept.pop(loaded.manifest.id, None)
            if replaced is not None and replaced[0] is not loaded:
                free(replaced[0])
            self._kept[loaded.manifest.id] = (loaded, size)
            while sum(size for _, size in self._kept.values()) > self.bound_bytes:
                model_id, (oldest, _) = self._kept.popitem(last=False)
                log.info("ram cache: dropped %s (bound %d bytes)", model_id, self.bound_bytes)
                free(oldest)
        return True

    def take(self, model_id: str) -> LoadedPipeline | None:
        with self._lock:
            entry = self._kept.pop(model_id, None)
        return None if entry is None else entry[0]

    def held_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._kept.values())

    def model_ids(self) -> list[str]:
        with self._lock:
            return list(self._kept)


def host_bytes(pipe: Any) -> int:
    """Bytes of every parameter and buffer of the pipeline's modules: its size on the host."""
    return component_bytes(pipe)[0]


class PipelineCache:
    """Resident pipelines by model id, least recently used first, and the RAM cache behind them."""

    def __init__(self, info: DeviceInfo, ram_cache_bytes: int = 0) -> None:
        self.info = info
        self._resident: OrderedDict[str, LoadedPipeline] = OrderedDict()
        self.ram = RamCache(ram_cache_bytes)
        # The latest evictions, oldest first; bounded, since a worker runs for months.
        self.evictions: deque[Eviction] = deque(maxlen=100)

    def get(self, model_id: str) -> LoadedPipeline | None:
        loaded = self._resident.get(model_id)
        if loaded is not None:
            self._resident.move_to_end(model_id)
        return loaded

    def put(self, loaded: LoadedPipeline) -> None:
        self._resident[loaded.manifest.id] = loaded
        self._resident.move_to_end(loaded.manifest.id)

    def model_ids(self) -> list[str]:
        return list(self._resident)

    def rungs(self) -> dict[str, Rung]:
        """Each resident model's rung, without touching its place in the LRU order."""
        return {model_id: loaded.rung for model_id, loaded in self._resident.items()}

    def resident_bytes(self, exclude: str | None = None) -> int:
        return sum(p.device_bytes for k, p in self._resident.items() if k != exclude)

    def evict(self, model_id: str, to_ram: bool = True) -> Eviction | None:
        """Take one pipeline off the device, measuring allocated bytes around it: into the RAM
        cache where it fits (to_ram: the model may be asked for again as it is), else released."""
        loaded = self._resident.pop(model_id, None)
        if loaded is None:
            return None
        # Into RAM, the weights move and nothing is left for the collector: a full gc.collect()
        # took 0.22 s here each time, more than the rest of a tiny model's switch.
        size = host_bytes(loaded.pipe) if to_ram else 0
        to_ram = self.ram.fits(size)
        if not to_ram:
            release_memory(self.info)
        before = dev.allocated_bytes(self.info)
        rung = loaded.rung
        kept = to_ram and self.ram.keep(loaded, size)
        if not kept:
            free(loaded)
        del loaded
        if kept:
            dev.empty_cache(self.info)
        else:
            release_memory(self.info)
        eviction = Eviction(model_id, rung, before, dev.allocated_bytes(self.info))
        self.evictions.append(eviction)
        log.info(
            "evicted %s (%s)%s: allocated %d -> %d bytes, freed %d",
            model_id,
            rung,
            " into the RAM cache" if kept else "",
            eviction.allocated_before,
            eviction.allocated_after,
            eviction.freed_bytes,
        )
        return eviction

    def evict_beyond(self, limit: int, keep: str) -> list[str]:
        """KILN_MAX_RESIDENT: evict least recently used pipelines (never keep) until loading one
        more leaves at most limit resident; 0 is no limit."""
        evicted: list[str] = []
        for model_id in list(self._resident):
            if not limit or len(self._resident) < limit:
                break
            if model_id != keep:
                self.evict(model_id)
                evicted.append(model_id)
        return evicted

    def release(self, loaded: LoadedPipeline) -> None:
        """Free a pipeline that is in neither cache any more (one taken from RAM and not used)."""
        free(loaded)
        release_memory(self.info)

    def evict_others(self, keep: str | None) -> list[str]:
        evicted = [model_id for model_id in list(self._resident) if model_id != keep]
        for model_id in evicted:
            self.evict(model_id)
        return evicted

    def evict_lru_until(self, need_bytes: int, free_now: int, keep: str | None) -> list[str]:
        """Evict least recently used pipelines (never keep) until need_bytes would fit."""
        evicted: list[str] = []
        for model_id in list(self._resident):
            if free_now >= need_bytes:
                break
            if model_id == keep:
                continue
            free_now += self._resident[model_id].device_bytes
            self.evict(model_id)
            evicted.append(model_id)
        return evicted
