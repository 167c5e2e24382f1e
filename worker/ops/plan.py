"""What a card would do with each manifest, decided without loading a weight: the rung, the
dtype, each switch and quantize scheme, with reasons, and whether the model can run there at
all. `kiln doctor --profile NAME` prints it. The rules are the load's own, called here:
choose_dtype and fit_for (worker.pipelines.loading), decide_switches and compile_plan
(worker.pipelines.switches), each rung's row (worker.memory.rungs) and the family's spec
(worker.pipelines.families); tests/test_profiles.py holds a plan to a real load on the tiny
models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from api_client.manifest import Manifest
from api_client.schema import RenderRequest, Rung
from worker.errors import CompileRequired
from worker.memory import rungs
from worker.memory.device import DeviceInfo
from worker.memory.ladder import pick_rung, rung_need_gb
from worker.pipelines import step_cache
from worker.pipelines.compile import compile_available
from worker.pipelines.families import FamilySpec, spec_for
from worker.pipelines.loading import choose_dtype, fit_for
from worker.pipelines.quantize import pick_schemes
from worker.pipelines.resident import DTYPE_NAMES
from worker.pipelines.switches import compile_plan, decide_switches, switch
from worker.settings import Settings

Kind = Literal["applied", "skipped"]


@dataclass
class ModelPlan:
    model: str
    rung: Rung
    rung_reason: str
    dtype: str
    dtype_reason: str
    resident_gb: float = 0.0  # what the rung holds on the device, by the ladder's arithmetic
    switches: list[tuple[Kind, str, str]] = field(default_factory=list)  # (kind, name, reason)
    quantize: dict[str, str | None] = field(default_factory=dict)  # component -> scheme or None
    quantize_reasons: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # why it cannot run on this card
    # A variant whose components come from their own files (a GGUF transformer): what the files
    # save against the manifest of the same source without them, and what that buys on the card.
    variant: str = ""

    @property
    def runs(self) -> bool:
        return not self.problems

    def names(self, kind: Kind) -> list[str]:
        return [name for k, name, _ in self.switches if k == kind]

    def as_json(self) -> dict[str, Any]:
        """`kiln doctor --profile NAME --json`: one object per manifest (the contract's keys)."""
        return {
            "model": self.model,
            "runs": self.runs,
            "rung": self.rung,
            "dtype": self.dtype,
            "quantize": dict(self.quantize),
            "resident_gb": round(self.resident_gb, 2),
            "reason": "; ".join(self.problems) if self.problems else self.rung_reason,
        }


def plan_model(
    manifest: Manifest, info: DeviceInfo, settings: Settings, usable: float
) -> ModelPlan:
    """The decisions a load of manifest would make on info's card with usable GB to plan with."""
    if manifest.family_row.tiles:
        return _tiled_plan(manifest, info, usable)
    dtype, dtype_reason = choose_dtype(manifest, info)
    fit = fit_for(manifest, info, settings)
    spec = spec_for(manifest)
    choice = pick_rung(manifest, usable, settings.memory_mode, fit)
    plan = ModelPlan(
        manifest.id,
        choice.rung,
        choice.reason,
        DTYPE_NAMES[dtype],
        dtype_reason,
        resident_gb=rung_need_gb(manifest, choice.rung, fit),
    )
    lowest = rungs.lowest().name if settings.memory_mode == "auto" else choice.rung
    need = rung_need_gb(manifest, lowest, fit)
    if need > usable:
        plan.problems.append(f"needs {need:.2f} GB even at {lowest}; {usable:.2f} GB usable")
    if fit.fp32:
        plan.rung_reason += "; fp32 weights: twice the 16-bit figures"
    _switches(plan, manifest, spec, info, settings)
    quantize_off = switch(manifest, settings, "quantize") == "off"
    for component, pick in pick_schemes(manifest, info).items():
        plan.quantize[component] = None if quantize_off else pick.scheme
        plan.quantize_reasons[component] = "switched off" if quantize_off else pick.reason
    return plan


def _tiled_plan(manifest: Manifest, info: DeviceInfo, usable: float) -> ModelPlan:
    """An upscaler has one rung: whole on the device, its tiles halving on out of memory; its
    precision is read off the file at load (half where the architecture has it)."""
    dtype = "fp32" if not info.accelerator else "bf16" if info.bf16 else "fp16"
    plan = ModelPlan(
        manifest.id,
        "full",
        "an upscaler runs whole; out of memory halves its tiles (no offload rungs)",
        dtype,
        "half precision where the architecture has it (spandrel says at load), else fp32",
        resident_gb=manifest.min_vram_gb,
    )
    if manifest.min_vram_gb > usable:
        plan.problems.append(f"needs {manifest.min_vram_gb:.2f} GB; {usable:.2f} GB usable")
    return plan


def plan_manifests(
    settings: Settings, info: DeviceInfo, usable: float
) -> tuple[list[ModelPlan], tuple[str, ...]]:
    """Every manifest's plan on the (simulated) card, and the ids a worker would serve."""
    from api_client.manifest import load_manifest_dir

    manifests, _failures = load_manifest_dir(settings.manifests)
    plans = {m.id: plan_model(m, info, settings, usable) for m in manifests.values()}
    for manifest in manifests.values():
        base = next(
            (
                other
                for other in manifests.values()
                if manifest.components and other.source == manifest.source and not other.components
            ),
            None,
        )
        if base is not None:
            plan = plans[manifest.id]
            plan.variant = _variant(manifest, base, plan, plans[base.id])
    served = tuple(m.id for m in manifests.values() if not m.benchmark_only)
    return sorted(plans.values(), key=lambda p: p.model), served


def _variant(manifest: Manifest, base: Manifest, plan: ModelPlan, base_plan: ModelPlan) -> str:
    """What a variant's component files save against base, the same weights in the source's own
    precision, and what the card does with each: `kiln doctor --profile` shows it for a GGUF."""
    parts = []
    for name, file in manifest.components.items():
        held = base.component_gb.get(name)
        saved = f", saves {held - file.gb:.2f} GB" if held is not None else ""
        kind = "GGUF" if file.gguf else "safetensors"
        parts.append(f"{name} {kind} {file.gb:.2f} GB against {held or '?'} GB{saved}")
    return (
        f"against {base.id}: " + "; ".join(parts) + f"; here {plan.rung} holding"
        f" {plan.resident_gb:.2f} GB, {base.id} {base_plan.rung} holding"
        f" {base_plan.resident_gb:.2f} GB"
        + ("" if base_plan.runs or not plan.runs else f" ({base.id} cannot run here)")
    )


def plan_lines(plans: list[ModelPlan], served: tuple[str, ...]) -> list[str]:
    """`kiln doctor --profile`'s printout: a table of every plan, then each plan's decisions."""
    lines = ["plans", f"  {'model':<18} {'rung':<14} {'dtype':<6} {'resident':>9}  runs  quantize"]
    for plan in plans:
        runs = "yes" if plan.runs else "NO "
        note = "" if plan.model in served else " (benchmark only)"
        quantized = ", ".join(f"{c} {s or 'none'}" for c, s in plan.quantize.items()) or "-"
        lines.append(
            f"  {plan.model:<18} {plan.rung:<14} {plan.dtype:<6} {plan.resident_gb:>6.2f} GB"
            f"  {runs}   {quantized}{note}"
        )
    for plan in plans:
        lines += [
            f"model {plan.model}",
            f"  rung          {plan.rung} ({plan.rung_reason})",
            f"  dtype         {plan.dtype} ({plan.dtype_reason})",
        ]
        lines += [f"  {kind:<13} {name}: {reason}" for kind, name, reason in plan.switches]
        lines.append(f"  resident      {plan.resident_gb:.2f} GB on the device at {plan.rung}")
        if plan.variant:
            lines.append(f"  files         {plan.variant}")
        lines += [
            f"  quantize      {c}: {plan.quantize[c] or 'none'} ({why})"
            for c, why in plan.quantize_reasons.items()
        ]
        lines += [f"  CANNOT RUN    {problem}" for problem in plan.problems]
    return lines


def _switches(
    plan: ModelPlan, manifest: Manifest, spec: FamilySpec, info: DeviceInfo, settings: Settings
) -> None:
    """The load's own rules (worker.pipelines.switches) at the planned rung, plus what placement
    and the VAE add there."""
    add = plan.switches.append
    decided = decide_switches(manifest, spec, plan.rung, info, settings)
    for name in ("channels_last", "vae_tiling"):
        add((decided[name].kind, name, decided[name].reason))
    if spec.vae_upcast and plan.dtype == "fp16":
        if manifest.vae is None:
            add(("applied", "vae_upcast", "stock SDXL VAE overflows in fp16: fp32 from load"))
        else:
            add(("skipped", "vae_upcast", f"manifest vae {manifest.vae} (if force_upcast false)"))
    streams = "stream prefetch" if info.streams else "no copy streams: synchronous onload"
    note = rungs.rung_spec(plan.rung).note
    if note is not None:
        add(("applied", plan.rung, note.format(streams=streams)))
    _compile(plan, manifest, info, settings)
    if decided["taesd_preview"].kind == "applied":
        add(("applied", "taesd_preview", decided["taesd_preview"].reason))
    # A job at the manifest's default steps; a request may still ask for it or against it.
    default = RenderRequest(model=manifest.id, prompt="-", steps=manifest.steps.default)
    cache = step_cache.decide(manifest, settings, default)
    add((cache.kind, "step_cache", f"{cache.reason} (at the default {default.steps} steps)"))


def _compile(plan: ModelPlan, manifest: Manifest, info: DeviceInfo, settings: Settings) -> None:
    """compile_plan as the card would decide it, then whether this stack can compile at all."""
    try:
        decision = compile_plan(manifest, plan.rung, info, settings, as_card=True)
    except CompileRequired as exc:
        plan.problems.append(str(exc))
        return
    if not decision.compile:
        plan.switches.append(("skipped", "compile", decision.reason))
        return
    missing = compile_available()
    if missing is not None:
        if decision.must:
            plan.problems.append(f"compile is required and unavailable: {missing}")
        else:
            plan.switches.append(("skipped", "compile", f"unavailable: {missing}"))
        return
    how = "required by the manifest" if decision.must else f"at the {rungs.compiling()} rung"
    plan.switches.append(("applied", "compile", how))
