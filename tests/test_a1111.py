"""AUTOMATIC1111's API on the gateway, driven by the real `webuiapi` package, unchanged, and by
Open WebUI's exact A1111 calls (backend/open_webui/routers/images.py: options GET, options POST
of the whole object, sd-models, txt2img with batch_size, HTTP Basic), against one real `kiln api`
and one real `kiln worker` rendering tiny-sd15 that every test of this file shares.

The worker holds a job of more than GATE_AT steps at that step while its gate is closed (the
progress test acts mid-job on that); every other job here has GATE_AT steps or fewer and passes."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import webuiapi
from PIL import Image
from redis import Redis

from api_client import keys
from api_client.http.a1111 import fields
from api_client.http.tokens import Tokens
from tests.conftest import MANIFESTS
from tests.fixtures.gate import Gate
from tests.fixtures.gateway import Gateway, call, start_gateway
from tests.support.deployments import worker_env
from tests.workers import WorkerProcess, free_port, gated, wait_until
from worker.manifest import load_manifests

MODEL = "tiny-sd15"
GATE_AT = 3
SIZE = {"width": 128, "height": 128}


@dataclass
class Stack:
    conn: Redis
    gateway: Gateway
    worker: WorkerProcess
    gate: Gate

    @property
    def base(self) -> str:
        return self.gateway.url + "/sdapi/v1"

    def token(self, name: str) -> str:
        return Tokens(self.conn).create(f"{name}-{time.monotonic_ns()}")

    def webui(self, token: str) -> webuiapi.WebUIApi:
        api = webuiapi.WebUIApi(baseurl=self.base, sampler="Euler a", steps=2)
        api.set_auth("webui", token)
        return api

    def jobs(self, token: str) -> list[dict[str, Any]]:
        status, _, body = call("GET", self.gateway.url + "/v1/jobs", token)
        assert status == 200, body
        jobs: list[dict[str, Any]] = json.loads(body)["jobs"]
        return jobs


@pytest.fixture(scope="module")
def stack(
    redis_url: str, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    conn = Redis.from_url(redis_url)
    conn.flushdb()
    root = tmp_path_factory.mktemp("a1111")
    env = worker_env(redis_url, tiny_dir, root)
    gate = Gate(root / "gate", at=GATE_AT)
    worker = WorkerProcess(env, root / "worker.log", "--models", MODEL, options=gated(gate))
    gateway = None
    try:
        gateway, _ = start_gateway(env, conn, root, free_port())
        worker.wait_ready(conn)
        yield Stack(conn, gateway, worker, gate)
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
        conn.flushdb()
        conn.close()


def basic(token: str, user: str = "openwebui") -> dict[str, str]:
    """Open WebUI's header: AUTOMATIC1111_API_AUTH "user:token", base64, as Basic."""
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()}


def send(method: str, url: str, token: str, body: Any = None) -> tuple[int, Any]:
    status, headers, raw = call(method, url, body=body, headers=basic(token), timeout=120)
    assert headers.get("content-type", "").startswith("application/json"), (status, raw[:200])
    return status, json.loads(raw)


def png(size: tuple[int, int], color: Any = (200, 40, 40), mode: str = "RGB") -> Image.Image:
    return Image.new(mode, size, color)


def pixels(data: bytes) -> bytes:
    return Image.open(io.BytesIO(data)).convert("RGB").tobytes()


# -- webuiapi ------------------------------------------------------------------------------------


def test_webuiapi_txt2img_euler_a_batch(stack: Stack) -> None:
    token = stack.token("webuiapi")
    api = stack.webui(token)
    api.util_set_model(MODEL)
    assert api.util_get_current_model() == MODEL
    result = api.txt2img(prompt="a red fox", seed=11, batch_size=2, steps=2, cfg_scale=6.0, **SIZE)
    assert [image.size for image in result.images] == [(128, 128)] * 2
    info = result.info  # webuiapi parsed info, which A1111 sends as a JSON string
    assert isinstance(result.json["info"], str)
    assert info["all_seeds"] == [11, 12] and info["seed"] == 11 and info["sd_model_name"] == MODEL
    assert info["sampler_name"] == "Euler a" and info["cfg_scale"] == 6.0 and info["steps"] == 2
    first, second = info["infotexts"]
    assert first.startswith("a red fox\n") and "Seed: 11," in first and "Seed: 12," in second
    assert "Steps: 2," in first and "Size: 128x128" in first and f"Model: {MODEL}" in first
    [job] = stack.jobs(token)
    assert job["request"]["sampler"] == "euler_ancestral" and job["request"]["num_images"] == 2
    assert job["request"]["guidance"] == 6.0 and job["status"] == "finished"
    # The worker's sampler (issue 38 item 3): the PNG's parameters text names A1111's sampler.
    assert "Sampler: Euler a" in first


def test_webuiapi_img2img_with_a_mask_inpaints(stack: Stack) -> None:
    token = stack.token("img2img")
    api = stack.webui(token)
    mask = png((128, 128), 0, "L")
    mask.paste(255, (0, 0, 64, 128))  # white: repainted, in A1111 and kiln alike
    result = api.img2img(
        images=[png((128, 128))],
        mask_image=mask,
        prompt="a red fox in snow",
        denoising_strength=0.5,
        seed=4,
        steps=3,
        **SIZE,
    )
    assert [image.size for image in result.images] == [(128, 128)]
    [job] = stack.jobs(token)
    request = job["request"]
    assert request["mode"] == "inpaint" and request["strength"] == 0.5 and request["seed"] == 4
    assert request["image"].startswith("kiln-input:") and request["mask"].startswith("kiln-input:")
    kept = Image.open(io.BytesIO(stack.conn.get(keys.input_key(request["mask"][11:])) or b""))
    assert kept.getpixel((10, 10)) == 255 and kept.getpixel((100, 10)) == 0


def test_progress_shows_the_running_job_and_interrupt_stops_it(stack: Stack) -> None:
    mine, theirs = stack.token("progress"), stack.token("other")
    api, other = stack.webui(mine), stack.webui(theirs)
    out: dict[str, Any] = {}
    held = threading.Thread(
        target=lambda: out.update(result=api.txt2img(prompt="a harbour", steps=6, **SIZE))
    )
    held.start()
    try:

        def at_the_gate() -> Any:
            shown = api.get_progress()
            ready = shown["state"]["sampling_step"] == GATE_AT and shown["current_image"]
            return shown if ready else None

        shown = wait_until(at_the_gate, 60, "the job to wait at its gate with a preview")
        assert shown["progress"] == 0.5 and shown["state"]["sampling_steps"] == 6
        assert shown["state"]["job_count"] == 1
        assert Image.open(io.BytesIO(base64.b64decode(shown["current_image"]))).size == (128, 128)
        # Another token sees none of it, and its interrupt stops nothing of this token's.
        assert other.get_progress()["state"]["job_count"] == 0
        assert other.get_progress()["current_image"] is None
        other.interrupt()
        [job] = stack.jobs(mine)
        assert job["status"] == "started"
        api.interrupt()
    finally:
        stack.gate.open()
    held.join(timeout=60)
    stack.gate.close()
    assert not held.is_alive(), "the held txt2img did not answer after its job stopped"
    assert out["result"].images == []  # interrupted before any image was done
    [job] = stack.jobs(mine)
    assert job["status"] in ("stopped", "canceled"), job
    assert api.get_progress()["state"]["job_count"] == 0


# -- Open WebUI ----------------------------------------------------------------------------------


def test_open_webuis_a1111_sequence(stack: Stack) -> None:
    """set_image_model, get_models, then image_generations, as Open WebUI calls them."""
    token = stack.token("openwebui")
    base = stack.base
    assert send("POST", base + "/options", token, {"sd_model_checkpoint": "tiny-sdxl"})[0] == 200
    # set_image_model: GET options; the model differs, so POST the whole object back.
    status, options = send("GET", base + "/options", token)
    assert status == 200 and options["sd_model_checkpoint"] == "tiny-sdxl"
    options["sd_model_checkpoint"] = MODEL
    assert send("POST", base + "/options", token, options)[0] == 200
    # get_models: every model, by title and model_name.
    status, models = send("GET", base + "/sd-models", token)
    ids = [{"id": m["title"], "name": m["model_name"]} for m in models]
    assert {"id": MODEL, "name": MODEL} in ids and {"id": "tiny-sdxl", "name": "tiny-sdxl"} in ids
    # image_generations: the model from options, then txt2img with batch_size.
    assert send("GET", base + "/options", token)[1]["sd_model_checkpoint"] == MODEL
    data = {"prompt": "a lighthouse", "batch_size": 2, "steps": 2, **SIZE}
    status, res = send("POST", base + "/txt2img", token, data)
    assert status == 200, res
    images = [base64.b64decode(image) for image in res["images"]]  # no comma: bare base64
    assert len(images) == 2 and all(image[:4] == b"\x89PNG" for image in images)
    info = json.loads(res["info"])
    assert info["sd_model_name"] == MODEL and len(info["infotexts"]) == 2
    assert info["all_seeds"] == [info["seed"], info["seed"] + 1]


def test_the_same_seed_renders_the_same_pixels_through_kiln_and_a1111(stack: Stack) -> None:
    token = stack.token("pixels")
    own = {"model": MODEL, "prompt": "a red fox", "seed": 5, "steps": 2, "guidance": 7.0, **SIZE}
    own["sampler"] = "euler_ancestral"
    status, _, body = call("POST", stack.gateway.url + "/v1/jobs", token, own)
    assert status == 201, body
    job_id = json.loads(body)["id"]

    def finished() -> Any:
        view = json.loads(call("GET", f"{stack.gateway.url}/v1/jobs/{job_id}", token)[2])
        return view if view["status"] in ("finished", "failed") else None

    assert wait_until(finished, 60, "the /v1 job to end")["status"] == "finished"
    kiln_png = call("GET", f"{stack.gateway.url}/v1/jobs/{job_id}/images/0", token)[2]
    dialect = {"prompt": "a red fox", "seed": 5, "steps": 2, "cfg_scale": 7.0, **SIZE}
    status, res = send(
        "POST", stack.base + "/txt2img", token, dialect | {"sampler_name": "Euler a"}
    )
    assert status == 200, res
    assert pixels(base64.b64decode(res["images"][0])) == pixels(kiln_png)


# -- refusals, lists, auth -----------------------------------------------------------------------


def test_refusals_in_a1111s_shape_name_the_field(stack: Stack) -> None:
    token = stack.token("refusals")
    url = stack.base + "/txt2img"
    cases = [
        ({"sampler_name": "DPM adaptive"}, 422, "sampler_name"),
        ({"scheduler": "polyexponential"}, 422, "scheduler"),
        ({"restore_faces": True}, 422, "restore_faces"),
        ({"enable_hr": True, "hr_resize_x": 512}, 422, "hr_resize_x"),
        ({"override_settings": {"CLIP_stop_at_last_layers": 2}}, 422, "CLIP_stop_at_last_layers"),
        ({"steps": 999}, 422, "steps"),
        ({"cfg_scale": 99}, 422, "cfg_scale"),  # kiln's guidance, in A1111's name
        ({"override_settings": {"sd_model_checkpoint": "nope"}}, 404, "nope"),
    ]
    for extra, code, named in cases:
        status, body = send("POST", url, token, {"prompt": "x", "steps": 2, **SIZE} | extra)
        assert status == code, (extra, body)
        assert set(body) == {"error", "detail", "body", "errors"}, body
        assert named in body["errors"], (extra, body)
    started = time.monotonic()
    status, body = send(
        "POST",
        url,
        token,
        {"prompt": "x", "override_settings": {"sd_model_checkpoint": "tiny-sdxl"}},
    )
    assert status == 503 and "tiny-sdxl" in body["detail"] and time.monotonic() - started < 5
    image = "data:image/png;base64," + webuiapi.raw_b64_img(png((128, 128)))
    wide = {"init_images": [image], "width": 192, "height": 128, "prompt": "x"}
    status, body = send("POST", stack.base + "/img2img", token, wide)
    assert status == 422 and "never resizes" in body["detail"] and "width" in body["errors"]
    status, body = send("POST", stack.base + "/img2img", token, {"init_images": ["@@@"]})
    assert status == 422 and "init_images" in body["errors"]
    status, body = send("GET", stack.base + "/no-such-route", token)
    assert status == 404 and set(body) == {"error", "detail", "body", "errors"}
    assert stack.jobs(token) == []  # nothing refused was queued


def test_auth_is_basic_with_the_token_or_bearer(stack: Stack) -> None:
    token = stack.token("auth")
    url = stack.base + "/options"
    status, headers, raw = call("GET", url, headers=basic("kiln_wrong"))
    assert status == 401 and "Basic" in headers["www-authenticate"]
    assert set(json.loads(raw)) == {"error", "detail", "body", "errors"}
    assert call("GET", url)[0] == 401
    assert call("GET", url, token)[0] == 200  # Bearer, as every kiln route takes
    assert call("GET", url, headers=basic(token, "any-user-name"))[0] == 200


def test_lists_and_the_routes_stay_out_of_openapi(stack: Stack) -> None:
    token = stack.token("lists")
    got = {path: send("GET", f"{stack.base}/{path}", token)[1] for path in LISTS}
    assert {"name": "Euler a", "aliases": ["k_euler_a"], "options": {}} in got["samplers"]
    assert {s["name"] for s in got["schedulers"]} >= {"automatic", "karras", "exponential"}
    models = [m["title"] for m in got["sd-models"]]
    assert MODEL in models and "tiny-sdxl" in models and "tiny-upscaler" not in models
    upscalers = [u["name"] for u in got["upscalers"]]
    assert "tiny-upscaler" in upscalers and MODEL not in upscalers
    assert got["latent-upscale-modes"] == [{"name": "Latent"}]
    assert {lora["name"] for lora in got["loras"]} >= {"detail", "style"}
    assert got["sd-vae"] == []
    admin = Tokens(stack.conn).create(f"admin-{time.monotonic_ns()}", "admin")
    schema = json.loads(call("GET", stack.gateway.url + "/openapi.json", admin)[2])
    assert not [path for path in schema["paths"] if path.startswith("/sdapi")]


LISTS = (
    "samplers",
    "schedulers",
    "sd-models",
    "upscalers",
    "latent-upscale-modes",
    "loras",
    "sd-vae",
)


# -- the mapping, read without a worker ----------------------------------------------------------

WEBUIAPI_NEUTRAL = {  # what webuiapi sends on every txt2img, beside the fields a test sets
    "enable_hr": False,
    "hr_scale": 2,
    "hr_upscaler": "Latent",
    "hr_second_pass_steps": 0,
    "hr_resize_x": 0,
    "hr_resize_y": 0,
    "hr_checkpoint_name": None,
    "hr_sampler_name": None,
    "hr_scheduler": None,
    "hr_prompt": "",
    "hr_negative_prompt": "",
    "denoising_strength": 0.7,
    "firstphase_width": 0,
    "firstphase_height": 0,
    "styles": [],
    "seed": -1,
    "subseed": -1,
    "subseed_strength": 0.0,
    "seed_resize_from_h": 0,
    "seed_resize_from_w": 0,
    "n_iter": 1,
    "restore_faces": False,
    "tiling": False,
    "do_not_save_samples": False,
    "do_not_save_grid": False,
    "eta": 1.0,
    "s_churn": 0,
    "s_tmax": 0,
    "s_tmin": 0,
    "s_noise": 1,
    "override_settings": {},
    "override_settings_restore_afterwards": True,
    "sampler_index": "Euler a",
    "scheduler": "automatic",
    "script_name": None,
    "script_args": [],
    "send_images": True,
    "save_images": False,
    "alwayson_scripts": {},
}


def manifest() -> Any:
    return load_manifests(MANIFESTS, [MODEL])[MODEL]


def test_webuiapis_neutral_values_read_as_absent() -> None:
    reading = fields.read(WEBUIAPI_NEUTRAL | {"prompt": "p"}, manifest(), img2img=False)
    assert reading.mapped == {
        "model": MODEL,
        "prompt": "p",
        "num_images": 1,
        "sampler": "euler_ancestral",
        "previews": True,
    }


def test_hires_loras_and_schedules_map_onto_kiln() -> None:
    body = {
        "prompt": "a fox <lora:detail:0.6> at dawn <lora:style>",
        "enable_hr": True,
        "hr_scale": 1.5,
        "denoising_strength": 0.4,
        "hr_second_pass_steps": 3,
        "sampler_name": "DPM++ 2M",
        "scheduler": "Karras",
        "batch_size": 2,
        "n_iter": 2,
    }
    mapped = fields.read(body, manifest(), img2img=False).mapped
    assert mapped["hires"] == {"scale": 1.5, "strength": 0.4, "steps": 3, "upscaler": "latent"}
    assert mapped["loras"] == [{"name": "detail", "weight": 0.6}, {"name": "style"}]
    assert mapped["prompt"] == "a fox  at dawn" and mapped["num_images"] == 4
    assert (mapped["sampler"], mapped["sigmas"]) == ("dpmpp_2m", "karras")
    # The pre-1.9 form, the schedule in the sampler's name; and kiln's own fields win.
    old = fields.read({"sampler_name": "DPM++ 2M Karras", "sampler": "euler"}, manifest(), False)
    assert (old.mapped["sampler"], old.mapped["sigmas"]) == ("euler", "karras")


def test_a_field_a1111_does_not_know_is_ignored_as_a1111_ignores_it() -> None:
    # Forge's FLUX field and a typo alike: A1111's own models drop unknown fields.
    body = {"prompt": "p", "distilled_cfg_scale": 3.5, "promt": "typo"}
    assert fields.read(body, manifest(), img2img=False).mapped == fields.read(
        {"prompt": "p"}, manifest(), img2img=False
    ).mapped
