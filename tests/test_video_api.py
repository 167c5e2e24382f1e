"""A video job goes everywhere an image job goes (issue 41 item 4): `kiln submit --frames --fps`
and its printed result, the Python client's fetch and download, the gateway's
/v1/jobs/{id}/videos/{n} (tenants' rules, byte ranges, the OpenAPI document) and the S3 store's
presigned URLs. Two tiny-wan jobs (4 steps, 9 frames, 64x64) are rendered once for the module by
a burst worker in this process over a real Redis, behind a real `kiln api` on a free port; one
is submitted by the real command line, one over HTTP by a tenant."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from api_client import FetchFailed, KilnClient, inputs, keys
from api_client.http import tenancy
from api_client.http.tokens import Tokens
from api_client.schema import RenderResult, VideoFile
from tests.conftest import MANIFESTS, ROOT
from tests.fixtures.gateway import Gateway, call, start_gateway
from tests.s3server import BUCKET
from tests.support.inprocess import burst, make_renderer
from tests.workers import free_port, wait_until
from worker.files import video
from worker.settings import Settings

MODEL = "tiny-wan"
FLAGS = ["--model", MODEL, "--steps", "4", "--frames", "9", "--width", "64", "--height", "64"]
ALICES = {"model": MODEL, "prompt": "a red fox", "steps": 4, "frames": 9, "fps": 12, "seed": 3}


@dataclass
class Rendered:
    """The module's two finished video jobs and the gateway that serves them."""

    conn: Redis
    settings: Settings
    gateway: Gateway
    admin: str
    alice: str
    bob: str
    cli_job: str  # kiln submit's: mp4 at 8 fps, no tenant's (the admin sees it)
    cli_stdout: str
    alice_job: str  # Alice's over HTTP: webm at 12 fps

    def client(self) -> KilnClient:
        return KilnClient(connection=self.conn, manifests_dir=self.settings.manifests)

    def get(self, path: str, token: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
        return call("GET", self.gateway.url + path, token, headers=headers)


@pytest.fixture(scope="module")
def rendered(
    tiny_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Rendered]:
    directory = tmp_path_factory.mktemp("video_api")
    settings = Settings(
        redis_url=redis_url,
        manifests=MANIFESTS,
        models_dir=tiny_dir,
        output_dir=directory / "out",
        timings_log=directory / "out" / "timings.jsonl",
        inductor_cache_dir=directory / "inductor",
    )
    conn = Redis.from_url(redis_url)
    conn.flushdb()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(
        KILN_REDIS_URL=redis_url,
        KILN_MANIFESTS=str(MANIFESTS),
        KILN_MODELS_DIR=str(tiny_dir),
        KILN_OUTPUT_DIR=str(settings.output_dir),
        PYTHONUNBUFFERED="1",
    )
    tokens = Tokens(conn)
    alice, bob = tokens.create("alice"), tokens.create("bob")
    gateway, admin = start_gateway(env, conn, directory, free_port())
    try:
        # 1. The command line submits and waits; Alice submits over HTTP.
        command = [sys.executable, "-m", "worker.cli", "submit", "a red fox", *FLAGS]
        command += ["--fps", "8", "--seed", "5", "--wait", "--queue-anyway"]
        cli = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        status, _, body = call(
            "POST",
            gateway.url + "/v1/jobs",
            alice,
            {**ALICES, "width": 64, "height": 64, "output_format": "webm"},
        )
        assert status == 201, body
        queue = keys.rq_queue_key(keys.queue_name(MODEL, "interactive"))
        wait_until(lambda: conn.llen(queue) == 2, 30, "both jobs queued")
        # 2. A worker renders both, here.
        burst(conn, make_renderer(settings, [MODEL]), [MODEL])
        stdout, _ = cli.communicate(timeout=60)
        assert cli.returncode == 0, stdout
        cli_job = stdout.split()[1]  # "done <id> ..."
        yield Rendered(
            conn, settings, gateway, admin, alice, bob, cli_job, stdout, json.loads(body)["id"]
        )
    finally:
        gateway.stop()
        conn.flushdb()
        conn.close()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_kiln_submit_renders_frames_at_fps_and_prints_the_video(rendered: Rendered) -> None:
    lines = rendered.cli_stdout.splitlines()
    assert lines[0].startswith(f"done {rendered.cli_job}  {MODEL}  seed 5  4 steps"), lines
    [shown] = [line for line in lines if "frames at" in line]
    stored = rendered.settings.output_dir / rendered.cli_job / "0.mp4"
    assert shown.split()[0] == str(stored.resolve())
    assert "9 frames at 8 fps, 1.125 s" in shown, shown


def test_the_client_fetches_and_downloads_a_video_checked(
    rendered: Rendered, tmp_path: Path
) -> None:
    client = rendered.client()
    result = client.job(rendered.cli_job).result()
    assert result is not None and result.images == []
    [made] = result.videos
    assert (made.frames, made.fps, made.format, made.duration_s) == (9, 8, "mp4", 1.125)
    data = client.fetch(made)
    assert sha256(data) == made.sha256
    info = video.probe(data)
    assert (info.frames, info.fps, info.width, info.height) == (9, 8, 64, 64)
    # From the file:// uri alone (another host's view has no path), and refused when the bytes
    # are not the result's.
    assert client.fetch(made.model_copy(update={"path": None})) == data
    with pytest.raises(FetchFailed, match="sha256"):
        client.fetch(made.model_copy(update={"sha256": "0" * 64}))
    [path] = client.job(rendered.cli_job).download(tmp_path, timeout=5)
    assert path == tmp_path / f"{rendered.cli_job}-0.mp4"
    assert path.read_bytes() == data


def test_the_owner_gets_the_video_over_http_whole_and_in_ranges(rendered: Rendered) -> None:
    job, alice = rendered.alice_job, rendered.alice
    status, _, body = rendered.get(f"/v1/jobs/{job}", alice)
    assert status == 200, body
    view = json.loads(body)
    [shown] = view["result"]["videos"]
    # As an image is shown: the gateway's URL, the opaque uri, no path, no store anywhere.
    assert shown["url"] == f"{rendered.gateway.url}/v1/jobs/{job}/videos/0"
    assert shown["uri"] == f"kiln-output:{job}/0" and shown["path"] is None
    assert str(rendered.settings.output_dir).encode() not in body
    assert (shown["frames"], shown["fps"], shown["format"]) == (9, 12, "webm")

    status, headers, data = rendered.get(f"/v1/jobs/{job}/videos/0", alice)
    assert status == 200 and headers["content-type"] == "video/webm"
    assert headers["accept-ranges"] == "bytes" and sha256(data) == shown["sha256"]
    assert (video.probe(data).frames, video.probe(data).fps) == (9, 12)
    size = len(data)

    status, headers, part = rendered.get(f"/v1/jobs/{job}/videos/0", alice, Range="bytes=0-99")
    assert status == 206 and part == data[:100]
    assert headers["content-range"] == f"bytes 0-99/{size}"
    status, headers, tail = rendered.get(f"/v1/jobs/{job}/videos/0", alice, Range="bytes=-10")
    assert status == 206 and tail == data[-10:]
    assert headers["content-range"] == f"bytes {size - 10}-{size - 1}/{size}"
    status, headers, _ = rendered.get(f"/v1/jobs/{job}/videos/0", alice, Range=f"bytes={size}-")
    assert status == 416 and headers["content-range"] == f"bytes */{size}"
    # A range asked of other bytes (If-Range names another ETag) is answered with the whole file.
    status, _, whole = rendered.get(
        f"/v1/jobs/{job}/videos/0", alice, Range="bytes=0-9", **{"If-Range": '"other"'}
    )
    assert status == 200 and whole == data
    status, _, part = rendered.get(
        f"/v1/jobs/{job}/videos/0", alice, Range="bytes=0-9", **{"If-Range": f'"{sha256(data)}"'}
    )
    assert status == 206 and part == data[:10]


def test_only_the_owner_and_only_a_video_route_serve_a_video(rendered: Rendered) -> None:
    job = rendered.alice_job
    status, _, body = rendered.get(f"/v1/jobs/{job}/videos/0", rendered.bob)
    assert status == 404 and b"of yours" in body
    status, _, body = rendered.get(f"/v1/jobs/{job}/videos/1", rendered.alice)
    assert status == 404 and "has no video 1" in json.loads(body)["detail"]
    status, _, body = rendered.get(f"/v1/jobs/{job}/images/0", rendered.alice)
    detail = json.loads(body)["detail"]
    assert status == 404 and "is a video job" in detail and f"/v1/jobs/{job}/videos/" in detail
    # The operator sees the command line's job, an mp4.
    status, headers, data = rendered.get(f"/v1/jobs/{rendered.cli_job}/videos/0", rendered.admin)
    assert status == 200 and headers["content-type"] == "video/mp4"
    assert video.probe(data).fps == 8


def test_a_video_is_no_input_image(rendered: Rendered) -> None:
    """kiln-output: of a video job is refused naming why for its owner (and the operator);
    another tenant hears the words every object it did not make gets."""
    request = {"model": "tiny-sd15", "prompt": "a fox", "steps": 2, "strength": 0.5}
    request["image"] = f"kiln-output:{rendered.alice_job}/0"
    for token, rule in (
        (rendered.alice, inputs.VIDEO_INPUT),
        (rendered.admin, inputs.VIDEO_INPUT),
        (rendered.bob, tenancy.NOT_YOURS),
    ):
        status, _, body = call("POST", rendered.gateway.url + "/v1/jobs", token, request)
        assert status == 422, body
        assert {e["field"]: e["rule"] for e in json.loads(body)["errors"]} == {"image": rule}


def test_the_openapi_document_shows_the_videos_route(rendered: Rendered) -> None:
    status, _, body = rendered.get("/openapi.json", rendered.admin)
    route = json.loads(body)["paths"]["/v1/jobs/{job_id}/videos/{n}"]["get"]
    assert status == 200 and {"200", "206", "307", "404", "416"} <= set(route["responses"])
    assert {"video/mp4", "video/webm"} <= set(route["responses"]["200"]["content"])
    assert "range" in {p["name"].lower() for p in route["parameters"]}


def test_an_s3_store_presigns_a_video_again_and_the_client_fetches_it(
    rendered: Rendered, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved to S3 as a worker saves it, answered again from the store with a fresh presigned
    URL, fetched through that URL and, with none, through boto3."""
    from worker.files.output import EncodedImage
    from worker.files.s3 import S3Store

    result = rendered.client().job(rendered.cli_job).result()
    assert result is not None
    [made] = result.videos
    data = rendered.client().fetch(made)
    settings = Settings(redis_url=rendered.settings.redis_url, **s3.store_settings(prefix="videos"))
    store = S3Store(settings.store_location, settings)
    encoded = EncodedImage(data, 64, 64, "mp4", made.sha256, frames=9, fps=8)
    [saved] = store.save_images("s3-video", [encoded])
    assert saved.url and saved.uri == f"s3://{BUCKET}/videos/s3-video/0.mp4"
    digest = "d" * 64
    stored = result.model_copy(
        update={"job_id": "s3-video", "videos": [encoded.as_video(saved)], "request_sha256": digest}
    )
    store.write_result(stored)
    store.close_job("s3-video", keep=True)
    again = store.finished_result("s3-video", digest)
    assert again is not None
    [fresh] = again.videos
    assert fresh.url and fresh.url.startswith(s3.endpoint) and "Signature" in fresh.url
    assert rendered.client().fetch(fresh) == data
    for name, value in {
        "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    assert rendered.client().fetch(fresh.model_copy(update={"url": None})) == data


def test_a_webhook_of_a_video_job_carries_its_videos(rendered: Rendered) -> None:
    """The body a webhook target is sent for a finished video job (the end event's JSON, as
    api_client.webhooks writes it to the outbox) holds result.videos whole."""
    from api_client.schema import JobEvent
    from api_client.webhooks import OutboxEntry

    result = rendered.client().job(rendered.cli_job).result()
    assert isinstance(result, RenderResult)
    event = JobEvent(kind="done", job_id=result.job_id, model=MODEL, at=0.0, result=result)
    body = json.loads(OutboxEntry.of("target", event).body)
    [sent] = body["result"]["videos"]
    assert VideoFile.model_validate(sent) == result.videos[0]


def test_the_images_dialects_refuse_a_video_model_naming_kilns_route(rendered: Rendered) -> None:
    """OpenAI's images API and A1111's txt2img answer with images: a video model is refused
    before anything is queued, and neither lists one among its models."""
    url, alice = rendered.gateway.url, rendered.alice
    body = {"model": MODEL, "prompt": "a red fox"}
    status, _, answer = call("POST", url + "/openai/v1/images/generations", alice, body)
    error = json.loads(answer)["error"]
    assert status == 400 and error["param"] == "model" and "POST /v1/jobs" in error["message"]
    status, _, answer = call("GET", url + "/openai/v1/models", alice)
    listed = {model["id"] for model in json.loads(answer)["data"]}
    assert status == 200 and "tiny-sd15" in listed and MODEL not in listed
    basic = "Basic " + base64.b64encode(f"webui:{alice}".encode()).decode()
    txt2img = {"prompt": "a red fox", "override_settings": {"sd_model_checkpoint": MODEL}}
    status, _, answer = call(
        "POST", url + "/sdapi/v1/txt2img", None, txt2img, headers={"Authorization": basic}
    )
    assert status == 400 and "renders video" in answer.decode(), answer
    status, _, answer = call(
        "GET", url + "/sdapi/v1/sd-models", None, headers={"Authorization": basic}
    )
    assert status == 200 and MODEL not in {m["title"] for m in json.loads(answer)}
    assert rendered.conn.llen(keys.rq_queue_key(keys.queue_name(MODEL, "interactive"))) == 0
