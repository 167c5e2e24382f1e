"""A rung is one row of worker.memory.rungs.TABLE and a family one row of api_client.families with
its FamilySpec: rows a test registers itself (a fake rung, a fake family) are walked by the ladder,
planned by `kiln doctor --profile`, decided by the switches and placed and loaded, with no other
edit."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, get_args

import pytest
import torch

from api_client import families as rows
from api_client.manifest import Family, Manifest
from api_client.schema import RUNGS, Attempt, SettingsReport
from tests.conftest import MANIFESTS
from worker.manifest import load_manifests
from worker.memory import rungs
from worker.memory.device import DeviceInfo, probe
from worker.memory.faults import FaultPlan
from worker.memory.ladder import Fit, Ladder, lower_rung, pick_rung, rung_need_gb, usable_gb
from worker.memory.rungs import RungSpec
from worker.ops.plan import plan_model
from worker.pipelines import families
from worker.pipelines.families import SPECS, FamilySpec
from worker.pipelines.loading import fit_for, load_pipeline, place_again
from worker.pipelines.pull import _pipeline_fetch
from worker.pipelines.resident import LoadedPipeline
from worker.pipelines.switches import compile_plan, decide_switches
from worker.settings import Settings

FAKE = "half_offload"  # between model_offload and group_offload


def test_the_tables_are_the_contracts_names() -> None:
    """Adding a rung or a family names it in the public contract too (api_client), and a family
    brings its tiny model (sd2 renders with sd15's very spec, so sd15's tiny model covers it)."""
    from worker.pipelines.tiny import TINY_FAMILIES

    assert rungs.names() == RUNGS
    # Every diffusion family has a spec; an upscaler is no pipeline (worker.pipelines.upscale).
    assert set(SPECS) == set(get_args(Family)) - {"upscaler"}
    untested = [
        f for f, spec in SPECS.items() if all(SPECS.get(t) is not spec for t in TINY_FAMILIES)
    ]
    assert untested == []
    with pytest.raises(ValueError, match="rungs: full, partial, model_offload, group_offload"):
        rungs.rung_spec("quarter")


def _placed(calls: list[tuple[Any, torch.device, bool]]) -> Any:
    def place(loaded: Any, target: torch.device, streams: bool) -> None:
        calls.append((loaded, target, streams))
        loaded.pipe.to(target)

    return place


def _with_fake_rung(
    monkeypatch: pytest.MonkeyPatch, calls: list[tuple[Any, torch.device, bool]] | None = None
) -> RungSpec:
    """A rung of its own: 40 % of min_vram_gb, the VAE alone held, placed by its own function."""
    fake = RungSpec(
        FAKE,  # type: ignore[arg-type]  # not in the Rung literal: a test's row
        default_share=0.4,
        holds=lambda sizes, _denoiser: {c: 1.0 for c in sizes if c == "vae"},
        place=_placed([] if calls is None else calls),
        note="half the blocks streamed, {streams}",
    )
    table = rungs.TABLE
    monkeypatch.setattr(rungs, "TABLE", (*table[:3], fake, table[3]))
    return fake


def _plain(manifest: Manifest, min_vram_gb: float = 10.0) -> Manifest:
    """The manifest with one declared figure: every rung's need is its row's share of it."""
    return manifest.model_copy(
        update={"min_vram_gb": min_vram_gb, "rung_vram_gb": {}, "component_gb": {}}
    )


def _flux() -> Manifest:
    return load_manifests(MANIFESTS, ["flux1-dev"])["flux1-dev"]


def test_the_ladder_walks_a_registered_rung(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_fake_rung(monkeypatch)
    manifest = _plain(_flux())
    # full 10, partial 8, model_offload 6, half_offload 4, group_offload 2.5 GB.
    choice = pick_rung(manifest, 5.0, "auto")
    assert choice.rung == FAKE and choice.reason == "needs 4.00 GB, 5.00 GB usable"
    assert pick_rung(manifest, 3.0, "auto").rung == "group_offload"
    assert pick_rung(manifest, 99.0, FAKE).reason == f"pinned by KILN_MEMORY_MODE={FAKE}"
    assert lower_rung("model_offload") == FAKE and lower_rung(FAKE) == "group_offload"  # type: ignore[arg-type]
    # With component sizes its need follows its own holds: the VAE alone counts at its own
    # (here quantized) size, beside its share's working memory.
    sized = _flux().model_copy(update={"rung_vram_gb": {}})
    need = rung_need_gb(sized, FAKE, Fit(quantized={"vae": "int8"}))  # type: ignore[arg-type]
    assert need == pytest.approx(sized.min_vram_gb * 0.4 - sized.component_gb["vae"] / 2)

    # The loading rules descend through it, and a drill can name it.
    attempts: list[Attempt] = []
    tried: list[str] = []

    def load(rung: str) -> str:
        tried.append(rung)
        if rung == "model_offload":
            raise torch.OutOfMemoryError("CUDA out of memory (drill)")
        return rung

    assert Ladder("m", "auto", attempts).load("model_offload", load, reclaim=lambda: None) == FAKE  # type: ignore[arg-type]
    assert tried == ["model_offload", FAKE]
    assert [(a.rung, a.outcome) for a in attempts] == [("model_offload", "oom")]
    with pytest.raises(torch.OutOfMemoryError):
        FaultPlan.parse(f"oom@load:{FAKE}").check("load", FAKE)


def _card(profile: str, **overrides: Any) -> tuple[DeviceInfo, Settings, float]:
    settings = Settings(device_profile=profile, manifests=MANIFESTS, **overrides)
    info = probe(settings)
    usable = usable_gb(info.free_bytes, 0, settings.vram_reserve_gb, settings.vram_budget_gb, 0)
    return info, settings, usable


def test_doctor_plans_and_the_switches_decide_from_the_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _with_fake_rung(monkeypatch)
    info, settings, _usable = _card("l4")
    manifest = _plain(_flux(), min_vram_gb=40.0)  # the L4's usable memory fits 40 % of it
    plan = plan_model(manifest, info, settings, 17.0)
    assert plan.rung == FAKE and plan.resident_gb == pytest.approx(16.0)
    switches = {name: (kind, reason) for kind, name, reason in plan.switches}
    assert switches[FAKE] == ("applied", "half the blocks streamed, stream prefetch")
    assert switches["vae_tiling"] == ("applied", f"auto: offload rung {FAKE}")
    assert switches["compile"][0] == "skipped" and FAKE in switches["compile"][1]
    # The row decides: a compiling, untiled row of the same name compiles and decodes whole.
    compiling = replace(rungs.rung_spec(FAKE), compiles=True, tiles_vae=False)
    monkeypatch.setattr(rungs, "TABLE", (*rungs.TABLE[:3], compiling, rungs.TABLE[4]))
    on = Settings(device_profile="l4", manifests=MANIFESTS, compile="on")
    assert compile_plan(manifest, FAKE, info, on, as_card=True).compile  # type: ignore[arg-type]
    decided = decide_switches(manifest, SPECS["flux"], FAKE, info, on)  # type: ignore[arg-type]
    assert decided["vae_tiling"].kind == "skipped"


def test_a_registered_rung_places_by_its_row(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    calls: list[tuple[Any, torch.device, bool]] = []
    _with_fake_rung(monkeypatch, calls)
    info = probe(settings)
    manifest = load_manifests(settings.manifests, ["tiny-sd15"])["tiny-sd15"]
    loaded = load_pipeline(manifest, FAKE, info, settings, FaultPlan())  # type: ignore[arg-type]
    assert loaded.rung == FAKE and calls == [(loaded, torch.device("cpu"), False)]
    assert ("vae_tiling", f"auto: offload rung {FAKE}") in [
        (n.name, n.reason) for n in loaded.settings.applied
    ]
    place_again(loaded, info, FaultPlan())  # from the RAM cache: the same row places it again
    assert len(calls) == 2


def _renamed(manifest: Manifest, family: str, denoiser: str) -> Manifest:
    """flux1-dev with its transformer called denoiser and its family called family."""

    def rename(table: dict[str, Any]) -> dict[str, Any]:
        return {denoiser if c == "transformer" else c: v for c, v in table.items()}

    return manifest.model_copy(
        update={
            "family": family,
            "component_gb": rename(manifest.component_gb),
            "quantize": rename(manifest.quantize),
        }
    )


def _register(monkeypatch: pytest.MonkeyPatch, name: str, like: str, spec: FamilySpec) -> None:
    """A family of its own: its row (like another's) and its worker's spec."""
    monkeypatch.setitem(rows.FAMILIES, name, replace(rows.FAMILIES[like], name=name))
    monkeypatch.setitem(families.SPECS, name, spec)


def _with_fake_family(monkeypatch: pytest.MonkeyPatch, **fields: Any) -> FamilySpec:
    spec = replace(SPECS["flux"], denoiser="prior", **fields)
    _register(monkeypatch, "fakefam", "flux", spec)
    return spec


def test_a_registered_family_plans_with_its_own_denoiser(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_fake_family(monkeypatch)
    info, settings, usable = _card("l4", memory_mode="partial")
    real = plan_model(_flux(), info, settings, usable)
    fake = _renamed(_flux(), "fakefam", "prior")
    assert fit_for(fake, info, settings).denoiser == "prior"
    plan = plan_model(fake, info, settings, usable)
    # partial holds a quarter of the denoiser: the renamed one, so the need is flux1-dev's own.
    assert plan.rung == "partial" and plan.resident_gb == pytest.approx(real.resident_gb)
    assert plan.quantize == {"prior": "float8", "text_encoder_2": "int8"}
    # Had the denoiser come from anywhere but the spec, the renamed one would count whole.
    monkeypatch.setitem(families.SPECS, "fakefam", SPECS["flux"])
    assert abs(plan_model(fake, info, settings, usable).resident_gb - real.resident_gb) > 5


def test_a_registered_familys_spec_decides_precision_vae_and_fetch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _with_fake_family(monkeypatch, fp16_safe=True, vae_upcast=True, dropped=("watermarker",))
    info, settings, usable = _card("t4")
    fake = _renamed(_flux(), "fakefam", "prior").model_copy(update={"vae": None})
    plan = plan_model(fake, info, settings, usable)
    # flux1-dev must not run in fp16 (fp32 on a T4); this family may, and upcasts its VAE.
    assert (_flux().family, plan_model(_flux(), info, settings, usable).dtype) == ("flux", "fp32")
    assert plan.dtype == "fp16"
    assert ("applied", "vae_upcast") in [(kind, name) for kind, name, _ in plan.switches]
    assert "watermarker/*" in _pipeline_fetch(fake).ignore_patterns
    assert "watermarker/*" not in _pipeline_fetch(_flux()).ignore_patterns


def test_a_loaded_pipeline_carries_its_familys_spec(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    """Read once at load, then read from the pipeline: encode, decode, denoiser, modes."""
    spec = replace(
        SPECS["sd15"],
        pipeline_class="StableDiffusionImg2ImgPipeline",
        modes={},
        dropped=("text_encoder",),  # loaded without it: from_pretrained reads the spec
        load_options={},
    )
    _register(monkeypatch, "fakesd", "sd15", spec)
    manifest = load_manifests(settings.manifests, ["tiny-sd15"])["tiny-sd15"]
    manifest = manifest.model_copy(update={"family": "fakesd"})
    loaded = load_pipeline(manifest, "full", probe(settings), settings, FaultPlan())
    assert loaded.spec is spec and type(loaded.pipe).__name__ == spec.pipeline_class
    assert loaded.pipe.text_encoder is None and loaded.pipe.unet is not None
    monkeypatch.delitem(families.SPECS, "fakesd")  # nothing after the load looks it up again
    assert loaded.denoiser is loaded.pipe.unet
    bare = LoadedPipeline(
        manifest.model_copy(update={"family": "sd15"}),
        None,
        "full",
        torch.float32,
        SettingsReport(),
    )
    assert bare.spec is SPECS["sd15"]
