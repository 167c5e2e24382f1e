"""What a card would do with each manifest, decided without loading a weight: the rung, the
dtype, each switch and quantize scheme, with reasons, and whether the model can run there at
all. `kiln doctor --profile NAME` prints it. The rules are the load's own, called here:
choose_dtype and fit_for (worker.loading), decide_switches and compile_plan (worker.switches);
tests/test_profiles.py holds a plan to a real load on the tiny models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from api_client.manifest import Manifest
from api_client.schema import Rung
from worker.compile import compile_available
from worker.device import DeviceInfo
from worker.errors import CompileRequired
from worker.ladder import pick_rung, rung_need_gb
from worker.loading import choose_dtype, fit_for
from worker.quantize import pick_schemes
from worker.resident import DTYPE_NAMES
from worker.settings import Settings
from worker.switches import compile_plan, decide_switches, switch

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

    @property
    def runs(self) -> bool:
        return not self.problems

    def names(self, kind: Kind) -> list[str]:
        return [name for k, name, _ in self.switches if k == kind]

    def as_json(self) -> dict[str, Any]:
        """`kiln doctor --profile NAME --json`: one object per manifest (DESIGN.md's keys)."""
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
    dtype, dtype_reason = choose_dtype(manifest, info)
    fit = fit_for(manifest, info, settings)
    choice = pick_rung(manifest, usable, settings.memory_mode, fit)
    plan = ModelPlan(
        manifest.id,
        choice.rung,
        choice.reason,
        DTYPE_NAMES[dtype],
        dtype_reason,
        resident_gb=rung_need_gb(manifest, choice.rung, fit),
    )
    lowest: Rung = "group_offload" if settings.memory_mode == "auto" else choice.rung
    need = rung_need_gb(manifest, lowest, fit)
    if need > usable:
        plan.problems.append(f"needs {need:.2f} GB even at {lowest}; {usable:.2f} GB usable")
    if fit.fp32:
        plan.rung_reason += "; fp32 weights: twice the 16-bit figures"
    _switches(plan, manifest, info, settings)
    quantize_off = switch(manifest, settings, "quantize") == "off"
    for component, pick in pick_schemes(manifest, info).items():
        plan.quantize[component] = None if quantize_off else pick.scheme
        plan.quantize_reasons[component] = "switched off" if quantize_off else pick.reason
    return plan


def _switches(plan: ModelPlan, manifest: Manifest, info: DeviceInfo, settings: Settings) -> None:
    """The load's own rules (worker.switches) at the planned rung, plus what placement and the
    VAE add there."""
    add = plan.switches.append
    decided = decide_switches(manifest, plan.rung, info, settings)
    for name in ("channels_last", "vae_tiling"):
        add((decided[name].kind, name, decided[name].reason))
    if manifest.family == "sdxl" and plan.dtype == "fp16":
        if manifest.vae is None:
            add(("applied", "vae_upcast", "stock SDXL VAE overflows in fp16: fp32 from load"))
        else:
            add(("skipped", "vae_upcast", f"manifest vae {manifest.vae} (if force_upcast false)"))
    streams = "stream prefetch" if info.streams else "no copy streams: synchronous onload"
    if plan.rung == "partial":
        why = "as many denoiser blocks resident as fit (counted from the loaded blocks' bytes),"
        add(("applied", "partial", f"{why} the rest streamed at leaf level, {streams}"))
    if plan.rung == "group_offload":
        add(("applied", "group_offload", f"leaf level, {streams}"))
    _compile(plan, manifest, info, settings)
    if decided["taesd_preview"].kind == "applied":
        add(("applied", "taesd_preview", decided["taesd_preview"].reason))


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
    how = "required by the manifest" if decision.must else "at the full rung"
    plan.switches.append(("applied", "compile", how))
