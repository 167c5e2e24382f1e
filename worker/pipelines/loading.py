"""Loading a manifest's pipeline onto a rung, in two parts: on the host, whatever the rung
(weights and precision, from_pretrained, scheduler, the switches, LoRA slots), then its placement
on the rung as the rung's row says (worker.memory.rungs: its switches, the partial split, offload
hooks, compile where it compiles). The family's spec is looked up once, when the pipeline is
read, and carried with it (LoadedPipeline.spec)."""

from __future__ import annotations

import time
from typing import Any

import torch

from api_client.manifest import Manifest
from api_client.schema import Rung, SettingsReport
from worker.memory import device as dev
from worker.memory.device import DeviceInfo
from worker.memory.faults import FaultPlan
from worker.memory.ladder import Fit, rung_need_gb
from worker.memory.ladder import usable_gb as ladder_usable
from worker.memory.partial import PartialSplit, split_for
from worker.pipelines.adapters import AdapterSlots
from worker.pipelines.families import check_installed, spec_for
from worker.pipelines.quantize import pick_schemes
from worker.pipelines.resident import DTYPES, LoadedPipeline, host_bytes
from worker.pipelines.single_file import (
    lora_layers_in_compute_dtype,
    read_weights,
    refuse_pickles,
)
from worker.pipelines.switches import apply_compile, apply_rung_switches, apply_switches, switch
from worker.pipelines.vae import load_vae_override, upcast_before_placement
from worker.settings import Settings


def import_pipeline_classes(manifests: list[Manifest]) -> None:
    """Import the diffusers pipeline classes these manifests load (seconds, once per process)."""
    import diffusers

    from worker.pipelines import upscale

    for manifest in manifests:
        if manifest.family_row.weights_files:
            upscale.check_installed()  # spandrel, with the torchvision it imports
            continue
        check_installed(manifest)
        getattr(diffusers, spec_for(manifest).pipeline_class)


def choose_dtype(manifest: Manifest, info: DeviceInfo) -> tuple[torch.dtype, str]:
    """bf16 where supported, else fp16, except families that overflow in fp16; fp32 on CPU."""
    if manifest.dtype != "auto":
        return DTYPES[manifest.dtype], f"manifest dtype {manifest.dtype}"
    if not info.accelerator:
        return torch.float32, "fp32 on CPU (bf16 VAE decode measured ~80x slower there)"
    if info.bf16:
        return torch.bfloat16, f"bf16 supported on {info.name}"
    if spec_for(manifest).fp16_safe and info.fp16:
        return torch.float16, f"fp16: {info.name} has no bf16"
    return (
        torch.float32,
        f"fp32: {manifest.family} must not run in fp16 and {info.name} has no bf16",
    )


def fit_for(manifest: Manifest, info: DeviceInfo, settings: Settings) -> Fit:
    """How this card will hold the model's weights (precision, quantization picks), for the
    ladder's arithmetic; the same decisions a load makes (choose_dtype, the quantize switch)."""
    fp32 = info.accelerator and choose_dtype(manifest, info)[0] == torch.float32
    denoiser = spec_for(manifest).denoiser
    if switch(manifest, settings, "quantize") == "off":
        return Fit(fp32=fp32, denoiser=denoiser)
    picks = pick_schemes(manifest, info)
    schemes = {c: p.scheme for c, p in picks.items() if p.scheme is not None}
    return Fit(fp32, schemes, denoiser=denoiser)


def load_pipeline(
    manifest: Manifest,
    rung: Rung,
    info: DeviceInfo,
    settings: Settings,
    faults: FaultPlan,
    compile_pin: bool | None = None,
    usable_gb: float | None = None,
    full_need_gb: float | None = None,
) -> LoadedPipeline:
    """from_pretrained on the host (read_pipeline), then its first placement on the rung
    (place_read; compile_pin, usable_gb and full_need_gb are its)."""
    started = time.perf_counter()
    faults.check("load", rung)
    loaded = read_pipeline(manifest, info, settings)
    place_read(loaded, rung, info, settings, None, compile_pin, usable_gb, full_need_gb)
    loaded.load_s = time.perf_counter() - started
    return loaded


def read_pipeline(manifest: Manifest, info: DeviceInfo, settings: Settings) -> LoadedPipeline:
    """Everything a load does on the host, whatever the rung: from_pretrained, scheduler,
    quantization, the switches that do not depend on the rung, LoRA slots and the VAE upcast.
    Nothing touches the device, so the prefetcher (worker.pipelines.prefetch) runs it in a thread
    beside a render. The pipeline is not placed: its rung is chosen when a job takes it."""
    # 1. Resolve the weights (never a pickle) and precision.
    refuse_pickles(manifest)
    dtype, dtype_reason = choose_dtype(manifest, info)
    report = SettingsReport()
    report.add("applied", "precision", dtype_reason)
    # The pipeline's record first (its family's spec is looked up there, once), weights next.
    loaded = LoadedPipeline(
        manifest=manifest, pipe=None, rung="full", dtype=dtype, settings=report, placed=False
    )
    # 2. Load on the host; placement comes after quantization.
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    pipeline_cls = getattr(diffusers, loaded.spec.pipeline_class)
    # use_safetensors: a repository's .bin weights (pickles) are never a fallback.
    kwargs: dict[str, Any] = {"dtype": dtype, "use_safetensors": True}
    kwargs.update(loaded.spec.load_kwargs())
    if manifest.revision:
        kwargs["revision"] = manifest.revision
    if manifest.vae is not None:
        kwargs["vae"] = load_vae_override(manifest, settings.models_dir, dtype)
    # From a diffusers layout, one checkpoint file, or components from their own files.
    read = read_weights(pipeline_cls, manifest, settings.models_dir, kwargs)
    pipe = loaded.pipe = read.pipe
    loaded.quantized.update(read.quantized)
    for note in read.notes:
        report.add("applied", "weights", note)
    pipe.set_progress_bar_config(disable=True)
    # 3. Scheduler, quantization, switches: each reports what it did.
    _set_scheduler(loaded, manifest)
    apply_switches(loaded, info, settings)
    _prepare_adapters(loaded, settings)
    upcast_before_placement(loaded)
    return loaded


def place_read(
    loaded: LoadedPipeline,
    rung: Rung,
    info: DeviceInfo,
    settings: Settings,
    faults: FaultPlan | None,
    compile_pin: bool | None = None,
    usable_gb: float | None = None,
    full_need_gb: float | None = None,
) -> LoadedPipeline:
    """A pipeline read_pipeline made (a prefetched one), placed for the first time: the rung's
    own switch (VAE tiling), the partial split, placement, compile at full (or as compile_pin, a
    request's, says: switches.compile_plan). A rung whose row splits (partial) splits the
    denoiser's blocks by usable_gb (None: the device's free memory now, less the reserve and
    capped by the budget) and full_need_gb (full's measured need; None: the manifest's).
    faults: the drill's load check (None: the caller made it)."""
    assert not loaded.placed, "a pipeline is placed for the first time once"
    started = time.perf_counter()
    before = dev.allocated_bytes(info)
    if faults is not None:
        faults.check("load", rung)
    loaded.rung, loaded.compile_pin, loaded.placed = rung, compile_pin, True
    apply_rung_switches(loaded, info, settings)
    if loaded.rung_spec.splits:
        loaded.partial = _split(loaded, info, settings, usable_gb, full_need_gb)
        loaded.settings.add("applied", rung, loaded.partial.reason)
    _place(loaded, info)
    apply_compile(loaded, info, settings)
    _measure_placement(loaded, info, before, started)
    return loaded


def _prepare_adapters(loaded: LoadedPipeline, settings: Settings) -> None:
    """LoRA slots after quantization (the adapters wrap quantized layers, never get quantized)
    and before placement and compile (worker.pipelines.adapters)."""
    manifest = loaded.manifest
    if not manifest.loras:
        return
    denoiser = loaded.spec.denoiser
    slots = AdapterSlots.prepare(loaded.pipe, manifest, denoiser, settings.models_dir)
    lora_layers_in_compute_dtype(getattr(loaded.pipe, denoiser), loaded.dtype)  # fp8-held
    loaded.adapters = slots
    ranks = ", ".join(f"{a.name} r{a.rank}" for a in slots.adapters.values())
    loaded.settings.add(
        "applied",
        "loras",
        f"{len(slots.names)} hot-swap slot(s) on the {denoiser} for {ranks}, padded to rank"
        f" {max(s.max_rank for s in manifest.loras.values())}; bypassed by jobs that use none",
    )


def place_again(loaded: LoadedPipeline, info: DeviceInfo, faults: FaultPlan) -> LoadedPipeline:
    """A pipeline from the RAM cache back on its rung: a copy to the device and its offload
    hooks, nothing read from disk; quantization, switches, adapters and compile wrappers are
    kept from its load."""
    started = time.perf_counter()
    before = dev.allocated_bytes(info)
    faults.check("load", loaded.rung)
    _place(loaded, info)
    _measure_placement(loaded, info, before, started)
    return loaded


def _measure_placement(
    loaded: LoadedPipeline, info: DeviceInfo, before: int, started: float
) -> None:
    """The device memory a placement took, and the seconds since its load began. On a CPU the
    host is the device: what the pipeline's modules hold, since the resident set's growth
    counts what a read left behind and misses a pipeline that was already on the host."""
    dev.synchronize(info)
    if info.torch_device == "cpu":
        loaded.device_bytes = host_bytes(loaded.pipe)
    else:
        loaded.device_bytes = max(dev.allocated_bytes(info) - before, 0)
    loaded.load_s = time.perf_counter() - started


SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "dpmsolver": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler-a": ("EulerAncestralDiscreteScheduler", {}),
    "euler-trailing": ("EulerDiscreteScheduler", {"timestep_spacing": "trailing"}),
    "ddim": ("DDIMScheduler", {}),
    "lcm": ("LCMScheduler", {}),
    "flow-euler": ("FlowMatchEulerDiscreteScheduler", {}),
}


# What of a manifest's scheduler is the model's, not its sampler's: a job's own sampler keeps it
# (turbo and lightning distillations need trailing timesteps whatever solves them).
MODEL_SCHEDULE = ("timestep_spacing",)


def _set_scheduler(loaded: LoadedPipeline, manifest: Manifest) -> None:
    """The manifest's scheduler on the pipeline; the config its weights came with (and the
    model's part of the manifest's) kept for a job's sampler (worker.pipelines.samplers)."""
    pipe = loaded.pipe
    loaded.scheduler_config = dict(pipe.scheduler.config)
    if manifest.scheduler is None:
        return
    import diffusers

    class_name, overrides = SCHEDULERS[manifest.scheduler]
    loaded.scheduler_config.update({k: v for k, v in overrides.items() if k in MODEL_SCHEDULE})
    scheduler_cls = getattr(diffusers, class_name)
    pipe.scheduler = scheduler_cls.from_config(pipe.scheduler.config, **overrides)


def _split(
    loaded: LoadedPipeline,
    info: DeviceInfo,
    settings: Settings,
    usable: float | None,
    full_need: float | None,
) -> PartialSplit:
    """The partial rung's split of the denoiser's blocks, from their measured bytes, and full's
    need: as this card kind measured it, else the manifest's figure."""
    manifest = loaded.manifest
    if usable is None:
        free = dev.free_bytes(info)
        usable = ladder_usable(free, 0, settings.vram_reserve_gb, settings.vram_budget_gb, 0)
    if full_need is None:
        full_need = rung_need_gb(manifest, "full", fit_for(manifest, info, settings))
    return split_for(loaded.denoiser, usable, full_need)


def _place(loaded: LoadedPipeline, info: DeviceInfo) -> None:
    """Put the pipeline on its rung as the rung's row places it; on CPU the offload rungs run for
    real, onloading to the CPU."""
    target = torch.device(info.torch_device)
    # Streams need the real device to have them, whatever card the decisions are made as.
    cuda = target.type == "cuda" and info.streams
    if loaded.preview_vae is not None:  # a few MB, on the device at every rung
        loaded.preview_vae.to(target)
    loaded.rung_spec.place(loaded, target, cuda)
