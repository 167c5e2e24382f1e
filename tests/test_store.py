"""Output stores against a real S3-compatible server (moto's, over HTTP) and the local directory:
results a backend on another host can fetch, and store failures that fail one job cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from api_client import RenderFailed
from api_client.fetch import FetchFailed
from api_client.webhooks import verify_webhook
from tests.conftest import ROOT
from tests.helpers import burst, client_for, make_renderer, records
from tests.hookserver import HookServer
from tests.s3server import BUCKET, MotoServer
from tests.workers import free_port, pace_here, wait_until
from worker.context import LocalContext

SECRET = "studio-webhook-secret-0123456789"
REQUEST = {"model": "tiny-sd15", "prompt": "a red fox", "steps": 2, "seed": 5}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    server.setup()
    yield server
    server.stop()


def test_a_backend_on_another_host_fetches_s3_results_and_follows_events(
    redis_conn: Redis,
    redis_url: str,
    make_settings: Any,
    s3: MotoServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pace_here(monkeypatch, 0.1)  # 8 steps outlast a progress interval, however fast the machine
    hooks = HookServer()
    hooks.start()
    webhooks = json.dumps({"studio": {"url": hooks.url, "secret": SECRET}})
    settings = make_settings(**s3.store_settings(), webhooks=webhooks)
    renderer = make_renderer(settings, ["tiny-sd15"])
    from worker.queue import make_worker

    worker = make_worker(redis_conn, renderer, ["tiny-sd15"])  # publishes the target names
    # The backend: another process, with Redis only (no AWS_*, no KILN_OUTPUT_*).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KILN_"))}
    backend_dir = tmp_path / "backend"
    argv = [sys.executable, "-m", "tests.remote_client", redis_url, "tiny-sd15"]
    backend = subprocess.Popen(
        [*argv, str(backend_dir), "studio"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: redis_conn.llen("rq:queue:kiln:tiny-sd15") == 1, 30, "the job queued")
        worker.work(burst=True)
        out, err = backend.communicate(timeout=120)
    finally:
        if backend.poll() is None:
            backend.kill()
        hooks.stop()
    assert backend.returncode == 0, err
    first, report = (json.loads(line) for line in out.strip().splitlines())
    job_id = first["job_id"]

    # Fetched over the presigned URLs, checked against the result's sha256, without boto3.
    assert report["sha256"] == report["result_sha256"] and len(report["paths"]) == 2
    assert report["uris"] == [f"s3://{BUCKET}/renders/{job_id}/{n}.png" for n in (0, 1)]
    assert report["modules"] == []
    assert s3.keys_under(f"renders/{job_id}/") == [
        f"renders/{job_id}/{name}" for name in ("0.png", "1.png", "preview.jpg", "result.json")
    ]
    assert not (settings.output_dir / job_id).exists()  # nothing on the worker's disk

    # Its life, in order, from job.events(): previews as s3 uris with bytes, never a path.
    kinds = [event["kind"] for event in report["events"]]
    assert kinds[0] == "queued" and kinds[1] == "started" and kinds[-1] == "done", kinds
    assert "progress" in kinds and kinds.count("preview") == 3
    preview = next(e for e in report["events"] if e["kind"] == "preview")["preview"]
    assert preview["uri"] == f"s3://{BUCKET}/renders/{job_id}/preview.jpg"
    assert preview["url"].startswith(s3.endpoint) and preview["data"]
    order = ["text_encode", "denoise", "decode"]
    progress = [(order.index(e["phase"]), e["step"]) for e in report["events"] if "phase" in e]
    # Forward only, never past the decode of step 8 (a progress still buffered when the job is
    # done is not written; one flushed as the decode began is).
    assert progress == sorted(progress) and progress[-1] <= (2, 8), progress
    assert all(e["steps"] == 8 for e in report["events"] if "phase" in e)

    # The webhook: signed, verifiable, the same JobEvent.
    [delivery] = hooks.wait_for(1)
    event = verify_webhook(SECRET, delivery.body, delivery.headers)
    assert event.kind == "done" and event.job_id == job_id and event.result is not None
    assert delivery.headers["Kiln-Event"] == "done" and delivery.headers["Kiln-Delivery"]
    if os.environ.get("KILN_SHOW_WEBHOOK"):  # a directory: keep this delivery to show it
        shown = Path(os.environ["KILN_SHOW_WEBHOOK"])
        (shown / "headers.json").write_text(json.dumps(delivery.headers, indent=1))
        (shown / "body.json").write_bytes(delivery.body)


def test_s3_results_are_answered_from_the_store_with_fresh_urls(
    make_settings: Any, s3: MotoServer
) -> None:
    settings = make_settings(**s3.store_settings(prefix="again"), url_expires_s=60)
    renderer = make_renderer(settings, ["tiny-sd15"])
    first = renderer.render(REQUEST, LocalContext("same-job"))
    time.sleep(1.1)  # presigned URLs carry a timestamp to the second
    again = renderer.render(REQUEST, LocalContext("same-job"))
    # Answered from the store, not rendered again. (S3 keeps no .recorded mark, so this second
    # record exists; it says where it came from and stays out of medians and fits.)
    answered = records(settings.timings_log)[-1]
    assert answered.job_id == "same-job" and answered.answered_from == "store"
    assert not answered.steady
    assert [i.sha256 for i in again.images] == [i.sha256 for i in first.images]
    assert again.images[0].url != first.images[0].url
    assert "X-Amz-Expires=60" in (again.images[0].url or "")
    from api_client.fetch import fetch_image

    assert fetch_image(again.images[0])  # sha256 checked


def test_local_results_fetch_and_download_with_sha256_checked(
    redis_conn: Redis, settings: Any, tmp_path: Path
) -> None:
    client = client_for(redis_conn, settings)
    job = client.submit({**REQUEST, "num_images": 2})
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    result = job.wait(timeout=10)
    image = result.images[0]
    assert image.uri == Path(image.path or "").as_uri() and image.url is None
    assert client.fetch(image) == Path(image.path or "").read_bytes()
    paths = job.download(tmp_path / "dl")
    assert [p.name for p in paths] == [f"{job.id}-0.png", f"{job.id}-1.png"]
    Path(image.path or "").write_bytes(b"tampered")
    with pytest.raises(FetchFailed, match="does not match the result's"):
        client.fetch(image)


def _fails_naming(
    redis_conn: Redis, settings: Any, renderer: Any, pattern: str, secret: str | None = None
) -> str:
    client = client_for(redis_conn, settings)
    job = client.submit(REQUEST)
    burst(redis_conn, renderer, ["tiny-sd15"])
    with pytest.raises(RenderFailed) as caught:
        job.wait(timeout=5)
    message = caught.value.message
    assert pattern in message, message
    assert secret is None or secret not in message
    return job.id


def test_unreachable_store_fails_the_job_and_serves_the_next_when_back(
    redis_conn: Redis, make_settings: Any, tmp_path: Path
) -> None:
    server = MotoServer(tmp_path / "moto.log", port=free_port())
    settings = make_settings(**server.store_settings())
    renderer = make_renderer(settings, ["tiny-sd15"])
    started = time.monotonic()
    job_id = _fails_naming(
        redis_conn,
        settings,
        renderer,
        f"s3://{BUCKET}/renders/",
        secret=server.secret_key,
    )
    assert time.monotonic() - started < 60
    [record] = records(settings.timings_log)
    assert f"at endpoint {server.endpoint}" in (record.error or "")
    # The store comes back: the same worker's next job lands there.
    server.start()
    try:
        server.setup()
        client = client_for(redis_conn, settings)
        after = client.submit(REQUEST)
        burst(redis_conn, renderer, ["tiny-sd15"])
        assert after.wait(timeout=5).images[0].uri == f"s3://{BUCKET}/renders/{after.id}/0.png"
        assert server.keys_under(f"renders/{job_id}/") == []  # no partial result
    finally:
        server.stop()


def test_missing_bucket_fails_the_job_naming_endpoint_bucket_and_key(
    redis_conn: Redis, make_settings: Any, s3: MotoServer
) -> None:
    settings = make_settings(**s3.store_settings(bucket="no-such-bucket"))
    job_id = _fails_naming(
        redis_conn,
        settings,
        make_renderer(settings, ["tiny-sd15"]),
        "s3://no-such-bucket/renders/",
        secret=s3.secret_key,
    )
    [record] = records(settings.timings_log)
    error = record.error or ""
    assert f"renders/{job_id}/" in error and f"at endpoint {s3.endpoint}" in error
    assert "the bucket does not exist" in error


def test_wrong_credentials_fail_the_job_without_printing_the_secret(
    redis_conn: Redis, make_settings: Any, tmp_path: Path
) -> None:
    server = MotoServer(tmp_path / "moto.log", auth=True)
    server.start()
    try:
        server.setup()  # an IAM user and its real key; from here on moto checks every request
        good = server.store_settings()
        wrong_secret = "wrong-secret-key-0123456789"
        settings = make_settings(**{**good, "aws_secret_access_key": wrong_secret})
        renderer = make_renderer(settings, ["tiny-sd15"])
        _fails_naming(
            redis_conn, settings, renderer, "the secret key is wrong", secret=wrong_secret
        )
        unknown = make_settings(**{**good, "aws_access_key_id": "AKIAUNKNOWNKEY000000"})
        renderer.settings = unknown
        _fails_naming(redis_conn, unknown, renderer, "the access key is not known")
        # Fixed credentials: the same worker carries on.
        renderer.settings = make_settings(**good)
        client = client_for(redis_conn, renderer.settings)
        job = client.submit(REQUEST)
        burst(redis_conn, renderer, ["tiny-sd15"])
        assert job.wait(timeout=5).images[0].uri == f"s3://{BUCKET}/renders/{job.id}/0.png"
    finally:
        server.stop()
