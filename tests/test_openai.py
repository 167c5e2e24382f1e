"""OpenAI's Images API on the gateway, driven by the real `openai` SDK, unchanged, against a real
`kiln api` and a real worker (a burst worker in this process) rendering the tiny models.

The gateway answers at once when no live worker serves a model, so each test first publishes a
live worker's state for tiny-sd15 (what a `kiln worker` heartbeat writes); the jobs themselves
are rendered by the burst worker."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
from redis import Redis

from api_client import keys
from api_client.http.tokens import Tokens
from tests.fixtures.gateway import call
from tests.support.fleet import live_worker
from tests.support.inprocess import burst, client_for, make_renderer

MODEL = "tiny-sd15"
KILN = {"seed": 7, "steps": 2}


@pytest.fixture
def sdk(gateway: Any, redis_conn: Redis) -> openai.OpenAI:
    """The SDK pointed at the gateway with a jobs token as its API key, no retries."""
    live_worker(redis_conn, [MODEL])
    key = Tokens(redis_conn).create("webui")
    return openai.OpenAI(base_url=gateway.url + "/openai/v1", api_key=key, max_retries=0)


def rendered(conn: Redis, settings: Any, work: Callable[[], Any]) -> Any:
    """work() (an SDK call held open until its job ends) in a thread, with a burst worker
    rendering what it queued; what work returned."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    queue = keys.rq_queue_key(keys.queue_name(MODEL, "interactive"))
    deadline = time.monotonic() + 60
    while not conn.llen(queue) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    burst(conn, make_renderer(settings, [MODEL]), [MODEL])
    thread.join(timeout=120)
    assert not thread.is_alive(), "the held call did not answer after its job ended"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_generate_answers_the_images_of_a_kiln_job(
    sdk: openai.OpenAI, redis_conn: Redis, settings: Any, gateway: Any
) -> None:
    answer = rendered(
        redis_conn,
        settings,
        lambda: sdk.images.generate(
            model=MODEL, prompt="a red fox", n=2, size="192x128", extra_body=KILN
        ),
    )
    assert answer.size == "192x128" and answer.output_format == "png" and answer.usage is not None
    assert answer.data is not None and len(answer.data) == 2
    pngs = [base64.b64decode(image.b64_json or "") for image in answer.data]
    from PIL import Image

    assert all(Image.open(io.BytesIO(png)).size == (192, 128) for png in pngs)
    # A kiln job like any other: the token's job list has it, with the request as mapped.
    jobs = call("GET", gateway.url + "/v1/jobs", sdk.api_key)
    [job] = json.loads(jobs[2])["jobs"]
    assert job["request"]["num_images"] == 2 and job["request"]["seed"] == 7
    # The same seed through kiln's own API renders the same pixels.
    own = client_for(redis_conn, settings).submit(
        {"model": MODEL, "prompt": "a red fox", "num_images": 2, "width": 192, "height": 128} | KILN
    )
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    result = own.result()
    assert result is not None
    assert [image.sha256 for image in result.images] == [
        hashlib.sha256(png).hexdigest() for png in pngs
    ]


def test_url_and_webp_answers(sdk: openai.OpenAI, redis_conn: Redis, settings: Any) -> None:
    answer = rendered(
        redis_conn,
        settings,
        lambda: sdk.images.generate(
            model=MODEL,
            prompt="a lighthouse",
            response_format="url",
            output_format="webp",
            quality="low",
            extra_body={"seed": 3},
        ),
    )
    [image] = answer.data or []
    assert image.url is not None and image.url.startswith("http://127.0.0.1:")
    status, headers, body = call("GET", image.url, sdk.api_key)
    assert status == 200 and headers["content-type"] == "image/webp" and body[8:12] == b"WEBP"


def test_streaming_sends_partials_then_the_image(
    sdk: openai.OpenAI, redis_conn: Redis, settings: Any
) -> None:
    def stream() -> list[Any]:
        events = sdk.images.generate(
            model=MODEL,
            prompt="a harbour",
            stream=True,
            partial_images=2,
            extra_body={"seed": 5, "steps": 8},
        )
        return list(events)

    events = rendered(redis_conn, settings, stream)
    kinds = [event.type for event in events]
    assert kinds[-1] == "image_generation.completed", kinds
    partials = [e for e in events if e.type == "image_generation.partial_image"]
    assert 1 <= len(partials) <= 2 and [p.partial_image_index for p in partials] == list(
        range(len(partials))
    )
    assert base64.b64decode(partials[0].b64_json)[:2] == b"\xff\xd8"  # the worker's preview
    assert base64.b64decode(events[-1].b64_json)[:4] == b"\x89PNG"


def test_refusals_come_in_openais_shape(sdk: openai.OpenAI, redis_conn: Redis) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.images.generate(model="dall-e-3", prompt="x")
    assert missing.value.body["param"] == "model" and missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as size:
        sdk.images.generate(model=MODEL, prompt="x", size="1024x1024")
    assert size.value.body["param"] == "size" and "128x128" in size.value.message
    with pytest.raises(openai.BadRequestError) as steps:
        sdk.images.generate(model=MODEL, prompt="x", extra_body={"steps": 999})
    assert steps.value.body["param"] == "steps" and "manifest max" in steps.value.message
    with pytest.raises(openai.BadRequestError) as transparent:
        sdk.images.generate(model=MODEL, prompt="x", background="transparent")
    assert transparent.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError) as unknown:
        sdk.images.generate(model=MODEL, prompt="x", extra_body={"wobble": 1})
    assert unknown.value.body["param"] == "wobble"
    # A model no live worker serves: at once, not a call held for a worker that may never come.
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as unserved:
        sdk.images.generate(model="tiny-sdxl", prompt="x")
    assert unserved.value.status_code == 503 and time.monotonic() - started < 5
    assert unserved.value.body["code"] == "model_not_served"
    wrong = openai.OpenAI(base_url=str(sdk.base_url), api_key="kiln_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.images.generate(model=MODEL, prompt="x")
    queue = keys.rq_queue_key(keys.queue_name(MODEL, "interactive"))
    assert redis_conn.llen(queue) == 0  # nothing refused was queued


def test_models_name_every_manifest(sdk: openai.OpenAI) -> None:
    ids = [model.id for model in sdk.models.list()]
    assert MODEL in ids and "tiny-sdxl" in ids and ids == sorted(ids)


def png(size: tuple[int, int], mode: str = "RGB", color: Any = (200, 40, 40)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new(mode, size, color).save(out, format="PNG")
    return out.getvalue()


def test_an_edit_without_a_mask_is_img2img_at_the_images_size(
    sdk: openai.OpenAI, redis_conn: Redis, settings: Any, gateway: Any
) -> None:
    answer = rendered(
        redis_conn,
        settings,
        lambda: sdk.images.edit(
            model=MODEL,
            image=("fox.png", png((192, 128)), "image/png"),
            prompt="a red fox in snow",
            extra_body={"seed": 4, "steps": 4},
        ),
    )
    [image] = answer.data or []
    assert answer.size == "192x128" and base64.b64decode(image.b64_json or "")[:4] == b"\x89PNG"
    [job] = json.loads(call("GET", gateway.url + "/v1/jobs", sdk.api_key)[2])["jobs"]
    assert job["request"]["mode"] == "img2img" and job["request"]["image"].startswith("kiln-input:")


def test_an_edit_with_an_alpha_mask_inpaints_its_transparent_pixels(
    sdk: openai.OpenAI, redis_conn: Redis, settings: Any, gateway: Any
) -> None:
    from PIL import Image

    mask = Image.new("RGBA", (128, 128), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 64, 128))  # the left half transparent: OpenAI edits it
    out = io.BytesIO()
    mask.save(out, format="PNG")
    rendered(
        redis_conn,
        settings,
        lambda: sdk.images.edit(
            model=MODEL,
            image=("fox.png", png((128, 128)), "image/png"),
            mask=("mask.png", out.getvalue(), "image/png"),
            prompt="a red fox in snow",
            extra_body={"seed": 4, "steps": 4},
        ),
    )
    [job] = json.loads(call("GET", gateway.url + "/v1/jobs", sdk.api_key)[2])["jobs"]
    assert job["request"]["mode"] == "inpaint" and job["status"] == "finished", job
    sha = job["request"]["mask"].removeprefix("kiln-input:")
    kept = Image.open(io.BytesIO(redis_conn.get(keys.input_key(sha)) or b""))
    assert kept.getpixel((10, 10)) == 255 and kept.getpixel((100, 10)) == 0  # kiln's: white


def test_an_edit_refuses_a_size_it_would_have_to_resize_to(
    sdk: openai.OpenAI, redis_conn: Redis
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.images.edit(
            model=MODEL, image=("fox.png", png((128, 128)), "image/png"), prompt="x", size="192x128"
        )
    assert refused.value.body["param"] == "size" and "never resizes" in refused.value.message
