"""Step caches (issue 29 items 2-3): the manifest's step_cache, the switch and the request's pin
decide per job; a cached job reuses steps and says how many; a threshold that allows no reuse
gives the uncached pixels; every mode of FLUX.1 and Qwen-Image runs it, whether or not its
pipeline names the cache context; under compile the switch flips with no recompile (slow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from redis import Redis

from api_client import RequestRejected
from api_client.manifest import Manifest
from api_client.resolve import resolve_request
from api_client.schema import RenderRequest, RenderResult
from api_client.step_caches import FirstBlockCache
from tests.conftest import MANIFESTS, ROOT
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.errors import PinRefused
from worker.files.details import read_details
from worker.manifest import load_manifests
from worker.pipelines.step_cache import StepCache, decide, names_its_contexts
from worker.render.context import LocalContext

FLUX = "tiny-flux"
JOB = {"model": FLUX, "prompt": "a kiln at dusk", "steps": 8, "seed": 11}


def _manifest(**changes: Any) -> dict[str, Any]:
    """tiny-flux's manifest as a dict, with changes."""
    [manifest] = load_manifests(MANIFESTS, [FLUX]).values()
    return {**manifest.model_dump(exclude_defaults=True), **changes}


@pytest.fixture
def input_refs() -> dict[str, str]:
    """A 128 px image and a mask as inline data: URLs (the job's size, as every input must be)."""
    import base64
    import io

    from PIL import Image

    def data_url(image: Image.Image) -> str:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    mask = Image.new("L", (128, 128), 0)
    mask.paste(255, (32, 32, 96, 96))
    return {"image": data_url(Image.new("RGB", (128, 128), (90, 40, 200))), "mask": data_url(mask)}


MAG = "tiny-flux-mag"


@pytest.fixture
def exact_dir(tmp_path: Path) -> Path:
    """tiny-flux-exact: tiny-flux's weights with a threshold no step's residual stays under;
    tiny-flux-mag: tiny-flux's weights with MagCache and diffusers' FLUX.1-dev ratios."""
    directory = tmp_path / "manifests"
    directory.mkdir()
    text = (MANIFESTS / f"{FLUX}.yaml").read_text()
    cache = "step_cache: {kind: first_block, threshold: 0.5}"
    assert f"id: {FLUX}\n" in text and cache in text, "tiny-flux.yaml changed shape"
    exact = text.replace(f"id: {FLUX}\n", "id: tiny-flux-exact\n")
    (directory / "tiny-flux-exact.yaml").write_text(exact.replace("0.5}", "1.0e-9}"))
    mag = text.replace(f"id: {FLUX}\n", f"id: {MAG}\n")
    mag = mag.replace(cache, "step_cache: {kind: magcache, threshold: 0.06, mag_ratios: flux}")
    (directory / f"{MAG}.yaml").write_text(mag)
    return directory


# -- the manifest field -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step_cache", "family", "expected"),
    [
        ({"kind": "teacache", "threshold": 0.1}, "flux", "'first_block', 'magcache'"),
        ({"kind": "magcache", "threshold": 0.1}, "flux", "mag_ratios"),
        ({"kind": "magcache", "threshold": 0.1, "mag_ratios": [1.0]}, "flux", "at least 2"),
        ({"kind": "magcache", "threshold": 0.1, "mag_ratios": "wan"}, "flux", "mag_ratios"),
        ({"kind": "first_block", "threshold": 0.1, "cache_interval": 2}, "flux", "cache_interval"),
        ({"kind": "first_block", "threshold": 0}, "flux", "greater than 0"),
        ({"kind": "first_block"}, "flux", "threshold"),
        ({"kind": "first_block", "threshold": 0.1}, "flux2", "FLUX.2's First Block Cache fails"),
        ({"kind": "first_block", "threshold": 0.1}, "sd15", "UNet has no step cache"),
        ({"kind": "first_block", "threshold": 0.1}, "zimage", "cache-dit"),
    ],
)
def test_a_step_cache_the_worker_cannot_run_is_refused_by_the_manifest(
    step_cache: dict[str, Any], family: str, expected: str
) -> None:
    data = _manifest(step_cache=step_cache, family=family, loras={}, quantize={})
    data.pop("modes", None)
    if family != "flux":
        data.pop("true_cfg", None)
    with pytest.raises(ValidationError, match=expected) as caught:
        Manifest.model_validate(data)
    assert any(err["loc"][0] == "step_cache" for err in caught.value.errors())


def test_whole_compile_and_a_step_cache_are_refused_together() -> None:
    data = _manifest(compile_method="whole")
    with pytest.raises(ValidationError, match="compile_method whole puts the cache's"):
        Manifest.model_validate(data)


def test_manifests_check_names_the_file_and_field_of_an_unknown_kind(tmp_path: Path) -> None:
    text = (MANIFESTS / f"{FLUX}.yaml").read_text().replace("kind: first_block", "kind: teacache")
    (tmp_path / f"{FLUX}.yaml").write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "worker.cli", "manifests", "check", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    said = run.stdout + run.stderr
    assert f"{FLUX}.yaml" in said and "step_cache" in said and "teacache" in said


# -- the decision per job ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("switch", "asked", "steps", "kind", "reason"),
    [
        ("auto", None, 20, "applied", "auto, 20 steps >= min_steps 20"),
        ("auto", None, 19, "skipped", "auto: 19 steps, under min_steps 20"),
        ("on", None, 2, "applied", "switched on"),
        ("off", None, 50, "skipped", "switched off"),
        ("auto", True, 2, "applied", "asked for (step_cache: true)"),
        ("on", False, 50, "skipped", "the request asks for every step"),
    ],
)
def test_the_switch_the_request_and_min_steps_decide(
    make_settings: Any, switch: str, asked: bool | None, steps: int, kind: str, reason: str
) -> None:
    manifest = Manifest.model_validate(_manifest())
    request = RenderRequest(model=FLUX, prompt="x", steps=steps, step_cache=asked)
    decision = decide(manifest, make_settings(step_cache=switch), request)
    assert (decision.kind, decision.spec is not None) == (kind, kind == "applied")
    assert reason in decision.reason


def test_min_steps_from_the_manifest_and_a_refused_pin(make_settings: Any) -> None:
    step_cache = {"kind": "first_block", "threshold": 0.1, "min_steps": 6}
    manifest = Manifest.model_validate(_manifest(step_cache=step_cache))
    at_six = RenderRequest(model=FLUX, prompt="x", steps=6)
    assert decide(manifest, make_settings(), at_six).kind == "applied"
    pinned = RenderRequest(model=FLUX, prompt="x", steps=6, step_cache=True)
    with pytest.raises(PinRefused, match="step_cache switch is off"):
        decide(manifest, make_settings(step_cache="off"), pinned)


def test_a_model_without_a_step_cache_says_why(make_settings: Any) -> None:
    manifests = load_manifests(MANIFESTS, ["tiny-sd15", "tiny-flux2"])
    request = RenderRequest(model="tiny-sd15", prompt="x", steps=30)
    assert "sd15's UNet" in decide(manifests["tiny-sd15"], make_settings(), request).reason
    asked = RenderRequest(model="tiny-flux2", prompt="x", step_cache=True)
    with pytest.raises(RequestRejected, match="step_cache") as caught:
        resolve_request(asked, manifests["tiny-flux2"])
    assert "declares no step_cache" in str(caught.value)


def test_which_pipelines_name_their_cache_contexts() -> None:
    from diffusers import (
        FluxImg2ImgPipeline,
        FluxKontextPipeline,
        FluxPipeline,
        QwenImageImg2ImgPipeline,
        QwenImagePipeline,
    )

    assert names_its_contexts(FluxPipeline) and names_its_contexts(QwenImagePipeline)
    assert names_its_contexts(QwenImageImg2ImgPipeline)
    # diffusers#12760: kiln names these from a hook on the denoiser.
    assert not names_its_contexts(FluxImg2ImgPipeline)
    assert not names_its_contexts(FluxKontextPipeline)


# -- jobs through a worker ----------------------------------------------------------------------


def _run(redis_conn: Redis, settings: Any, models: list[str], *jobs: dict[str, Any]) -> list[Any]:
    client = client_for(redis_conn, settings)
    handles = [client.submit(job) for job in jobs]
    burst(redis_conn, make_renderer(settings, models), models)
    return [handle.wait(timeout=30) for handle in handles]


def _pixels(result: RenderResult) -> bytes:
    """The first image's pixels (its file's sha256 covers the details inside it too)."""
    from PIL import Image

    with Image.open(result.images[0].path or "") as image:
        return image.tobytes()


def test_a_cached_job_reuses_steps_and_an_exact_one_matches_the_uncached(
    redis_conn: Redis, make_settings: Any, exact_dir: Path
) -> None:
    settings = make_settings(manifests=exact_dir)
    models = [FLUX, "tiny-flux-exact"]
    plain, cached, exact, again = _run(
        redis_conn,
        settings,
        models,
        JOB,
        {**JOB, "step_cache": True},
        {**JOB, "model": "tiny-flux-exact", "step_cache": True},
        {**JOB, "step_cache": False},
    )
    assert plain.step_cache is None and again.step_cache is None
    assert cached.step_cache is not None and exact.step_cache is not None
    assert cached.step_cache.model_dump() == {
        "kind": "first_block",
        "params": {"threshold": 0.5},
        "steps_computed": cached.step_cache.steps_computed,
        "steps_reused": cached.step_cache.steps_reused,
    }
    assert cached.step_cache.steps_reused > 0  # steps were reused ...
    assert cached.step_cache.steps_computed + cached.step_cache.steps_reused == JOB["steps"]
    assert _pixels(cached) != _pixels(plain)  # ... so its pixels differ
    # No step stays under 1e-9: every step computed, the uncached pixels exactly.
    assert (exact.step_cache.steps_computed, exact.step_cache.steps_reused) == (JOB["steps"], 0)
    assert _pixels(exact) == _pixels(plain) == _pixels(again)
    assert "step_cache" in cached.settings.names("applied")
    assert "step_cache" in plain.settings.names("skipped")  # auto: 8 steps, under 20
    by_id = {r.job_id: r for r in records(settings.timings_log)}
    assert by_id[cached.job_id].step_cache == cached.step_cache
    # The image says so, and its replay pins the cache on.
    details = read_details(Path(cached.images[0].path or ""))
    assert details.step_cache == "first_block threshold=0.5"
    assert details.replay_request().step_cache is True
    assert read_details(Path(plain.images[0].path or "")).replay_request().step_cache is False


def test_magcache_skips_whole_steps_after_its_retained_ones(
    make_settings: Any, exact_dir: Path
) -> None:
    """MagCache with diffusers' FLUX.1-dev ratios, interpolated to the job's 28 steps: the first
    fifth always computes (retention_ratio 0.2), later steps are skipped whole."""
    renderer = make_renderer(make_settings(manifests=exact_dir), [MAG])
    job = {**JOB, "model": MAG, "steps": 28}
    plain = renderer.render({**job, "step_cache": False}, LocalContext("mag-plain"))
    cached = renderer.render({**job, "step_cache": True}, LocalContext("mag-cached"))
    assert plain.step_cache is None and cached.step_cache is not None
    report = cached.step_cache
    assert report.kind == "magcache" and report.params["mag_ratios"] == "flux"
    assert report.params["max_skip_steps"] == 3 and report.params["retention_ratio"] == 0.2
    assert report.steps_computed + report.steps_reused == 28
    assert 6 <= report.steps_computed < 28 and report.steps_reused > 0
    assert _pixels(cached) != _pixels(plain)


def test_magcache_is_refused_for_modes_that_start_part_way(
    make_settings: Any, exact_dir: Path, input_refs: dict[str, str]
) -> None:
    manifest = load_manifests(exact_dir, [MAG])[MAG]
    img2img = RenderRequest(
        model=MAG, prompt="x", steps=30, image=input_refs["image"], strength=0.5
    )
    with pytest.raises(RequestRejected, match="starts part-way"):
        resolve_request(img2img.model_copy(update={"step_cache": True}), manifest)
    decision = decide(manifest, make_settings(), resolve_request(img2img, manifest))
    assert decision.kind == "skipped" and "img2img starts part-way" in decision.reason


def test_a_worker_with_the_switch_off_refuses_a_pinned_step_cache(
    redis_conn: Redis, make_settings: Any
) -> None:
    from api_client import RenderFailed

    settings = make_settings(step_cache="off")
    client = client_for(redis_conn, settings)
    pinned = client.submit({**JOB, "step_cache": True})
    burst(redis_conn, make_renderer(settings, [FLUX]), [FLUX])
    with pytest.raises(RenderFailed, match="step_cache switch is off"):
        pinned.wait(timeout=30)


@pytest.mark.parametrize(
    ("model", "modes"),
    [
        ("tiny-flux", ("img2img", "inpaint")),  # pipelines that name no cache context
        ("tiny-flux-kontext", ("edit",)),  # nor does Kontext's
        ("tiny-qwenimage", ("txt2img", "img2img", "inpaint")),
    ],
)
def test_every_mode_of_a_caching_family_reuses_steps(
    make_settings: Any, model: str, modes: tuple[str, ...], input_refs: dict[str, str]
) -> None:
    renderer = make_renderer(make_settings(), [model])
    for mode in modes:
        job: dict[str, Any] = {**JOB, "model": model, "steps": 10, "step_cache": True}
        if mode == "edit":
            job["image"] = input_refs["image"]
        elif mode != "txt2img":
            job |= {"image": input_refs["image"], "strength": 0.9}
        if mode == "inpaint":
            job["mask"] = input_refs["mask"]
        result = renderer.render(job, LocalContext(f"cached-{model}-{mode}"))
        assert result.step_cache is not None and result.step_cache.steps_reused > 0, mode
        denoised = 10 if mode in ("txt2img", "edit") else 9  # strength 0.9 of 10 steps
        assert result.step_cache.steps_computed + result.step_cache.steps_reused == denoised


def test_every_rung_runs_the_cache_and_measures_its_shape_apart(make_settings: Any) -> None:
    """The offload rungs' hooks (accelerate's, group offload's, the partial split's) and the
    cache's wrap the same blocks: each rung reuses the steps full does. The cache keeps
    residuals beside the activations, so a cached job's peaks are a shape of their own."""
    renderer = make_renderer(make_settings(), [FLUX])
    reused = []
    for rung in ("full", "partial", "model_offload", "group_offload"):
        job = {**JOB, "rung": rung, "step_cache": True}
        result = renderer.render(job, LocalContext(f"rung-{rung}"))
        assert result.rung == rung and result.step_cache is not None
        reused.append(result.step_cache.steps_reused)
    assert reused[0] > 0 and set(reused) == {reused[0]}
    renderer.render({**JOB, "rung": "full", "step_cache": False}, LocalContext("plain-peak"))
    shapes = {key.rpartition("|")[0] for key in renderer.planner.peaks.own}
    assert {s.endswith("|step_cache") for s in shapes} == {True, False}, shapes


def test_true_cfg_passes_are_named_where_the_pipeline_names_none(make_settings: Any) -> None:
    """FluxImg2ImgPipeline sets no cache context: kiln's hook names each step's first pass cond
    and its second (true CFG) uncond, so the two keep their own residuals. Then the blocks
    compiled for a step cache, and back."""
    from PIL import Image

    renderer = make_renderer(make_settings(), [FLUX])
    renderer.render({**JOB, "steps": 2}, LocalContext("loads-it"))
    loaded = renderer.cache.get(FLUX)
    assert loaded is not None
    pipe = loaded.pipe_for("img2img")
    spec = FirstBlockCache(kind="first_block", threshold=0.5)
    with StepCache(loaded.denoiser, spec, pipe, steps=5) as cache:

        def step_end(_p: Any, _i: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            cache.step_ended()
            return tensors

        pipe(
            prompt="a kiln",
            negative_prompt="blur",
            true_cfg_scale=2.0,
            image=Image.new("RGB", (128, 128), (90, 40, 200)),
            strength=1.0,
            num_inference_steps=5,
            height=128,
            width=128,
            generator=torch.Generator().manual_seed(1),
            output_type="latent",
            callback_on_step_end=step_end,
        )
    assert cache.passes == {"cond": 5, "uncond": 5}
    assert 0 < cache.computed["cond"] < 5 and 0 < cache.computed["uncond"] < 5
    assert getattr(loaded.denoiser, "_cache_config", None) is None  # removed on exit
    assert not loaded.denoiser._forward_pre_hooks and not loaded.denoiser._forward_hooks
    # Compiled for a step cache, each block's own forward; uncompiled, the class's again.
    from worker.pipelines.compile import COMPILED_FORWARD, compile_denoiser, uncompile_denoiser

    how = compile_denoiser(loaded.denoiser, renderer.settings, step_cache=True)
    marked = [m for m in loaded.denoiser.modules() if COMPILED_FORWARD in vars(m)]
    assert how.startswith("regional forwards") and len(marked) == 2  # one of each block kind
    uncompile_denoiser(loaded.denoiser)
    assert not [m for m in loaded.denoiser.modules() if COMPILED_FORWARD in vars(m)]
    assert all(getattr(vars(m).get("forward"), "__wrapped__", None) is None for m in marked)


# -- under compile --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-flux", "tiny-qwenimage", MAG])
def test_under_compile_the_switch_flips_with_no_recompile(
    make_settings: Any, exact_dir: Path, model: str
) -> None:
    """Compiled (a pin, as a replay's: auto does not compile on a CPU), the block forwards are
    compiled and the cache's hooks sit outside them: cached, uncached and cached again run the
    same graphs, and the cached job differs from the uncached one. Both kinds."""
    renderer = make_renderer(make_settings(manifests=exact_dir), [model])
    job = {**JOB, "model": model, "compile": True}
    first = renderer.render({**job, "step_cache": True}, LocalContext(f"c1-{model}"))
    plain = renderer.render({**job, "step_cache": False}, LocalContext(f"c2-{model}"))
    again = renderer.render({**job, "step_cache": True}, LocalContext(f"c3-{model}"))
    assert first.compiled and plain.compiled and again.compiled
    compile_note = next(n.reason for n in first.settings.applied if n.name == "compile")
    assert compile_note.startswith("regional forwards")
    logged = {r.job_id: r for r in records(renderer.settings.timings_log)}
    assert [logged[r.job_id].recompiles for r in (first, plain, again)] == [0, 0, 0]
    assert first.step_cache is not None and first.step_cache.steps_reused > 0
    assert _pixels(first) == _pixels(again) != _pixels(plain)


def test_a_request_without_the_field_reads_as_before_it_existed() -> None:
    """step_cache is a later field: unset, it is left out of the wire form and the digest."""
    from api_client.schema import request_payload

    assert "step_cache" not in request_payload(RenderRequest(model=FLUX, prompt="x"))
    asked = request_payload(RenderRequest(model=FLUX, prompt="x", step_cache=False))
    assert asked["step_cache"] is False
