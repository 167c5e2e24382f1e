"""Device profiles: every tiny family renders under every profile (KILN_DEVICE_PROFILE) on this
CPU, and each render makes the decisions that card would: dtype, rung, channels_last, the VAE
upcast, compile, quantize. The rung is forced as low as the real model of that family would sit
on the card (the tiny models fit anywhere), through KILN_VRAM_BUDGET_GB."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import kiln
from worker.manifest import load_manifests
from worker.memory.device import DeviceInfo, probe
from worker.memory.ladder import pick_rung
from worker.ops.plan import plan_model
from worker.pipelines.loading import fit_for
from worker.profiles import GIB, PROFILES, profile_for
from worker.render.context import LocalContext
from worker.render.renderer import Renderer
from worker.render.timings import TimingRecord

CPU_INFO = DeviceInfo("cpu", "cpu", "test cpu", 8 * 2**30, 4 * 2**30, bf16=False, fp16=False)
# The real model each tiny family stands in for: its memory needs decide the rung.
REAL_MODEL = {
    "sd15": "sd-turbo",
    "sdxl": "sdxl-base",
    "sd3": "sd35-medium",
    "flux": "flux1-dev",
    "flux2": "flux2-klein-4b",
    "qwenimage": "qwen-image",
    "zimage": "z-image-turbo",
}
# Every shipped profile, plus a T4 with 5 GiB free (another process holds the rest).
MATRIX_PROFILES = [*PROFILES, "t4:5"]
FAMILIES = list(REAL_MODEL)
UNETS = ("sd15", "sdxl")
# Budgets that land a tiny model (full 0.1 GB, partial 0.08, model_offload 0.05, group_offload
# 0.02 at 16 bit; twice that in fp32) on a rung.
TINY_BUDGET = {"full": None, "partial": 0.09, "model_offload": 0.07, "group_offload": 0.03}
# The rungs the real models get where they do not fit fully (all others: full), as docs/workers.md's
# table of plans shows: a T4 plans with 15 GiB free = 16.11 GB - 0.5 reserve = 15.61 GB, at 5 GiB
# free with 4.87 GB, and the flow transformers run fp32 there (no bf16), which doubles their needs.
LOW_RUNGS = {
    ("sd3", "t4"): "group_offload",  # sd35-medium: model_offload needs 25.0 in fp32
    ("flux", "t4"): "model_offload",  # flux1-dev: int8 transformer 11.9 + fp32 working 1.4
    ("flux2", "t4"): "group_offload",
    ("qwenimage", "t4"): "group_offload",
    ("qwenimage", "l4"): "model_offload",  # qwen-image: 37.75 GB resident even quantized
    ("qwenimage", "mps"): "model_offload",
    ("zimage", "t4"): "group_offload",
    # z-image-turbo: 26 GB resident; partial needs 20.8 at its least (its row's default_share of
    # min_vram_gb, worker.memory.rungs), within the L4's 23 GiB free.
    ("zimage", "l4"): "partial",
    ("zimage", "mps"): "partial",
    **{(family, "t4:5"): "group_offload" for family in FAMILIES if family != "sd15"},
}
FP8_CARDS = {name for name, profile in PROFILES.items() if profile.fp8}


def expected_dtype(family: str, profile: str) -> str:
    if profile.startswith("t4"):
        return "fp16" if family in UNETS else "fp32"  # T4 lacks bf16; the rest must not run fp16
    return "bf16"


def real_rung(family: str, profile: str, settings: Any) -> str:
    """The rung the family's real model gets on the card, by the ladder's own arithmetic."""
    as_card = settings.model_copy(update={"device_profile": profile})
    info = probe(as_card)
    manifest = load_manifests(settings.manifests, [REAL_MODEL[family]])[REAL_MODEL[family]]
    usable = info.free_bytes / 1e9 - settings.vram_reserve_gb
    return pick_rung(manifest, usable, "auto", fit_for(manifest, info, as_card)).rung


# `make test` renders every family as a T4 (fp16 or fp32, the low rungs) and as an H100 (bf16,
# float8, full); the other cards' 42 renders (1.5 minutes of CPU) run in `make test-slow`.
QUICK_PROFILES = ("t4", "h100")


@pytest.mark.parametrize(
    "profile",
    [
        p if p in QUICK_PROFILES else pytest.param(p, marks=pytest.mark.slow)
        for p in MATRIX_PROFILES
    ],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_renders_as_the_profiled_card_would(
    family: str, profile: str, make_settings: Any
) -> None:
    rung = real_rung(family, profile, make_settings())
    assert rung == LOW_RUNGS.get((family, profile), "full")
    model = f"tiny-{family}"
    budget = TINY_BUDGET[rung]
    if budget is not None and expected_dtype(family, profile) == "fp32":
        budget *= 2
    settings = make_settings(device_profile=profile, vram_budget_gb=budget)
    finished: list[TimingRecord] = []
    manifests = load_manifests(settings.manifests, [model])
    renderer = Renderer(settings, manifests, on_record=finished.append)
    name = profile.partition(":")[0]
    assert renderer.info.simulated == name and renderer.info.torch_device == "cpu"

    result = renderer.render(
        {"model": model, "prompt": "a fox", "steps": 2, "seed": 1}, LocalContext(f"{model}-{name}")
    )
    [record] = finished
    assert record.status == "done"
    assert result.simulated_device == record.simulated_device == name
    assert (result.rung, result.dtype) == (rung, expected_dtype(family, profile))
    applied, skipped = result.settings.names("applied"), result.settings.names("skipped")
    # channels_last: the conv UNets on every accelerator; the transformers never.
    assert ("channels_last" in applied) == (family in UNETS)
    # The fp16 SDXL VAE is held in fp32 from load, whatever the rung.
    assert ("vae_upcast" in applied) == (family == "sdxl" and profile.startswith("t4"))
    loaded = renderer.cache.get(model)
    assert loaded is not None
    if "vae_upcast" in applied:
        assert next(loaded.pipe.vae.parameters()).dtype.__str__() == "torch.float32"
    # compile: the card would compile at full; on this CPU it is reported, not run.
    compile_note = next(n.reason for n in result.settings.skipped if n.name == "compile")
    if rung == "full":
        assert f"{name} would compile at full" in compile_note
    else:
        assert "offload hooks and Inductor conflict" in compile_note
    assert not result.compiled and "compile" in skipped
    if family == "sd3":
        assert result.quantized == {"text_encoder_3": "int8"}
    if family in ("flux", "qwenimage"):
        # [float8, int8]: float8 where the card has fp8 math, run for real on this CPU's tensors.
        scheme = "float8" if name in FP8_CARDS else "int8"
        assert result.quantized == {"transformer": scheme}
    # `kiln doctor --profile` decides without loading; it must say what this load did.
    plan = plan_model(loaded.manifest, renderer.info, settings, renderer.planner.usable_gb())
    assert (plan.rung, plan.dtype) == (result.rung, result.dtype)
    for switch in ("channels_last", "vae_tiling", "vae_upcast"):
        assert (switch in plan.names("applied")) == (switch in applied), switch


def test_profile_names_and_free_memory_are_checked(make_settings: Any) -> None:
    from pydantic import ValidationError

    from worker.memory.device import simulate

    assert make_settings(device_profile=" T4 ").device_profile == "t4"
    with pytest.raises(ValidationError, match=r"unknown device profile 'v100'.*t4, l4, a100"):
        make_settings(device_profile="v100")
    with pytest.raises(ValidationError, match=r"free memory must be in \(0, 16.0\] GiB"):
        make_settings(device_profile="t4:20")
    info = simulate("t4:9.5", simulate("h100", CPU_INFO))
    assert (info.simulated, info.free_bytes, info.torch_device) == ("t4", int(9.5 * GIB), "cpu")
    assert [profile_for(n) for n in ("Tesla T4", "NVIDIA H200", "AMD Instinct MI300X")] == [
        "t4",
        "h200",
        "mi300",
    ]
    for profile in PROFILES.values():
        assert profile.source and 0 < profile.free_gib < profile.total_gib


def test_doctor_profile_prints_each_models_plan_and_fails_where_one_cannot_run(
    kiln_env: dict[str, str],
) -> None:
    done = kiln("doctor", "--profile", "t4:2", env=kiln_env)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "profile       t4: decisions as Tesla T4 (simulated)" in out and "source  " in out
    assert "  sdxl-base          group_offload  fp16     3.00 GB  NO" in out
    assert "  tiny-sd15          full           fp16     0.10 GB  yes" in out
    assert "CANNOT RUN    needs 3.00 GB even at group_offload; 1.65 GB usable" in out
    unknown = kiln("doctor", "--profile", "v100", env=kiln_env)
    assert unknown.returncode == 2 and "unknown device profile 'v100'" in unknown.stdout
