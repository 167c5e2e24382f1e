"""Output stores against a real S3-compatible server (moto's, over HTTP) and the local directory:
results a backend on another host can fetch, and store failures that fail one job cleanly."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
    SSLError,
)
from redis import Redis

from api_client import KilnClient, KilnJob, RenderFailed
from api_client.fetch import FetchFailed
from api_client.webhooks import verify_webhook
from tests.conftest import MANIFESTS
from tests.fixtures.flaky_s3 import FlakyS3
from tests.fixtures.gate import hold_here
from tests.fixtures.stops_after_preview import StopsAfterPreview
from tests.s3server import BUCKET, MotoServer
from tests.support.backends import start_backend
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.receivers import HookServer, targets
from tests.support.records import records
from tests.workers import STARTUP_S, WorkerProcess, free_port, wait_until
from worker.errors import JobDeadlineExceeded, ShutdownStop, StoreError, StoreUnavailable
from worker.files.s3 import _heals
from worker.render.context import LocalContext

# Standard Webhooks: whsec_ and the base64 of the key bytes.
SECRET = "whsec_" + base64.b64encode(b"studio-webhook-secret-0123456789").decode()
REQUEST = {"model": "tiny-sd15", "prompt": "a red fox", "steps": 2, "seed": 5}


def test_a_backend_on_another_host_fetches_s3_results_and_follows_events(
    redis_conn: Redis,
    redis_url: str,
    make_settings: Any,
    s3: MotoServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hooks = HookServer()
    hooks.start()
    webhooks = targets(hooks.url, SECRET)
    settings = make_settings(**s3.store_settings(), webhooks=webhooks)
    renderer = make_renderer(settings, ["tiny-sd15"])
    from tests.support.inprocess import make_worker

    worker = make_worker(redis_conn, renderer, ["tiny-sd15"])  # publishes the target names
    # The backend: another process, with Redis only (no AWS_*, no KILN_OUTPUT_*).
    backend_dir = tmp_path / "backend"
    backend = start_backend(
        "tests.remote_client", redis_url, "tiny-sd15", str(backend_dir), "studio"
    )
    try:
        wait_until(lambda: redis_conn.llen("rq:queue:kiln:tiny-sd15") == 1, 30, "the job queued")
        # The job waits at its step 2 until that progress is in its stream for the backend.
        [queued] = redis_conn.lrange("rq:queue:kiln:tiny-sd15", 0, -1)
        job = KilnJob(queued.decode(), redis_conn)
        hold_here(monkeypatch, lambda step: job.progress() is not None)
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
    assert delivery.headers["Kiln-Event"] == "done" and delivery.headers["webhook-id"]
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
    # Presigned URLs carry a timestamp to the second: the next one is signed in a later second.
    second = int(time.time())
    wait_until(lambda: int(time.time()) > second, 5, "the next second")
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
    """The queued job fails at once (no retry) with a StoreError whose message has pattern."""
    client = client_for(redis_conn, settings)
    job = client.submit(REQUEST)
    burst(redis_conn, renderer, ["tiny-sd15"])
    with pytest.raises(RenderFailed) as caught:
        job.wait(timeout=5)
    message = caught.value.message
    assert pattern in message, message
    assert secret is None or secret not in message
    # Permanent: failed at once, not taken for an outage that heals.
    error = records(settings.timings_log)[-1].error or ""
    assert error.startswith("StoreError: "), error
    return job.id


def test_an_unreachable_store_is_unavailable_and_serves_the_next_job_when_back(
    make_settings: Any, tmp_path: Path
) -> None:
    """Connections refused: a failure that heals (StoreUnavailable, which the queue puts back),
    named, within seconds, never printing the secret; the same renderer serves the store when
    it is back."""
    server = MotoServer(tmp_path / "moto.log", port=free_port())
    settings = make_settings(**server.store_settings())
    renderer = make_renderer(settings, ["tiny-sd15"])
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        renderer.render(REQUEST, LocalContext("while-down"))
    assert time.monotonic() - started < 30
    message, cause = str(caught.value), caught.value.cause
    assert f"s3://{BUCKET}/renders/while-down/" in message, message
    assert f"at endpoint {server.endpoint}" in message and server.endpoint in cause
    assert server.secret_key not in message + cause
    [record] = records(settings.timings_log)
    assert (record.error or "").startswith("StoreUnavailable: "), record.error
    server.start()
    try:
        server.setup()
        after = renderer.render(REQUEST, LocalContext("after"))
        assert after.images[0].uri == f"s3://{BUCKET}/renders/after/0.png"
    finally:
        server.stop()


def _answer(status: int, code: str) -> ClientError:
    return ClientError(
        {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )


@pytest.mark.parametrize(
    ("failure", "heals"),
    [
        (EndpointConnectionError(endpoint_url="http://s3"), True),  # refused, or no DNS
        (ConnectTimeoutError(endpoint_url="http://s3"), True),
        (ReadTimeoutError(endpoint_url="http://s3"), True),
        (ConnectionClosedError(endpoint_url="http://s3"), True),  # reset mid-answer
        (_answer(503, "SlowDown"), True),
        (_answer(500, "InternalError"), True),
        (_answer(429, "TooManyRequests"), True),
        (_answer(400, "RequestTimeout"), True),
        (SSLError(endpoint_url="http://s3", error="certificate verify failed"), False),
        (_answer(404, "NoSuchBucket"), False),
        (_answer(403, "AccessDenied"), False),
        (_answer(403, "InvalidAccessKeyId"), False),
        (_answer(501, "NotImplemented"), False),
    ],
)
def test_which_s3_failures_heal(failure: Exception, heals: bool) -> None:
    """The table the queue's put-back rests on, for the failures a live server is slow to stage
    (a read timeout takes 2 x 10 s; TLS needs certificates)."""
    assert _heals(failure) == heals


@pytest.fixture
def flaky(s3: MotoServer) -> Iterator[FlakyS3]:
    proxy = FlakyS3(s3.endpoint)
    proxy.start()
    yield proxy
    proxy.stop()


def _through(proxy: FlakyS3, s3: MotoServer, prefix: str) -> dict[str, Any]:
    return {**s3.store_settings(prefix=prefix), "aws_endpoint_url": proxy.endpoint}


@pytest.mark.parametrize(
    ("failing", "status", "code", "heals"),
    [
        ("1.png", 503, "SlowDown", True),
        ("result.json", 500, "InternalError", True),
        ("1.png", 403, "AccessDenied", False),
        ("result.json", 404, "NoSuchBucket", False),
    ],
)
def test_a_put_failing_after_the_first_image_leaves_no_objects(
    make_settings: Any,
    s3: MotoServer,
    flaky: FlakyS3,
    failing: str,
    status: int,
    code: str,
    heals: bool,
) -> None:
    """Image 0 is in the bucket when image 1 (or result.json) fails: both are gone afterwards.
    A 5xx heals (StoreUnavailable); a 4xx is the operator's to fix (StoreError, at once)."""
    prefix = f"partial-{code.lower()}"
    settings = make_settings(**_through(flaky, s3, prefix))
    renderer = make_renderer(settings, ["tiny-sd15"])
    flaky.fail("PUT", f"*/{prefix}/half/{failing}", status, code)
    with pytest.raises(StoreError if not heals else StoreUnavailable) as caught:
        renderer.render({**REQUEST, "num_images": 2}, LocalContext("half"))
    assert isinstance(caught.value, StoreUnavailable) == heals
    assert f"s3://{BUCKET}/{prefix}/half/{failing}" in str(caught.value)
    assert ("PUT", f"/{BUCKET}/{prefix}/half/0.png") in flaky.passed  # a partial result existed
    assert s3.keys_under(f"{prefix}/half/") == []


@pytest.mark.parametrize("hanging", ["1.png", "result.json"])
def test_a_deadline_landing_inside_the_save_leaves_no_objects(
    redis_conn: Redis, make_settings: Any, s3: MotoServer, flaky: FlakyS3, hanging: str
) -> None:
    """The store takes image 0, then holds the next put until the job's deadline (SIGALRM,
    JobDeadlineExceeded) lands inside boto3: the job fails on time, and its objects go."""
    prefix = f"deadline-{hanging.replace('.', '-')}"
    settings = make_settings(**_through(flaky, s3, prefix), job_timeout_s=10)
    renderer = make_renderer(settings, ["tiny-sd15"])
    two = {**REQUEST, "num_images": 2}
    renderer.render(two, LocalContext("warm-up"))  # loaded and warm before the clock starts
    client = client_for(redis_conn, settings)
    job = client.submit(two)
    flaky.hang("PUT", f"*/{prefix}/{job.id}/{hanging}")
    started = time.monotonic()
    burst(redis_conn, renderer, ["tiny-sd15"])
    assert flaky.hung.is_set() and time.monotonic() - started < 30
    with pytest.raises(RenderFailed, match="ran past its timeout of 10 s"):
        job.wait(timeout=5)
    assert ("PUT", f"/{BUCKET}/{prefix}/{job.id}/0.png") in flaky.passed
    assert s3.keys_under(f"{prefix}/{job.id}/") == []


@pytest.mark.parametrize(
    "stop",
    [ShutdownStop("second SIGTERM; re-queued"), JobDeadlineExceeded("ran past its timeout")],
    ids=["second-sigterm", "deadline"],
)
def test_a_job_ending_after_its_preview_leaves_no_objects(
    make_settings: Any, s3: MotoServer, stop: BaseException
) -> None:
    """A preview is put at a quarter of the steps; a job stopped or timed out after it leaves
    no preview.jpg behind (a finished job keeps it: the first test)."""
    prefix = f"preview-{type(stop).__name__.lower()}"
    settings = make_settings(**s3.store_settings(prefix=prefix))
    renderer = make_renderer(settings, ["tiny-sd15"])
    ctx = StopsAfterPreview("previewed", stop=stop)
    with pytest.raises(type(stop)):
        renderer.render({**REQUEST, "steps": 8, "previews": True}, ctx)
    assert ctx.previews == [f"s3://{BUCKET}/{prefix}/previewed/preview.jpg"]
    assert s3.keys_under(f"{prefix}/previewed/") == []


def test_a_local_job_ending_after_its_preview_leaves_no_files(settings: Any) -> None:
    renderer = make_renderer(settings, ["tiny-sd15"])
    ctx = StopsAfterPreview("previewed", stop=ShutdownStop("second SIGTERM; re-queued"))
    with pytest.raises(ShutdownStop):
        renderer.render({**REQUEST, "steps": 8, "previews": True}, ctx)
    assert ctx.previews and Path(urlparse(ctx.previews[0]).path).name == "preview.jpg"
    assert not (settings.output_dir / "previewed").exists()


@pytest.mark.slow  # a signal drill on a worker process (19 s): make test keeps under 12 minutes
def test_a_second_sigterm_during_the_save_leaves_a_whole_result_or_none(
    redis_conn: Redis,
    kiln_env: dict[str, str],
    s3: MotoServer,
    flaky: FlakyS3,
    tmp_path: Path,
) -> None:
    """A real `kiln worker` is putting image 1 when it gets SIGTERM twice. Whatever the worker
    then does with the job (finish it, or stop it and put it back), the bucket holds the whole
    result or nothing of it, and the job is done or queued again accordingly."""
    store = _through(flaky, s3, "sigterm")
    env = {
        **kiln_env,
        "KILN_OUTPUT_URL": store["output_url"],
        "AWS_ENDPOINT_URL": store["aws_endpoint_url"],
        "AWS_REGION": store["aws_region"],
        "AWS_ACCESS_KEY_ID": store["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": store["aws_secret_access_key"],
    }
    client = KilnClient(connection=redis_conn, manifests_dir=MANIFESTS)
    job = client.submit({**REQUEST, "num_images": 2})
    flaky.hang("PUT", f"*/sigterm/{job.id}/1.png")
    worker = WorkerProcess(env, tmp_path / "worker.log", "--models", "tiny-sd15")
    try:
        wait_until(flaky.hung.is_set, STARTUP_S, "the worker to put image 1")
        worker.signal(signal.SIGTERM)
        wait_until(lambda: "warm shutdown requested" in worker.output(), 30, "the first SIGTERM")
        worker.signal(signal.SIGTERM)
        wait_until(lambda: "shutdown now requested" in worker.output(), 30, "the second SIGTERM")
        flaky.release()
        assert worker.wait(timeout=60) == 0, worker.output()
    finally:
        worker.stop()
    names = [key.rsplit("/", 1)[1] for key in s3.keys_under(f"sigterm/{job.id}/")]
    if names:
        assert names == ["0.png", "1.png", "result.json"] and job.status() == "finished"
    else:
        assert job.status() == "queued", worker.output()


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
