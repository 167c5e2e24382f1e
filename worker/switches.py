"""The optimisation switches (quantize, sdpa, channels_last, attention_slicing, vae_tiling,
taesd_preview, compile): each is auto | on | off, read through one lookup (the manifest's
`optimizations:` over the KILN_* setting), and each reports applied, skipped or fell_back with
its reason into the pipeline's SettingsReport."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from api_client.manifest import Manifest, Switch, SwitchName
from api_client.schema import Rung
from worker.device import DeviceInfo
from worker.errors import CompileRequired, PinRefused
from worker.families import spec_of
from worker.manifest import weights_source
from worker.resident import LoadedPipeline
from worker.settings import Settings

log = logging.getLogger(__name__)


def switch(manifest: Manifest, settings: Settings, name: SwitchName) -> Switch:
    """A switch's value for this model: the manifest's override, else the worker's setting."""
    return manifest.optimizations.get(name, settings.switch(name))


def apply_switches(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    """Everything that acts on the pipeline before placement, in this order."""
    _quantize(loaded, info, settings)
    _sdpa(loaded, settings)
    _channels_last(loaded, info, settings)
    _attention_slicing(loaded, settings)
    _vae_tiling(loaded, settings)
    _taesd_preview(loaded, info, settings)


def _quantize(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    """torchao after load, before placement; a scheme this stack cannot run is reported skipped."""
    manifest, report = loaded.manifest, loaded.settings
    wanted = manifest.quantize
    value = switch(manifest, settings, "quantize")
    if not wanted:
        if value == "on":
            report.add("skipped", "quantize", "manifest names no components to quantize")
        return
    if value == "off":
        report.add("skipped", "quantize", "switched off (KILN_QUANTIZE=off or manifest)")
        return
    from worker.quantize import pick_schemes, quantize_component

    for component, pick in pick_schemes(manifest, info).items():
        module = getattr(loaded.pipe, component, None)
        if not isinstance(module, torch.nn.Module):
            raise ValueError(
                f"model {manifest.id}: quantize names {component!r}, which this pipeline lacks"
            )
        refused = None if pick.scheme is None else quantize_component(module, pick.scheme)
        if pick.scheme is not None and refused is None:
            loaded.quantized[component] = pick.scheme
            report.add("applied", f"quantize:{component}", pick.reason)
        else:
            report.add("skipped", f"quantize:{component}", refused or pick.reason)


def _sdpa(loaded: LoadedPipeline, settings: Settings) -> None:
    if switch(loaded.manifest, settings, "sdpa") == "off":
        from diffusers.models.attention_processor import AttnProcessor

        loaded.denoiser.set_attn_processor(AttnProcessor())  # type: ignore[operator]
        loaded.settings.add("skipped", "sdpa", "switched off: classic attention processor")
    else:
        loaded.settings.add(
            "applied", "sdpa", "torch scaled_dot_product_attention (diffusers default)"
        )


def _channels_last(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    value, report = switch(loaded.manifest, settings, "channels_last"), loaded.settings
    denoiser = loaded.denoiser
    # The family names its denoiser: SD3's is a transformer and its pipeline has no unet at all.
    conv_unet = spec_of(loaded.manifest.family).denoiser == "unet"
    if value == "on" or (value == "auto" and info.accelerator and conv_unet):
        denoiser.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        report.add("applied", "channels_last", "denoiser in channels_last layout")
    elif value == "auto":
        why = "not a conv UNet" if info.accelerator else "CPU: no measured gain"
        report.add("skipped", "channels_last", f"auto: {why}")
    else:
        report.add("skipped", "channels_last", "switched off")


def _attention_slicing(loaded: LoadedPipeline, settings: Settings) -> None:
    if switch(loaded.manifest, settings, "attention_slicing") == "on":
        loaded.pipe.enable_attention_slicing()
        loaded.settings.add("applied", "attention_slicing", "switched on")
    else:
        loaded.settings.add(
            "skipped",
            "attention_slicing",
            "SDPA is already memory-efficient; slicing only slows it",
        )


def _vae_tiling(loaded: LoadedPipeline, settings: Settings) -> None:
    value, rung = switch(loaded.manifest, settings, "vae_tiling"), loaded.rung
    if value == "on" or (value == "auto" and rung != "full"):
        loaded.pipe.vae.enable_tiling()
        why = "switched on" if value == "on" else f"auto: offload rung {rung}"
        loaded.settings.add("applied", "vae_tiling", why)
    else:
        why = "switched off" if value == "off" else "auto: fully resident, decode fits"
        loaded.settings.add("skipped", "vae_tiling", why)


def _taesd_preview(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    """TAESD decodes a latent in milliseconds: a preview a few times per job for the client.

    A preview is a convenience: if its weights cannot be loaded the job goes on without one.
    """
    manifest, report = loaded.manifest, loaded.settings
    if switch(manifest, settings, "taesd_preview") == "off":
        report.add("skipped", "taesd_preview", "switched off")
        return
    if manifest.taesd is None:
        report.add("skipped", "taesd_preview", "the manifest names no taesd weights")
        return
    if not spec_of(manifest.family).previews:
        why = f"{manifest.family} packs its latents into patch tokens while denoising"
        report.add("skipped", "taesd_preview", f"{why}; kiln decodes no preview from them")
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


def preview_steps(steps: int) -> set[int]:
    """1-based steps after which a preview is drawn; never the last: the real decode follows."""
    every = max(steps // 4, 1)
    return {step for step in range(every, steps, every)}


@dataclass(frozen=True)
class CompilePlan:
    """Whether a load compiles its denoiser; why not (a skipped note) when it does not; and
    whether a failed compile fails the load (compile: required, or pinned by the request)."""

    compile: bool
    reason: str = ""
    must: bool = False


def compile_plan(
    manifest: Manifest, rung: Rung, info: DeviceInfo, settings: Settings, pin: bool | None = None
) -> CompilePlan:
    """The compile decision for a load at this rung, without loading anything: the request's pin
    (a replay's) when it has one, else the manifest's policy over the compile switch. A pin
    this worker cannot honour raises PinRefused naming why."""
    if pin is not None:
        return _pinned_plan(manifest, rung, settings, pin)
    policy, value = manifest.compile, switch(manifest, settings, "compile")
    required = policy == "required" and rung == "full"
    if policy == "off":
        return CompilePlan(False, "switched off by the manifest (compile: off)")
    if rung != "full":
        why = "required, but" if policy == "required" else "skipped:"
        return CompilePlan(False, f"{why} offload hooks and Inductor conflict at rung {rung}")
    if value == "off" and required:
        raise CompileRequired(
            f"model {manifest.id}: compile is required when fully resident,"
            " but the compile switch is off"
        )
    if value == "off":
        return CompilePlan(False, "switched off")
    if value == "auto" and not required and not info.compile_default:
        return CompilePlan(False, "auto: off on CPU (tiny UNet: 76 s compile to save ~8 ms a step)")
    if value == "auto" and not required and info.simulated and info.torch_device == "cpu":
        return CompilePlan(
            False,
            f"auto: {info.simulated} would compile at full; not run on the real device (cpu),"
            " where the tiny UNet takes 76 s to compile",
        )
    return CompilePlan(True, must=required)


def _pinned_plan(manifest: Manifest, rung: Rung, settings: Settings, pin: bool) -> CompilePlan:
    """A pin overrides auto (compile on a CPU too, when asked) but never the manifest's off or
    required, the off switch an operator set, or the rule that only full compiles."""
    if not pin:
        if manifest.compile == "required" and rung == "full":
            raise PinRefused(
                f"model {manifest.id}: the request pins compile off, but its manifest requires"
                " compile at rung full (compile: required)"
            )
        return CompilePlan(False, "pinned off by the request (compile=false)")
    if manifest.compile == "off":
        why = "its manifest switches compile off (compile: off)"
    elif rung != "full":
        why = f"it runs at rung {rung} here, and compile runs only at full"
    elif switch(manifest, settings, "compile") == "off":
        why = "this worker's compile switch is off (KILN_COMPILE=off or the manifest)"
    else:
        return CompilePlan(True, must=True)
    raise PinRefused(f"model {manifest.id}: the request pins compile on, but {why}")


def apply_compile(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    """torch.compile only at full: accelerate's offload hooks and Inductor fight each other."""
    manifest, report = loaded.manifest, loaded.settings
    plan = compile_plan(manifest, loaded.rung, info, settings, loaded.compile_pin)
    if not plan.compile:
        report.add("skipped", "compile", plan.reason)
        return
    from worker.compile import compile_available, compile_denoiser

    unavailable = compile_available()
    try:
        if unavailable is not None:
            raise RuntimeError(unavailable)
        how = compile_denoiser(loaded.denoiser, settings, manifest.compile_method)
    except Exception as exc:
        if plan.must:
            raise _compile_failed(loaded, f"failed: {exc}") from exc
        report.add(
            "fell_back", "compile", f"eager: torch.compile failed: {type(exc).__name__}: {exc}"
        )
        return
    loaded.compiled = True
    report.add("applied", "compile", how)


def _compile_failed(loaded: LoadedPipeline, what: str) -> RuntimeError:
    """The error for a compile that had to succeed: the request's pin, else the manifest's rule."""
    if loaded.compile_pin:
        return PinRefused(f"model {loaded.manifest.id}: the request pins compile on, and it {what}")
    return CompileRequired(f"model {loaded.manifest.id}: compile is required and {what}")


def compile_fell_back(loaded: LoadedPipeline, exc: BaseException) -> bool:
    """Graphs are built lazily at the first forward; when that fails, go eager if policy allows."""
    from worker.compile import is_compile_failure, uncompile_denoiser

    if not loaded.compiled or not is_compile_failure(exc):
        return False
    if loaded.manifest.compile == "required" or loaded.compile_pin:
        raise _compile_failed(loaded, f"failed at the first forward: {exc}") from exc
    uncompile_denoiser(loaded.denoiser)
    loaded.compiled = False
    loaded.settings.applied = [n for n in loaded.settings.applied if n.name != "compile"]
    # Dynamo puts the backend's own error on the lines after "backend=... raised:".
    why = " ".join(str(exc).split())[:300] or type(exc).__name__
    loaded.settings.add("fell_back", "compile", f"eager: first compiled forward failed: {why}")
    return True
