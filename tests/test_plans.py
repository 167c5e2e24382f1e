"""`kiln doctor --profile`: the plan every card gets for the models people run now. The table in
docs/workers.md is held to plan_model, and the command line names a rung, dtype and quantization for
flux1-dev and qwen-image on an L4 and a T4, as text and as JSON."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.conftest import MANIFESTS, ROOT, kiln
from worker.manifest import load_manifests
from worker.memory.device import probe
from worker.memory.ladder import Fit, rung_need_gb, usable_gb
from worker.ops.plan import plan_manifests, plan_model
from worker.settings import Settings

ROW = re.compile(r"^\| `([\w.-]+)` \| `(\w+)` \| (\w+) \| (\w+) \| ([^|]+) \| ([\d.]+) GB \|$")


def _table_rows() -> list[tuple[str, ...]]:
    text = (ROOT / "docs" / "workers.md").read_text(encoding="utf-8")
    return [m.groups() for line in text.splitlines() if (m := ROW.match(line.strip()))]


def _plan(model: str, profile: str) -> Any:
    settings = Settings(device_profile=profile, manifests=MANIFESTS)
    info = probe(settings)
    usable = usable_gb(info.free_bytes, 0, settings.vram_reserve_gb, settings.vram_budget_gb, 0)
    return plan_model(load_manifests(MANIFESTS, [model])[model], info, settings, usable)


def test_the_documented_table_is_what_the_code_plans() -> None:
    rows = _table_rows()
    profiles = {"t4", "l4", "a100", "h200", "mi300", "mps"}
    assert {(m, p) for m, p, *_ in rows} >= {
        (m, p) for m in ("flux1-dev", "qwen-image") for p in profiles
    }
    for model, profile, rung, dtype, quantized, resident in rows:
        plan = _plan(model, profile)
        shown = ", ".join(f"{c} {s or 'none'}" for c, s in plan.quantize.items()) or "-"
        assert (plan.rung, plan.dtype, shown.strip()) == (rung, dtype, quantized.strip()), model
        assert f"{plan.resident_gb:.1f}" == resident, (model, profile)
        assert plan.runs, (model, profile, plan.problems)


def test_quantization_follows_the_card() -> None:
    # float8 where the card has fp8 math, int8 elsewhere; the reason names what was passed over.
    l4, a100 = _plan("flux1-dev", "l4"), _plan("flux1-dev", "a100")
    assert l4.quantize["transformer"] == "float8" and a100.quantize["transformer"] == "int8"
    assert "float8 needs fp8 math" in a100.quantize_reasons["transformer"]
    assert "8.0" in a100.quantize_reasons["transformer"]
    assert _plan("flux1-dev", "t4").dtype == "fp32"  # no bf16, and FLUX must not run in fp16


def test_quantized_components_count_at_their_own_size() -> None:
    manifest = load_manifests(MANIFESTS, ["flux1-dev"])["flux1-dev"]
    sizes = manifest.component_gb
    plain = rung_need_gb(manifest, "full")
    assert plain == pytest.approx(manifest.min_vram_gb)
    float8 = rung_need_gb(manifest, "full", Fit(quantized={"transformer": "float8"}))
    assert plain - float8 == pytest.approx(sizes["transformer"] / 2)
    int4 = rung_need_gb(manifest, "full", Fit(quantized={"transformer": "int4"}))
    assert plain - int4 == pytest.approx(sizes["transformer"] * 3 / 4)
    # model_offload holds one component at a time: only the largest one's saving counts.
    offload = rung_need_gb(manifest, "model_offload")
    t5_only = rung_need_gb(manifest, "model_offload", Fit(quantized={"text_encoder_2": "int8"}))
    assert t5_only == pytest.approx(offload)
    # fp32 doubles what is not quantized, and leaves a quantized weight at its own bytes.
    fp32 = rung_need_gb(manifest, "full", Fit(fp32=True, quantized={"transformer": "int8"}))
    assert fp32 == pytest.approx(2 * float8 - sizes["transformer"] / 2)
    # A manifest without component sizes scales as a whole, as before.
    sd3 = load_manifests(MANIFESTS, ["sd35-medium"])["sd35-medium"]
    assert rung_need_gb(sd3, "full", Fit(fp32=True)) == pytest.approx(2 * sd3.min_vram_gb)


@pytest.mark.parametrize("profile", ["l4", "t4"])
def test_doctor_profile_names_rung_dtype_and_quantization(
    profile: str, kiln_env: dict[str, str]
) -> None:
    done = kiln("doctor", "--profile", profile, "--json", env=kiln_env)
    plans = {p["model"]: p for p in json.loads(done.stdout)}
    # A T4 has no bf16, so the video transformers (never fp16) hold fp32 weights: twice their
    # 16-bit figures, over its 15.6 GB even at group_offload. doctor exits 1 naming them.
    cannot = {model for model, plan in plans.items() if not plan["runs"]}
    assert cannot == ({"wan2.2-ti2v-5b", "ltx-video"} if profile == "t4" else set())
    assert done.returncode == (1 if cannot else 0), done.stdout[-2000:] + done.stderr[-2000:]
    assert all("even at group_offload" in plans[model]["reason"] for model in cannot)
    for model in ("flux1-dev", "qwen-image"):
        plan = plans[model]
        assert set(plan) >= {"model", "runs", "rung", "dtype", "quantize", "resident_gb", "reason"}
        expected = _plan(model, profile)
        assert (plan["rung"], plan["dtype"], plan["quantize"]) == (
            expected.rung,
            expected.dtype,
            expected.quantize,
        )
        assert plan["runs"] and plan["resident_gb"] > 0
    text = kiln("doctor", "--profile", profile, env=kiln_env).stdout
    assert "model flux1-dev" in text and "quantize      transformer:" in text


def test_doctor_profile_exits_1_naming_a_model_that_cannot_run(kiln_env: dict[str, str]) -> None:
    # qwen-image on a T4 with 3 GiB free: even group_offload's fp32 need does not fit.
    done = kiln("doctor", "--profile", "t4:3", "--json", env=kiln_env)
    assert done.returncode == 1
    plan = next(p for p in json.loads(done.stdout) if p["model"] == "qwen-image")
    assert not plan["runs"] and "even at group_offload" in plan["reason"]


def test_a_gguf_variant_says_what_its_file_saves_against_the_bf16_manifest() -> None:
    settings = Settings(device_profile="l4", manifests=MANIFESTS)
    info = probe(settings)
    usable = usable_gb(info.free_bytes, 0, settings.vram_reserve_gb, settings.vram_budget_gb, 0)
    plans = {plan.model: plan for plan in plan_manifests(settings, info, usable)[0]}
    q4 = plans["flux1-dev-gguf-q4"].variant
    assert q4.startswith("against flux1-dev: transformer GGUF 6.81 GB against 23.8 GB"), q4
    assert "saves 16.99 GB" in q4 and f"{plans['flux1-dev'].resident_gb:.2f} GB" in q4
    assert plans["flux1-dev"].variant == ""  # the base itself is no variant
