"""Beyond a text prompt (#17 items 1-2): img2img and inpaint on every family that has them,
from images uploaded into Redis by sha256, through a real worker; what a request may not do is
refused at submit naming field, value and rule; an input changed after upload fails its job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from redis import Redis

from api_client import RenderFailed, RequestRejected
from api_client.keys import input_key
from tests.conftest import kiln
from tests.support.backends import start_backend
from tests.support.images import mask_png, pixels, png
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from tests.workers import wait_until

MODELS = ["tiny-sd15", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-qwenimage", "tiny-zimage"]


@pytest.mark.parametrize("model", MODELS)
def test_img2img_and_inpaint_render_through_a_worker(
    redis_conn: Redis, settings: Any, model: str
) -> None:
    client = client_for(redis_conn, settings)
    source, mask = client.upload(png()), client.upload(mask_png())
    base = {"model": model, "prompt": "a fox", "steps": 4, "seed": 5}
    plain = client.submit(base)
    varied = client.submit({**base, "image": source, "strength": 0.5})
    painted = client.submit({**base, "image": source, "mask": mask})
    burst(redis_conn, make_renderer(settings, [model]), [model])
    by_id = {r.job_id: r for r in records(settings.timings_log)}

    modes = [(by_id[j.id].mode, by_id[j.id].strength) for j in (plain, varied, painted)]
    assert modes == [("txt2img", None), ("img2img", 0.5), ("inpaint", 0.75)]
    for job in (varied, painted):
        record = by_id[job.id]
        assert record.status == "done" and record.timings.denoise > 0
    # strength 0.5 of 4 steps: the denoiser runs the last 2 (diffusers' get_timesteps)
    assert by_id[varied.id].per_step_s == pytest.approx(by_id[varied.id].timings.denoise / 2)
    # The input and the mask each change the render (the tiny VAE's random weights keep no
    # pixel of the source, so closeness to it says nothing here).
    shown = [pixels(job.wait(timeout=5).images[0].path) for job in (plain, varied, painted)]
    assert not np.array_equal(shown[0], shown[1]) and not np.array_equal(shown[1], shown[2])


def test_inputs_are_checked_before_anything_is_enqueued(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    source = client.upload(png())
    small = client.upload(png((64, 64)))
    cases = [
        ({"model": "tiny-flux2", "image": source}, "mode", "must be one of txt2img"),
        ({"mode": "img2img"}, "image", "mode img2img needs an image"),
        ({"mode": "inpaint", "image": source}, "mask", "mode inpaint needs a mask"),
        ({"mode": "txt2img", "image": source}, "image", "mode txt2img takes no image"),
        ({"strength": 0.5}, "strength", "mode txt2img takes none"),
        ({"image": source, "strength": 1.5}, "strength", "above 0 and at most 1"),
        ({"image": source, "strength": 0.1}, "strength", "needs at least 1"),
        ({"image": "https://example.com/fox.png"}, "image", "kiln never fetches URLs"),
        ({"image": "/etc/passwd"}, "image", "a path on the worker's disk is never read"),
        ({"image": small, "width": 128, "height": 128}, "image", "must be the job's size"),
        ({"image": source, "mask": client.upload(mask_png((64, 64)))}, "mask", "image's size"),
        ({"image": "kiln-input:" + "0" * 64}, "image", "expired"),
    ]
    for overrides, field, rule in cases:
        request = {"model": "tiny-sd15", "prompt": "a fox", "steps": 4, **overrides}
        with pytest.raises(RequestRejected) as caught:
            client.submit(request)
        assert field in [p.field for p in caught.value.problems], (overrides, caught.value)
        assert rule in str(caught.value), (overrides, str(caught.value))
    assert redis_conn.keys("rq:job:*") == []
    # No size given: the job takes the image's, which the manifest must allow.
    with pytest.raises(RequestRejected, match="width x height"):
        client.submit({"model": "tiny-sd15", "prompt": "a fox", "image": small})


def test_an_input_changed_after_upload_fails_the_job_naming_its_sha256(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    source = client.upload(png())
    job = client.submit({"model": "tiny-sd15", "prompt": "a fox", "steps": 2, "image": source})
    sha256 = source.removeprefix("kiln-input:")
    redis_conn.set(input_key(sha256), png(seed=1), keepttl=True)  # someone rewrites the key
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    with pytest.raises(RenderFailed, match=f"not {sha256}: the input was changed after upload"):
        job.wait(timeout=5)
    [record] = records(settings.timings_log)
    assert record.status == "failed" and record.timings.load == 0  # refused before loading


def test_an_img2img_image_replays_from_its_upload(
    redis_conn: Redis, settings: Any, kiln_env: dict[str, str], tmp_path: Path
) -> None:
    """The details name the inputs by sha256; while the upload lives, a replay finds it."""
    client = client_for(redis_conn, settings)
    source = tmp_path / "source.png"
    source.write_bytes(png())
    submitted = kiln(
        "submit", "a fox", "--model", "tiny-flux", "--image", str(source), "--strength", "0.6",
        "--steps", "4", "--seed", "9", "--json", env=kiln_env,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    burst(redis_conn, make_renderer(settings, ["tiny-flux"]), ["tiny-flux"])
    [first] = records(settings.timings_log)
    original = client.job(first.job_id).wait(timeout=5).images[0].path
    replayed = kiln("replay", str(original), "--json", env=kiln_env)
    assert replayed.returncode == 0, replayed.stderr
    burst(redis_conn, make_renderer(settings, ["tiny-flux"]), ["tiny-flux"])
    second = next(r for r in records(settings.timings_log) if r.job_id != first.job_id)
    assert (second.mode, second.strength) == ("img2img", 0.6)
    again = client.job(second.job_id).wait(timeout=5).images[0].path
    assert np.array_equal(pixels(original), pixels(again))


def test_a_backend_with_only_the_client_submits_inputs_and_loras_against_s3(
    redis_conn: Redis, make_settings: Any, s3: Any, tmp_path: Path
) -> None:
    """#17's done-means: another process, Redis only, uploads and submits img2img, inpaint and
    a LoRA job; the worker's store is S3 (a real S3-compatible server over the network)."""
    from tests.s3server import BUCKET
    from tests.support.inprocess import make_worker

    settings = make_settings(**s3.store_settings())
    worker = make_worker(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    source, mask = tmp_path / "source.png", tmp_path / "mask.png"
    source.write_bytes(png())
    mask.write_bytes(mask_png())
    backend = start_backend(
        "tests.remote_img2img",
        settings.redis_url,
        "tiny-sd15",
        str(source),
        str(mask),
        str(tmp_path / "backend"),
    )
    try:
        wait_until(lambda: redis_conn.llen("rq:queue:kiln:tiny-sd15") == 3, 60, "queued")
        worker.work(burst=True)
        out, err = backend.communicate(timeout=120)
    finally:
        if backend.poll() is None:
            backend.kill()
    assert backend.returncode == 0, err
    first, report = (json.loads(line) for line in out.strip().splitlines())
    assert report["uris"] == [f"s3://{BUCKET}/renders/{j}/0.png" for j in first["job_ids"]]
    assert report["modules"] == []  # no torch, no boto3 (Pillow checks the image: allowed)
    done = [
        (r.status, r.mode, [(x.name, x.weight) for x in r.loras])
        for r in records(settings.timings_log)
    ]
    assert done == [
        ("done", "img2img", []),
        ("done", "inpaint", []),
        ("done", "txt2img", [("detail", 0.9)]),
    ]
    for path in report["paths"]:
        with Image.open(path) as shown:
            assert shown.size == (128, 128)
