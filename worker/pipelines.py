"""Load a manifest's pipeline onto a rung (dtype, scheduler, quantize, switches, place, compile),
and keep loaded pipelines resident across jobs with least-recently-used eviction."""

from __future__ import annotations

import gc
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from api_client.manifest import Manifest
from api_client.schema import SettingsReport
from worker import device as dev
from worker.device import DeviceInfo
from worker.families import family_of
from worker.faults import FaultPlan
from worker.ladder import Rung
from worker.manifest import weights_source
from worker.settings import Settings

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def preview_steps(steps: int) -> set[int]:
    """1-based steps after which a preview is drawn; never the last: the real decode follows."""
    every = max(steps // 4, 1)
    return {step for step in range(every, steps, every)}


class CompileRequired(RuntimeError):
    """compile: required, the pipeline is fully resident, and torch.compile did not succeed."""


@dataclass
class LoadedPipeline:
    manifest: Manifest
    pipe: Any
    rung: Rung
    dtype: torch.dtype
    settings: SettingsReport
    compiled: bool = False
    quantized: dict[str, str] = field(default_factory=dict)
    load_s: float = 0.0
    device_bytes: int = 0  # device memory this pipeline took at load (allocated after - before)
    warm_shapes: set[tuple[int, int, int]] = field(default_factory=set)  # (w, h, batch) seen
    recompiles: int = 0  # graphs Dynamo built for this pipeline after its first job
    preview_vae: Any = None  # AutoencoderTiny when taesd_preview applies

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]


def choose_dtype(manifest: Manifest, info: DeviceInfo) -> tuple[torch.dtype, str]:
    """bf16 where supported, else fp16, except families that overflow in fp16; fp32 on CPU."""
    if manifest.dtype != "auto":
        return DTYPES[manifest.dtype], f"manifest dtype {manifest.dtype}"
    if not info.accelerator:
        return torch.float32, "fp32 on CPU (bf16 VAE decode measured ~80x slower there)"
    if info.bf16:
        return torch.bfloat16, f"bf16 supported on {info.name}"
    if family_of(manifest.family).fp16_safe and info.fp16:
        return torch.float16, f"fp16: {info.name} has no bf16"
    return (
        torch.float32,
        f"fp32: {manifest.family} must not run in fp16 and {info.name} has no bf16",
    )


def load_pipeline(
    manifest: Manifest, rung: Rung, info: DeviceInfo, settings: Settings, faults: FaultPlan
) -> LoadedPipeline:
    """from_pretrained on the host, then quantize, switch, place on the rung, compile at full."""
    started = time.perf_counter()
    before = dev.allocated_bytes(info)
    # 1. Resolve the weights and precision.
    source = weights_source(manifest, settings.models_dir)
    dtype, dtype_reason = choose_dtype(manifest, info)
    report = SettingsReport()
    report.add("applied", "precision", dtype_reason)
    faults.check("load", rung)
    # 2. Load on the host; placement comes after quantization.
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    family = family_of(manifest.family)
    pipeline_cls = getattr(diffusers, family.pipeline_class)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if manifest.revision:
        kwargs["revision"] = manifest.revision
    if manifest.variant and not source.local:
        kwargs["variant"] = manifest.variant
    if manifest.family in ("sd15", "sd2"):
        kwargs.update(safety_checker=None, requires_safety_checker=False)
    if manifest.vae is not None:
        from worker.vae import load_vae_override

        kwargs["vae"] = load_vae_override(manifest, settings.models_dir, dtype)
    pipe = pipeline_cls.from_pretrained(source.location, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    loaded = LoadedPipeline(manifest=manifest, pipe=pipe, rung=rung, dtype=dtype, settings=report)
    # 3. Scheduler, quantization, switches, placement, compile: each reports what it did.
    _set_scheduler(pipe, manifest)
    _quantize(loaded, info, settings)
    _apply_switches(loaded, info, settings)
    from worker.vae import upcast_before_placement

    upcast_before_placement(loaded)
    _place(pipe, rung, info)
    _compile(loaded, info, settings)
    dev.synchronize(info)
    loaded.device_bytes = max(dev.allocated_bytes(info) - before, 0)
    loaded.load_s = time.perf_counter() - started
    return loaded


SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "dpmsolver": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler-a": ("EulerAncestralDiscreteScheduler", {}),
    "euler-trailing": ("EulerDiscreteScheduler", {"timestep_spacing": "trailing"}),
    "ddim": ("DDIMScheduler", {}),
    "lcm": ("LCMScheduler", {}),
    "flow-euler": ("FlowMatchEulerDiscreteScheduler", {}),
}


def _set_scheduler(pipe: Any, manifest: Manifest) -> None:
    if manifest.scheduler is None:
        return
    import diffusers

    class_name, overrides = SCHEDULERS[manifest.scheduler]
    scheduler_cls = getattr(diffusers, class_name)
    pipe.scheduler = scheduler_cls.from_config(pipe.scheduler.config, **overrides)


def _quantize(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    """torchao after load, before placement; a scheme this stack cannot run is reported skipped."""
    manifest, report = loaded.manifest, loaded.settings
    wanted = manifest.quantize
    switch = manifest.optimizations.get("quantize", settings.quantize)
    if not wanted:
        if switch == "on":
            report.add("skipped", "quantize", "manifest names no components to quantize")
        return
    if switch == "off":
        report.add("skipped", "quantize", "switched off (KILN_QUANTIZE=off or manifest)")
        return
    from worker.quantize import quantize_component

    for component, scheme in wanted.items():
        module = getattr(loaded.pipe, component, None)
        if not isinstance(module, torch.nn.Module):
            raise ValueError(
                f"model {manifest.id}: quantize names {component!r}, which this pipeline lacks"
            )
        reason = quantize_component(module, scheme, info)
        if reason is None:
            loaded.quantized[component] = scheme
            report.add("applied", f"quantize:{component}", f"torchao {scheme}")
        else:
            report.add("skipped", f"quantize:{component}", reason)


def _switch(loaded: LoadedPipeline, settings: Settings, name: str) -> str:
    value: str = loaded.manifest.optimizations.get(name, getattr(settings, name))  # type: ignore[call-overload]
    return value


def _apply_switches(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    pipe, report, rung = loaded.pipe, loaded.settings, loaded.rung
    denoiser = getattr(pipe, family_of(loaded.manifest.family).denoiser)

    sdpa = _switch(loaded, settings, "sdpa")
    if sdpa == "off":
        from diffusers.models.attention_processor import AttnProcessor

        denoiser.set_attn_processor(AttnProcessor())
        report.add("skipped", "sdpa", "switched off: classic attention processor")
    else:
        report.add("applied", "sdpa", "torch scaled_dot_product_attention (diffusers default)")

    channels_last = _switch(loaded, settings, "channels_last")
    # The family names its denoiser: SD3's is a transformer and its pipeline has no unet at all.
    conv_unet = family_of(loaded.manifest.family).denoiser == "unet"
    if channels_last == "on" or (channels_last == "auto" and info.accelerator and conv_unet):
        denoiser.to(memory_format=torch.channels_last)
        report.add("applied", "channels_last", "denoiser in channels_last layout")
    elif channels_last == "auto":
        why = "not a conv UNet" if info.accelerator else "CPU: no measured gain"
        report.add("skipped", "channels_last", f"auto: {why}")
    else:
        report.add("skipped", "channels_last", "switched off")

    slicing = _switch(loaded, settings, "attention_slicing")
    if slicing == "on":
        pipe.enable_attention_slicing()
        report.add("applied", "attention_slicing", "switched on")
    else:
        report.add(
            "skipped",
            "attention_slicing",
            "SDPA is already memory-efficient; slicing only slows it",
        )

    tiling = _switch(loaded, settings, "vae_tiling")
    if tiling == "on" or (tiling == "auto" and rung != "full"):
        pipe.vae.enable_tiling()
        report.add(
            "applied",
            "vae_tiling",
            "switched on" if tiling == "on" else f"auto: offload rung {rung}",
        )
    else:
        why = "switched off" if tiling == "off" else "auto: fully resident, decode fits"
        report.add("skipped", "vae_tiling", why)

    _load_preview_vae(loaded, info, settings)


def _load_preview_vae(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    """TAESD decodes a latent in milliseconds: a preview a few times per job for the client.

    A preview is a convenience: if its weights cannot be loaded the job goes on without one.
    """
    manifest, report = loaded.manifest, loaded.settings
    switch = _switch(loaded, settings, "taesd_preview")
    if switch == "off":
        report.add("skipped", "taesd_preview", "switched off")
        return
    if manifest.taesd is None:
        report.add("skipped", "taesd_preview", "the manifest names no taesd weights")
        return
    from diffusers import AutoencoderTiny

    try:
        source = weights_source(manifest, settings.models_dir, manifest.taesd, marker="config.json")
        taesd = AutoencoderTiny.from_pretrained(source.location, dtype=loaded.dtype)
    except Exception as exc:
        report.add("skipped", "taesd_preview", f"cannot load taesd {manifest.taesd!r}: {exc}")
        return
    # A few MB: it stays on the device at every rung, so previews never wait for an offload.
    loaded.preview_vae = taesd.to(info.torch_device).eval()
    report.add(
        "applied", "taesd_preview", f"TAESD {manifest.taesd}: a preview each quarter of the steps"
    )


def _place(pipe: Any, rung: Rung, info: DeviceInfo) -> None:
    """Put the pipeline on its rung; on CPU the offload rungs run for real, onloading to the CPU."""
    target = torch.device(info.torch_device)
    if rung == "full":
        pipe.to(target)
    elif rung == "model_offload":
        pipe.enable_model_cpu_offload(device=target)
    else:
        # Streams need the real device to have them, whatever card the decisions are made as.
        cuda = target.type == "cuda" and info.streams
        pipe.enable_group_offload(
            onload_device=target,
            offload_device=torch.device("cpu"),
            offload_type="leaf_level",
            use_stream=cuda,
            non_blocking=cuda,
        )


def _compile(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    """torch.compile only at full: accelerate's offload hooks and Inductor fight each other."""
    manifest, report = loaded.manifest, loaded.settings
    policy = manifest.compile
    switch = manifest.optimizations.get("compile", settings.compile)
    required = policy == "required" and loaded.rung == "full"
    if policy == "off":
        report.add("skipped", "compile", "switched off by the manifest (compile: off)")
        return
    if loaded.rung != "full":
        why = "required, but" if policy == "required" else "skipped:"
        report.add(
            "skipped", "compile", f"{why} offload hooks and Inductor conflict at rung {loaded.rung}"
        )
        return
    if switch == "off" and required:
        raise CompileRequired(
            f"model {manifest.id}: compile is required when fully resident,"
            " but the compile switch is off"
        )
    if switch == "off":
        report.add("skipped", "compile", "switched off")
        return
    if switch == "auto" and not required and not info.compile_default:
        report.add(
            "skipped", "compile", "auto: off on CPU (tiny UNet: 76 s compile to save ~8 ms a step)"
        )
        return
    if switch == "auto" and not required and info.simulated and info.torch_device == "cpu":
        report.add(
            "skipped",
            "compile",
            f"auto: {info.simulated} would compile at full; not run on the real device (cpu),"
            " where the tiny UNet takes 76 s to compile",
        )
        return
    from worker.compile import compile_available, compile_denoiser

    unavailable = compile_available()
    try:
        if unavailable is not None:
            raise RuntimeError(unavailable)
        how = compile_denoiser(loaded, settings)
    except Exception as exc:
        if required:
            raise CompileRequired(
                f"model {manifest.id}: compile is required and failed: {exc}"
            ) from exc
        report.add(
            "fell_back", "compile", f"eager: torch.compile failed: {type(exc).__name__}: {exc}"
        )
        return
    loaded.compiled = True
    report.add("applied", "compile", how)


def compile_fell_back(loaded: LoadedPipeline, exc: BaseException) -> bool:
    """Graphs are built lazily at the first forward; when that fails, go eager if policy allows."""
    from worker.compile import is_compile_failure, uncompile_denoiser

    if not loaded.compiled or not is_compile_failure(exc):
        return False
    if loaded.manifest.compile == "required":
        raise CompileRequired(
            f"model {loaded.manifest.id}: compile is required"
            f" and failed at the first forward: {exc}"
        ) from exc
    uncompile_denoiser(loaded)
    loaded.compiled = False
    loaded.settings.applied = [n for n in loaded.settings.applied if n.name != "compile"]
    # Dynamo puts the backend's own error on the lines after "backend=... raised:".
    why = " ".join(str(exc).split())[:300] or type(exc).__name__
    loaded.settings.add("fell_back", "compile", f"eager: first compiled forward failed: {why}")
    return True


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


class PipelineCache:
    """Resident pipelines by model id, least recently used first."""

    def __init__(self, info: DeviceInfo) -> None:
        self.info = info
        self._resident: OrderedDict[str, LoadedPipeline] = OrderedDict()
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

    def resident_bytes(self, exclude: str | None = None) -> int:
        return sum(p.device_bytes for k, p in self._resident.items() if k != exclude)

    def evict(self, model_id: str) -> Eviction | None:
        """Drop one pipeline and release its device memory, measuring allocated bytes around it."""
        loaded = self._resident.pop(model_id, None)
        if loaded is None:
            return None
        release_memory(self.info)
        before = dev.allocated_bytes(self.info)
        rung = loaded.rung
        _release(loaded)
        del loaded
        release_memory(self.info)
        eviction = Eviction(model_id, rung, before, dev.allocated_bytes(self.info))
        self.evictions.append(eviction)
        log.info(
            "evicted %s (%s): allocated %d -> %d bytes, freed %d",
            model_id,
            rung,
            eviction.allocated_before,
            eviction.allocated_after,
            eviction.freed_bytes,
        )
        return eviction

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


def _release(loaded: LoadedPipeline) -> None:
    """Drop every reference kiln holds to the weights so the allocator can take them back.

    Offload hooks reference their modules (accelerate's hooks and diffusers' group-offload
    registries), so they come off first; the pipeline is not copied back to the host, which
    would cost a full transfer and host memory just to throw the weights away.
    """
    pipe = loaded.pipe
    loaded.pipe = None
    if pipe is None:
        return
    try:
        pipe.remove_all_hooks()
    except Exception:
        log.debug("remove_all_hooks failed", exc_info=True)
    for component in list(pipe.components.values()):
        if isinstance(component, torch.nn.Module):
            _remove_group_offload(component)
    del pipe


def _remove_group_offload(module: torch.nn.Module) -> None:
    from diffusers.hooks import HookRegistry

    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        if isinstance(registry, HookRegistry):
            for name in list(registry.hooks):
                registry.remove_hook(name, recurse=False)


def release_memory(info: DeviceInfo) -> None:
    gc.collect()
    dev.empty_cache(info)
