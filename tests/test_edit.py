"""Instruction edits (#17 items 1 and 6): an edit model is its own checkpoint whose edit pipeline
is the resident one (FLUX.1 Kontext here: tiny-flux-kontext); its jobs render through a real
worker from uploaded images; what an edit may not be given is refused at submit and again by the
worker, naming field, value and rule. Qwen-Image-Edit's processor cannot be built without
torchvision, so its manifest is checked and its worker refuses to start without it."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from redis import Redis

from api_client import RenderFailed, RequestRejected
from api_client.manifest import Manifest, load_manifest_file
from tests.conftest import MANIFESTS
from tests.support.images import mask_png, pixels, png
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import enqueue_raw, records
from worker.pipelines.families import check_installed, spec_for

KONTEXT = "tiny-flux-kontext"
BASE: dict[str, Any] = {"model": KONTEXT, "prompt": "make the fox red", "steps": 2, "seed": 3}


def test_edits_render_through_a_worker_on_the_resident_pipeline(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    first, second = client.upload(png(seed=0)), client.upload(png(seed=1))
    plain = client.submit(BASE)
    # An edit model's image is an edit's, by default; asking for it by name gives the same.
    edited = client.submit({**BASE, "image": first})
    again = client.submit({**BASE, "image": first, "mode": "edit"})
    other = client.submit({**BASE, "image": second, "mode": "edit"})
    # True CFG's second pass, on the negative prompt, runs in an edit as well.
    steered = client.submit({**BASE, "image": first, "negative_prompt": "blurry", "true_cfg": 4.0})
    renderer = make_renderer(settings, [KONTEXT])
    burst(redis_conn, renderer, [KONTEXT])
    by_id = {r.job_id: r for r in records(settings.timings_log)}

    jobs = (plain, edited, again, other, steered)
    assert [(by_id[j.id].mode, by_id[j.id].strength) for j in jobs] == [
        ("txt2img", None),
        *[("edit", None)] * 4,
    ]
    for job in jobs[1:]:
        record = by_id[job.id]
        assert record.status == "done" and record.timings.load == 0  # resident since the first
        assert record.per_step_s == pytest.approx(record.timings.denoise / 2)  # every step runs
    # One pipeline renders both modes: the Kontext class loaded from the checkpoint, with no
    # pipeline derived for edit.
    loaded = renderer.cache.get(KONTEXT)
    assert loaded is not None and type(loaded.pipe).__name__ == "FluxKontextPipeline"
    assert loaded.mode_pipes == {}
    shown = [pixels(job.wait(timeout=5).images[0].path) for job in jobs]
    assert all(image.shape == (128, 128, 3) for image in shown)
    assert np.array_equal(shown[1], shown[2])  # same input, seed and prompt: the same edit
    assert not np.array_equal(shown[1], shown[3])  # another input image: another edit
    assert not np.array_equal(shown[0], shown[1])  # the image is read, not ignored
    assert not np.array_equal(shown[1], shown[4])  # the negative prompt steers the edit
    details = client.job(edited.id).wait(timeout=5)
    assert (details.width, details.height) == (128, 128)


def test_edit_requests_are_checked_before_anything_is_enqueued(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    source, mask = client.upload(png()), client.upload(mask_png())
    small = client.upload(png((64, 64)))
    cases = [
        ({"mode": "edit"}, "image", "mode edit needs an image"),
        ({"image": source, "mask": mask}, "mode", "must be one of txt2img, edit"),
        ({"mode": "edit", "image": source, "mask": mask}, "mask", "mode edit takes no mask"),
        ({"mode": "edit", "image": source, "strength": 0.5}, "strength", "mode edit takes none"),
        ({"mode": "img2img", "image": source}, "mode", "must be one of txt2img, edit"),
        ({"image": small, "width": 128, "height": 128}, "image", "must be the job's size"),
        ({"mode": "edit", "image": "https://example.com/a.png"}, "image", "never fetches URLs"),
        (
            {"model": "tiny-flux", "mode": "edit", "image": source},
            "mode",
            "must be one of txt2img, img2img, inpaint",
        ),
    ]
    for overrides, field, rule in cases:
        with pytest.raises(RequestRejected) as caught:
            client.submit({**BASE, **overrides})
        assert field in [p.field for p in caught.value.problems], (overrides, caught.value)
        assert rule in str(caught.value), (overrides, str(caught.value))
    assert redis_conn.keys("rq:job:*") == []


def test_the_worker_refuses_an_edit_the_client_would_have(redis_conn: Redis, settings: Any) -> None:
    """Never trust the queue: a producer that skips the client gets the same rules."""
    client = client_for(redis_conn, settings)
    source, mask = client.upload(png()), client.upload(mask_png())
    request = {**BASE, "mode": "edit", "image": source, "mask": mask}
    job_id = enqueue_raw(redis_conn, KONTEXT, {"request": request})
    burst(redis_conn, make_renderer(settings, [KONTEXT]), [KONTEXT])
    with pytest.raises(RenderFailed, match=r"mask=.*: mode edit takes no mask"):
        client.job(job_id).wait(timeout=5)
    [record] = records(settings.timings_log)
    assert record.status == "failed" and record.timings.load == 0


def _manifest(**changes: Any) -> Manifest:
    base = load_manifest_file(MANIFESTS / f"{KONTEXT}.yaml").model_dump()
    return Manifest.model_validate({**base, **changes})


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        (
            {"modes": ["txt2img", "img2img", "edit"]},
            "img2img: a flux manifest with edit is an edit",
        ),
        ({"family": "qwenimage", "modes": ["txt2img", "edit"]}, "pipeline serves edit only"),
        ({"family": "sd3", "modes": ["edit"]}, "family sd3 serves txt2img, img2img, inpaint"),
    ],
)
def test_a_manifest_lists_edit_only_where_an_edit_pipeline_serves_it(
    changes: dict[str, Any], rule: str
) -> None:
    with pytest.raises(ValidationError, match=rule):
        _manifest(**changes)


def test_edit_models_load_their_edit_pipeline_class() -> None:
    assert spec_for(_manifest()).pipeline_class == "FluxKontextPipeline"
    assert spec_for(_manifest(modes=["txt2img"])).pipeline_class == "FluxPipeline"
    qwen = load_manifest_file(MANIFESTS / "qwen-image-edit.yaml")
    assert spec_for(qwen).pipeline_class == "QwenImageEditPipeline"
    assert load_manifest_file(MANIFESTS / "flux1-kontext-dev.yaml").modes == ["txt2img", "edit"]


def test_a_worker_serving_qwen_image_edit_needs_torchvision() -> None:
    """transformers 5's Qwen2VLProcessor takes a video processor, which needs torchvision."""
    qwen = load_manifest_file(MANIFESTS / "qwen-image-edit.yaml")
    if importlib.util.find_spec("torchvision") is not None:
        check_installed(qwen)
        return
    with pytest.raises(
        ImportError, match="qwen-image-edit: QwenImageEditPipeline needs torchvision"
    ):
        check_installed(qwen)
    check_installed(_manifest())  # Kontext needs nothing more
