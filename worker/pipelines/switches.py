"""The optimisation switches (quantize, sdpa, channels_last, attention_slicing, vae_tiling,
taesd_preview, compile): each is auto | on | off, read through one lookup (the manifest's
`optimizations:` over the KILN_* setting), and each reports applied, skipped or fell_back with
its reason into the pipeline's SettingsReport. What depends on the rung (vae_tiling's auto,
compile) is read from the rung's row (worker.memory.rungs), what depends on the family from its
rows (FamilySpec, and the manifest's family_row)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from api_client.manifest import Manifest, Switch, SwitchName
from api_client.schema import Rung
from worker.errors import CompileRequired, PinRefused
from worker.manifest import weights_source
from worker.memory import rungs
from worker.memory.device import DeviceInfo
from worker.pipelines.families import FamilySpec
from worker.pipelines.resident import LoadedPipeline
from worker.settings import Settings

log = logging.getLogger(__name__)


def switch(manifest: Manifest, settings: Settings, name: SwitchName) -> Switch:
    """A switch's value for this model: the manifest's override, else the worker's setting."""
    return manifest.optimizations.get(name, settings.switch(name))


@dataclass(frozen=True)
class Decision:
    """What a load does with one switch, and why: "applied" means it will act (a preview's
    weights may still fail to load: then the load reports it skipped, with that reason)."""

    kind: Literal["applied", "skipped"]
    reason: str


def decide_switches(
    manifest: Manifest, spec: FamilySpec, rung: Rung, info: DeviceInfo, settings: Settings
) -> dict[str, Decision]:
    """The rules for sdpa, channels_last, attention_slicing, vae_tiling and taesd_preview for
    manifest's model (spec: its family's, a loaded pipeline's own or spec_for's) at this rung on
    info's card, without loading a weight: a load applies them (apply_switches) and `kiln doctor
    --profile` prints them (worker/ops/plan.py). Compile is compile_plan's."""
    value = partial(switch, manifest, settings)
    decided = {
        "sdpa": Decision("applied", "torch scaled_dot_product_attention (diffusers default)")
    }
    if value("sdpa") == "off":
        decided["sdpa"] = Decision("skipped", "switched off: classic attention processor")
    # The family names its denoiser: SD3's is a transformer and its pipeline has no unet at all.
    layout = value("channels_last")
    if layout == "on" or (layout == "auto" and info.accelerator and spec.denoiser == "unet"):
        decided["channels_last"] = Decision("applied", "denoiser in channels_last layout")
    else:
        why = "not a conv UNet" if info.accelerator else "CPU: no measured gain"
        decided["channels_last"] = Decision(
            "skipped", f"auto: {why}" if layout == "auto" else "switched off"
        )
    decided["attention_slicing"] = (
        Decision("applied", "switched on")
        if value("attention_slicing") == "on"
        else Decision("skipped", "SDPA is already memory-efficient; slicing only slows it")
    )
    tiling = value("vae_tiling")
    if tiling == "on" or (tiling == "auto" and rungs.rung_spec(rung).tiles_vae):
        why = "switched on" if tiling == "on" else f"auto: offload rung {rung}"
        decided["vae_tiling"] = Decision("applied", why)
    else:
        why = "switched off" if tiling == "off" else "auto: fully resident, decode fits"
        decided["vae_tiling"] = Decision("skipped", why)
    decided["taesd_preview"] = _preview_decision(manifest, value("taesd_preview"))
    return decided


def _preview_decision(manifest: Manifest, value: Switch) -> Decision:
    if value == "off":
        return Decision("skipped", "switched off")
    if manifest.family_row.video:
        why = "a video job previews a frame by its latent-to-RGB factors (latent_preview)"
        return Decision("skipped", f"{why}, no TAESD")
    if manifest.taesd is None:
        return Decision("skipped", "the manifest names no taesd weights")
    if manifest.family_row.packed_latents:
        why = f"{manifest.family} packs its latents into patch tokens while denoising"
        return Decision("skipped", f"{why}; kiln decodes no preview from them")
    return Decision("applied", f"TAESD {manifest.taesd}: a preview each quarter of the steps")


def apply_switches(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    """What acts on the pipeline on the host, whatever its rung, in this order, as decided: a
    prefetched pipeline (worker.pipelines.prefetch) has no rung yet. VAE tiling is
    apply_rung_switches'."""
    # Only vae_tiling's decision depends on the rung, and it is not applied here.
    decided = decide_switches(loaded.manifest, loaded.spec, "full", info, settings)
    _quantize(loaded, info, settings)
    if decided["sdpa"].kind == "skipped":  # switched off: diffusers' classic processor
        from diffusers.models.attention_processor import AttnProcessor

        loaded.denoiser.set_attn_processor(AttnProcessor())  # type: ignore[operator]
    if decided["channels_last"].kind == "applied":
        loaded.denoiser.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    if decided["attention_slicing"].kind == "applied":
        loaded.pipe.enable_attention_slicing()
    for name in ("sdpa", "channels_last", "attention_slicing"):
        loaded.settings.add(decided[name].kind, name, decided[name].reason)
    _taesd_preview(loaded, settings, decided["taesd_preview"])


def apply_rung_switches(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    """The switch that depends on the rung (VAE tiling, on by default off full), at placement."""
    decided = decide_switches(loaded.manifest, loaded.spec, loaded.rung, info, settings)
    tiling = decided["vae_tiling"]
    if tiling.kind == "applied":
        loaded.pipe.vae.enable_tiling()
    loaded.settings.add(tiling.kind, "vae_tiling", tiling.reason)


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
    from worker.pipelines.quantize import pick_schemes, quantize_component

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


def _taesd_preview(loaded: LoadedPipeline, settings: Settings, decision: Decision) -> None:
    """TAESD decodes a latent in milliseconds: a preview a few times per job for the client.

    A preview is a convenience: if its weights cannot be loaded the job goes on without one.
    """
    manifest, report = loaded.manifest, loaded.settings
    if decision.kind == "skipped" or manifest.taesd is None:
        report.add("skipped", "taesd_preview", decision.reason)
        return
    from diffusers import AutoencoderTiny

    try:
        source = weights_source(manifest, settings.models_dir, manifest.taesd, marker="config.json")
        taesd = AutoencoderTiny.from_pretrained(source.location, dtype=loaded.dtype)
    except Exception as exc:
        report.add("skipped", "taesd_preview", f"cannot load taesd {manifest.taesd!r}: {exc}")
        return
    # A few MB: placement puts it on the device at every rung, so previews never wait for an
    # offload (worker.pipelines.loading._place).
    loaded.preview_vae = taesd.eval()
    report.add("applied", "taesd_preview", decision.reason)


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
    manifest: Manifest,
    rung: Rung,
    info: DeviceInfo,
    settings: Settings,
    pin: bool | None = None,
    as_card: bool = False,
) -> CompilePlan:
    """The compile decision for a load at this rung, without loading anything: the request's pin
    (a replay's) when it has one, else the manifest's policy over the compile switch. A pin
    this worker cannot honour raises PinRefused naming why. A simulated card (KILN_DEVICE_PROFILE)
    does not compile on this CPU; as_card decides as the card itself would (`doctor --profile`)."""
    if pin is not None:
        return _pinned_plan(manifest, rung, settings, pin)
    policy, value = manifest.compile, switch(manifest, settings, "compile")
    compiles = rungs.rung_spec(rung).compiles
    required = policy == "required" and compiles
    if policy == "off":
        return CompilePlan(False, "switched off by the manifest (compile: off)")
    if not compiles:
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
    simulated_here = info.simulated and info.torch_device == "cpu" and not as_card
    if value == "auto" and not required and simulated_here:
        return CompilePlan(
            False,
            f"auto: {info.simulated} would compile at full; not run on the real device (cpu),"
            " where the tiny UNet takes 76 s to compile",
        )
    return CompilePlan(True, must=required)


def _pinned_plan(manifest: Manifest, rung: Rung, settings: Settings, pin: bool) -> CompilePlan:
    """A pin overrides auto (compile on a CPU too, when asked) but never the manifest's off or
    required, the off switch an operator set, or the rule that only full compiles (the rungs
    whose row compiles)."""
    compiles = rungs.rung_spec(rung).compiles
    if not pin:
        if manifest.compile == "required" and compiles:
            raise PinRefused(
                f"model {manifest.id}: the request pins compile off, but its manifest requires"
                " compile at rung full (compile: required)"
            )
        return CompilePlan(False, "pinned off by the request (compile=false)")
    if manifest.compile == "off":
        why = "its manifest switches compile off (compile: off)"
    elif not compiles:
        why = f"it runs at rung {rung} here, and compile runs only at {rungs.compiling()}"
    elif switch(manifest, settings, "compile") == "off":
        why = "this worker's compile switch is off (KILN_COMPILE=off or the manifest)"
    else:
        return CompilePlan(True, must=True)
    raise PinRefused(f"model {manifest.id}: the request pins compile on, but {why}")


def apply_compile(loaded: LoadedPipeline, info: DeviceInfo, settings: Settings) -> None:
    """torch.compile only where the rung's row compiles (full): accelerate's offload hooks and
    Inductor fight each other."""
    manifest, report = loaded.manifest, loaded.settings
    plan = compile_plan(manifest, loaded.rung, info, settings, loaded.compile_pin)
    if not plan.compile:
        report.add("skipped", "compile", plan.reason)
        return
    from worker.pipelines.compile import compile_available, compile_denoiser

    unavailable = compile_available()
    try:
        if unavailable is not None:
            raise RuntimeError(unavailable)
        how = compile_denoiser(
            loaded.denoiser,
            settings,
            manifest.compile_method,
            step_cache=manifest.step_cache is not None,
        )
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
    from worker.pipelines.compile import is_compile_failure, uncompile_denoiser

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
