"""A sampler per job (issue 38 item 3): each family's row offers what diffusers' schedulers run for
it (every offered sampler, at every offered schedule, renders on its tiny model: slow), a manifest
narrows it, a request is refused at submit naming the field and the names the model takes, the
scheduler is swapped on the resident pipeline for the job's passes (its img2img, inpaint and hires
views too) and put back (the next job renders what a fresh worker renders, pixel for pixel), and
the sampler reaches the record, the result, the image's details and A1111 parameters, a replay,
and `kiln submit --sampler/--sigmas`; A1111's "Euler a" makes the same request and pixels."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from redis import Redis

from api_client import RequestRejected
from api_client.families import FAMILIES
from api_client.manifest import Manifest
from api_client.samplers import SAMPLERS, from_a1111
from api_client.schema import RenderRequest
from tests.conftest import MANIFESTS
from tests.support.images import mask_png, pixels, png
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.cli import build_parser
from worker.cli.client import _request
from worker.files.details import parameters_text, read_details
from worker.manifest import load_manifests
from worker.memory.faults import FaultPlan
from worker.pipelines import samplers
from worker.pipelines.loading import load_pipeline
from worker.render.renderer import Renderer
from worker.render.timings import TimingRecord
from worker.settings import Settings

SD = "tiny-sd15"
FLOW = "tiny-sd3"
# guidance 1: no CFG, half the denoiser work (the sampler is what these tests tell apart)
BASE: dict[str, Any] = {"model": SD, "prompt": "a fox", "steps": 2, "seed": 11, "guidance": 1.0}


@pytest.fixture(scope="module")
def shared(tiny_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """One set of outputs for the module's renders (their records are told apart by job id)."""
    out = tmp_path_factory.mktemp("samplers")
    return Settings(
        redis_url=redis_url,
        manifests=MANIFESTS,  # type: ignore[arg-type]
        models_dir=tiny_dir,
        output_dir=out / "out",
        timings_log=out / "out" / "timings.jsonl",
        inductor_cache_dir=out / "inductor",
    )


@pytest.fixture(scope="module")
def worker(shared: Settings) -> Iterator[tuple[Renderer, Any]]:
    """The module's worker (its pipelines stay resident across the tests that share it) and the
    pixels of a plain job, the first it renders: what a fresh worker renders."""
    renderer = make_renderer(shared, [SD, FLOW])
    with Redis.from_url(shared.redis_url) as conn:
        job = client_for(conn, shared).submit(BASE)
        burst(conn, renderer, [SD])
        yield renderer, pixels(job.wait(timeout=30).images[0].path)


@pytest.fixture
def renderer(worker: tuple[Renderer, Any]) -> Renderer:
    return worker[0]


def _records(settings: Settings) -> dict[str, TimingRecord]:
    return {r.job_id: r for r in records(settings.timings_log)}


# -- what each family offers ---------------------------------------------------------------------


def test_each_family_offers_what_its_schedulers_take() -> None:
    import diffusers

    for row in FAMILIES.values():
        table = samplers.FLOW if row.flow_matching else samplers.NOISE
        assert set(row.samplers) <= set(table), row.name
        offered = set(row.samplers)
        assert set(row.schedules) <= offered and set(row.txt2img_only) <= offered
        assert set(row.samplers_for(edit=True)) <= offered
        for sampler in row.samplers:
            cls = getattr(diffusers, samplers.class_name(row, sampler))
            takes = inspect.signature(cls.__init__).parameters
            for sigmas in row.sigmas_for(sampler)[1:]:
                assert samplers.SIGMA_FLAGS[sigmas] in takes, (row.name, sampler, sigmas)
    # The noise-predicting UNets take all nine; the flow families at least euler; an upscaler none.
    for name in ("sd15", "sd2", "sdxl"):
        assert FAMILIES[name].samplers == SAMPLERS
        assert FAMILIES[name].sigmas_for("dpmpp_2m") == ("normal", "karras", "exponential", "beta")
        assert FAMILIES[name].sigmas_for("euler_ancestral") == ("normal",)
    for name in ("sd3", "flux", "flux2", "qwenimage", "zimage"):
        assert FAMILIES[name].flow_matching and "euler" in FAMILIES[name].samplers
    assert FAMILIES["upscaler"].samplers == ()


def _manifest(family: str, **fields: Any) -> Manifest:
    size = {"upscaler": {"scale": 4, "source": "x.safetensors"}}.get(family, {})
    data = {"id": "m", "family": family, "source": "m", "min_vram_gb": 1, **size, **fields}
    if family != "upscaler":
        data.update(steps={"default": 4, "max": 8}, guidance={"default": 1, "max": 2})
        data["resolutions"] = [[512, 512]]
    return Manifest.model_validate(data)


def test_a_manifest_narrows_its_familys_samplers() -> None:
    assert _manifest("sd15").samplers == list(SAMPLERS)  # silent: its family's
    narrowed = _manifest("sd15", samplers=["euler", "dpmpp_2m"])
    assert narrowed.samplers == ["euler", "dpmpp_2m"]
    assert Manifest.model_validate(narrowed.model_dump()) == narrowed  # as Redis reads it back
    with pytest.raises(ValueError, match="ddim: family flux takes no such sampler; it takes euler"):
        _manifest("flux", samplers=["euler", "ddim"])
    # An edit model takes what its edit pipeline runs (FluxKontextPipeline: no DPM-Solver).
    assert _manifest("flux", modes=["txt2img", "edit"]).samplers == list(
        FAMILIES["flux"].samplers_for(edit=True)
    )
    with pytest.raises(ValueError, match="dpmpp_2m: a flux edit model takes no such sampler"):
        _manifest("flux", modes=["edit"], samplers=["dpmpp_2m"])
    with pytest.raises(ValueError, match="must name each sampler once"):
        _manifest("sd15", samplers=["euler", "euler"])
    assert _manifest("upscaler").samplers == []
    with pytest.raises(ValueError, match="family upscaler takes no such sampler; it takes none"):
        _manifest("upscaler", samplers=["euler"])


def test_what_a_model_does_not_take_is_refused_at_submit(
    redis_conn: Redis, shared: Settings
) -> None:
    client = client_for(redis_conn, shared)
    source, mask = client.upload(png()), client.upload(mask_png())
    flow_names = ", ".join(FAMILIES["sd3"].samplers)
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"model": FLOW, "sampler": "ddim"}, "sampler", f"model {FLOW} takes {flow_names}"),
        (
            {"sampler": "euler_ancestral", "sigmas": "karras"},
            "sigmas",
            "sampler euler_ancestral on sd15 takes normal",
        ),
        ({"sigmas": "karras"}, "sigmas", "name the sampler too (model tiny-sd15 takes euler,"),
        (
            {"model": FLOW, "sampler": "dpmpp_2m", "image": source, "strength": 0.5},
            "sampler",
            "runs from noise only on sd3, and img2img starts part-way",
        ),
        (
            {"model": FLOW, "sampler": "uni_pc", "image": source, "mask": mask},
            "sampler",
            "has no scale_noise",
        ),
        (
            {"model": FLOW, "sampler": "dpmpp_2m", "hires": {"scale": 1.5}},
            "sampler",
            "a hires pass starts part-way",
        ),
        ({"model": "tiny-upscaler", "image": source, "sampler": "euler"}, "sampler", "takes no"),
    ]
    for overrides, field, rule in cases:
        with pytest.raises(RequestRejected) as caught:
            client.submit({**BASE, **overrides})
        assert field in [p.field for p in caught.value.problems], (overrides, caught.value)
        assert rule in str(caught.value), (overrides, str(caught.value))
    with pytest.raises(RequestRejected, match="sampler"):
        client.submit({**BASE, "sampler": "k_euler"})  # not a kiln name: the schema refuses it
    assert redis_conn.keys("rq:job:*") == []


def test_a1111s_names_make_the_same_request() -> None:
    sampler, sigmas = from_a1111("Euler a")
    theirs = RenderRequest.model_validate({**BASE, "sampler": sampler, "sigmas": sigmas})
    assert theirs == RenderRequest.model_validate({**BASE, "sampler": "euler_ancestral"})
    assert (
        from_a1111("DPM++ 2M", "Karras") == from_a1111("DPM++ 2M Karras") == ("dpmpp_2m", "karras")
    )


def test_submit_takes_sampler_and_sigmas_flags() -> None:
    parser = build_parser()
    argv = ["submit", "a fox", "--model", SD, "--sampler", "dpmpp_2m", "--sigmas", "karras"]
    request = _request(parser.parse_args(argv))
    assert (request["sampler"], request["sigmas"]) == ("dpmpp_2m", "karras")
    assert "sampler" not in _request(parser.parse_args(argv[:4]))
    for bad in (["--sampler", "k_euler"], ["--sigmas", "polyexponential"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv[:4], *bad])


# -- on the resident pipeline ---------------------------------------------------------------------


def test_a_sampler_is_the_jobs_alone(
    redis_conn: Redis, shared: Settings, worker: tuple[Renderer, Any]
) -> None:
    """A stochastic multistep sampler's job, then a plain job on the same resident pipeline: the
    plain one renders what the worker rendered fresh. The same seed through "Euler a" and
    through euler_ancestral renders the same pixels."""
    renderer, fresh = worker
    client = client_for(redis_conn, shared)
    chosen = client.submit({**BASE, "sampler": "dpmpp_2m_sde", "sigmas": "karras"})
    plain = client.submit(BASE)
    ours = client.submit({**BASE, "sampler": "euler_ancestral"})
    name, schedule = from_a1111("Euler a")
    theirs = client.submit({**BASE, "sampler": name, "sigmas": schedule})
    burst(redis_conn, renderer, [SD])
    loaded = renderer.cache.get(SD)
    assert loaded is not None and type(loaded.pipe.scheduler).__name__ == "PNDMScheduler"
    shown = {
        job.id: pixels(job.wait(timeout=30).images[0].path) for job in (chosen, plain, ours, theirs)
    }
    assert np.array_equal(shown[plain.id], fresh)
    assert not np.array_equal(shown[plain.id], shown[chosen.id])
    assert np.array_equal(shown[ours.id], shown[theirs.id])
    assert not np.array_equal(shown[plain.id], shown[ours.id])

    by_id = _records(shared)
    assert {by_id[j.id].load_source for j in (chosen, plain)} == {"resident"}  # nothing reloaded
    assert (by_id[plain.id].sampler, by_id[plain.id].scheduler) == (None, "PNDMScheduler")
    record = by_id[chosen.id]
    assert (record.sampler, record.sigmas) == ("dpmpp_2m_sde", "karras")
    assert record.scheduler == "DPMSolverMultistepScheduler"
    result = chosen.wait(timeout=5)
    assert (result.sampler, result.sigmas) == ("dpmpp_2m_sde", "karras")
    path = Path(result.images[0].path or "")
    details = read_details(path)
    assert (details.sampler, details.sigmas, details.scheduler) == (
        "dpmpp_2m_sde",
        "karras",
        "DPMSolverMultistepScheduler",
    )
    assert "Sampler: DPM++ 2M SDE, Schedule type: Karras, CFG scale" in parameters_text(details)
    with Image.open(path) as image:
        text = image.text  # type: ignore[attr-defined]  # a PNG's text chunks
        assert "Sampler: DPM++ 2M SDE, Schedule type: Karras" in text["parameters"]
    for job, said in ((ours, "Sampler: Euler a, CFG"), (plain, "Sampler: PNDMScheduler, CFG")):
        assert said in parameters_text(read_details(Path(job.wait(5).images[0].path or "")))
    # A replay pins the sampler: its request is the job's own, and it renders the same pixels.
    replay = client.submit(details.replay_request())
    burst(redis_conn, renderer, [SD])
    assert np.array_equal(pixels(replay.wait(timeout=30).images[0].path), shown[chosen.id])


def test_img2img_inpaint_and_hires_run_the_jobs_sampler(
    redis_conn: Redis, shared: Settings, renderer: Renderer
) -> None:
    """Heun evaluates the model twice a step: its img2img, inpaint and hires passes (the
    resident pipeline's from_pipe views) call back at each evaluation, which a first-order
    scheduler would not."""
    client = client_for(redis_conn, shared)
    source, mask = client.upload(png()), client.upload(mask_png())
    partway = {**BASE, "steps": 4, "image": source, "strength": 0.5}
    jobs = {
        "img2img": client.submit({**partway, "sampler": "heun"}),
        "inpaint": client.submit({**partway, "mask": mask, "sampler": "heun"}),
        "hires": client.submit(
            {**BASE, "sampler": "heun", "hires": {"scale": 1.5, "steps": 2, "strength": 1.0}}
        ),
        "euler img2img": client.submit({**partway, "sampler": "euler"}),
    }
    burst(redis_conn, renderer, [SD])
    by_id = _records(shared)
    counted = {name: by_id[job.id].steps_denoised for name, job in jobs.items()}
    # Heun at 4 steps has 7 timesteps; strength 0.5 starts at the 5th: 3 of them. At 2 steps it
    # has 3: the hires job's first pass and its second (strength 1), 6. Euler denoises 2 of 4.
    assert counted == {"img2img": 3, "inpaint": 3, "hires": 6, "euler img2img": 2}
    assert {by_id[job.id].scheduler for name, job in jobs.items() if name != "euler img2img"} == {
        "HeunDiscreteScheduler"
    }
    loaded = renderer.cache.get(SD)
    assert loaded is not None
    for view in [loaded.pipe, *loaded.mode_pipes.values()]:
        assert type(view.scheduler).__name__ == "PNDMScheduler"


def test_a_flow_family_runs_its_flow_solvers(
    redis_conn: Redis, shared: Settings, renderer: Renderer
) -> None:
    client = client_for(redis_conn, shared)
    flow = {**BASE, "model": FLOW, "steps": 4}  # 2 steps: beta's schedule is normal's
    jobs = [
        client.submit(flow),
        client.submit({**flow, "sampler": "dpmpp_2m"}),
        client.submit({**flow, "sampler": "euler", "sigmas": "beta"}),
    ]
    burst(redis_conn, renderer, [FLOW])
    by_id = _records(shared)
    assert [by_id[j.id].scheduler for j in jobs] == [
        "FlowMatchEulerDiscreteScheduler",
        "DPMSolverMultistepScheduler",
        "FlowMatchEulerDiscreteScheduler",
    ]
    shown = [pixels(job.wait(timeout=30).images[0].path) for job in jobs]
    assert all(np.isfinite(image).all() for image in shown)
    assert not np.array_equal(shown[0], shown[1]) and not np.array_equal(shown[0], shown[2])


# -- every family, every offered sampler ---------------------------------------------------------

TINY = {
    "sd15": SD,
    "sdxl": "tiny-sdxl",
    "sd3": FLOW,
    "flux": "tiny-flux",
    "flux2": "tiny-flux2",
    "qwenimage": "tiny-qwenimage",
    "zimage": "tiny-zimage",
    "flux-kontext": "tiny-flux-kontext",
}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # up to ~60 renders on a loaded 2-core machine
@pytest.mark.parametrize("model", list(TINY.values()))
def test_every_offered_sampler_runs_on_its_family(settings: Settings, model: str) -> None:
    """Each sampler its manifest offers, at each schedule it takes from noise and at normal in
    each mode the model serves (a txt2img-only sampler from noise alone, and it really fails
    part-way: the refusal is no guess), renders finite latents at 3 steps on its tiny model."""
    from worker.memory.device import DeviceInfo

    cpu = DeviceInfo("cpu", "cpu", "test cpu", 8 * 2**30, 4 * 2**30, bf16=False, fp16=False)
    manifest = load_manifests(settings.manifests, [model])[model]
    loaded = load_pipeline(manifest, "full", cpu, settings, FaultPlan())
    row, image = manifest.family_row, Image.new("RGB", (128, 128), (120, 60, 30))
    for sampler in manifest.samplers:
        for sigmas in row.sigmas_for(sampler):
            # Each schedule from noise; each mode at the sampler's normal one.
            for mode in manifest.modes if sigmas == "normal" else ["txt2img"]:
                pipe = loaded.pipe_for(mode)
                call: dict[str, Any] = {"prompt": "a fox", "num_inference_steps": 3}
                call.update(height=128, width=128, output_type="latent")
                if mode != "txt2img":
                    call["image"] = image
                if mode in ("img2img", "inpaint"):
                    call["strength"] = 0.7
                if mode == "inpaint":
                    call["mask_image"] = Image.new("L", (128, 128), 255)
                partway = mode in ("img2img", "inpaint")
                with samplers.swapped(pipe, row, loaded.scheduler_config, sampler, sigmas):
                    call["generator"] = torch.Generator().manual_seed(0)
                    if partway and sampler in row.txt2img_only:
                        with pytest.raises((AttributeError, ValueError)):
                            pipe(**call)
                        continue
                    latents = pipe(**call).images
                assert torch.isfinite(latents).all(), (model, sampler, sigmas, mode)


# -- the page --------------------------------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# The select's options as the page built them from /v1/models.
OPTIONS = "return [...document.querySelectorAll(`#f-${arguments[0]} option`)].map((o) => o.value)"


def test_the_page_offers_the_models_samplers(gateway: Any, tmp_path: Path) -> None:
    """The gateway's model listing carries each model's samplers (its manifest's) and the sigmas
    each takes; the page's Sampler select lists them, its Sigmas select follows the sampler, and
    the request it sends carries both."""
    from tests.fixtures.gateway import call

    listing = json.loads(call("GET", f"{gateway.url}/v1/models", gateway.token)[2])
    [view] = [m for m in listing["models"] if m["manifest"]["id"] == SD]
    assert view["manifest"]["samplers"] == list(SAMPLERS)
    assert view["sigmas"]["dpmpp_2m"] == ["normal", "karras", "exponential", "beta"]
    assert view["sigmas"]["euler_ancestral"] == ["normal"]
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("the page's half needs Debian's chromium and chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the dev extra)")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium'}")
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        until = WebDriverWait(driver, 60, poll_frequency=0.05).until
        driver.get(f"{gateway.url}/?token={gateway.token}")
        model = until(lambda d: d.find_element(By.NAME, "model"), "the form")
        until(lambda d: model.find_elements(By.CSS_SELECTOR, f"option[value='{SD}']"), SD)
        Select(model).select_by_value(SD)
        until(lambda d: d.execute_script(OPTIONS, "sampler")[1:] == list(SAMPLERS), "samplers")
        sampler = Select(driver.find_element(By.ID, "f-sampler"))
        sampler.select_by_value("euler_ancestral")
        assert driver.execute_script(OPTIONS, "sigmas") == ["", "normal"]  # no karras and kin
        sampler.select_by_value("dpmpp_2m")
        assert driver.execute_script(OPTIONS, "sigmas") == ["", *view["sigmas"]["dpmpp_2m"]]
        Select(driver.find_element(By.ID, "f-sigmas")).select_by_value("karras")
        prompt = driver.find_element(By.CSS_SELECTOR, "#submit [name='prompt']")
        prompt.send_keys("a fox")
        driver.find_element(By.CSS_SELECTOR, "#submit button[type='submit']").click()
        cards = until(
            lambda d: d.find_elements(By.CSS_SELECTOR, "[data-job-id][data-status]"), "job"
        )
        job_id = cards[0].get_attribute("data-job-id")
        job = json.loads(call("GET", f"{gateway.url}/v1/jobs/{job_id}", gateway.token)[2])
        assert (job["request"]["sampler"], job["request"]["sigmas"]) == ("dpmpp_2m", "karras")
    finally:
        driver.quit()
