"""taesd_preview: TAESD previews while denoising, through the real worker and Redis."""

from __future__ import annotations

from typing import Any

from PIL import Image
from redis import Redis

from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.manifest import load_manifests
from worker.pipelines.switches import preview_steps
from worker.render.context import LocalContext
from worker.render.renderer import Renderer
from worker.render.timings import TimingRecord

REQUEST = {"model": "tiny-sdxl", "prompt": "a lighthouse", "steps": 8, "seed": 11, "previews": True}


def test_previews_reach_the_client_and_leave_the_image_unchanged(
    redis_conn: Redis, make_settings: Any
) -> None:
    settings = make_settings()
    client = client_for(redis_conn, settings)
    job = client.submit(REQUEST)
    burst(redis_conn, make_renderer(settings, ["tiny-sdxl"]), ["tiny-sdxl"])
    result = job.wait(timeout=10)

    progress = job.progress()
    assert progress is not None and progress.preview is not None
    # A store uri, never a bare worker-local path: file:// for a local store.
    preview = (settings.output_dir / job.id / "preview.jpg").resolve()
    assert progress.preview == preview.as_uri()
    with Image.open(preview) as image:
        assert image.format == "JPEG" and image.size == (128, 128)
    [record] = records(settings.timings_log)
    assert record.previews == len(preview_steps(8)) == 3
    assert "taesd_preview" in result.settings.names("applied")

    # Previews read the latents and change nothing: the same request without them, same bytes.
    quiet = make_settings(taesd_preview="off", output_dir=settings.output_dir / "off")
    same = client.submit(REQUEST)
    burst(redis_conn, make_renderer(quiet, ["tiny-sdxl"]), ["tiny-sdxl"])
    unpreviewed = same.wait(timeout=10)
    assert unpreviewed.images[0].sha256 == result.images[0].sha256
    assert "taesd_preview" in unpreviewed.settings.names("skipped")
    assert not (quiet.output_dir / same.id / "preview.jpg").exists()

    # Nobody asked: the TAESD is loaded, but no preview is drawn.
    unasked = client.submit({**REQUEST, "previews": False})
    burst(redis_conn, make_renderer(settings, ["tiny-sdxl"]), ["tiny-sdxl"])
    assert unasked.wait(timeout=10).images[0].sha256 == result.images[0].sha256
    assert records(settings.timings_log)[-1].previews == 0
    assert not (settings.output_dir / unasked.id / "preview.jpg").exists()


def test_missing_or_unloadable_taesd_is_skipped_with_its_reason(make_settings: Any) -> None:
    settings = make_settings()
    manifests = load_manifests(settings.manifests, ["tiny-sd15"])
    tiny = manifests["tiny-sd15"]
    cases = {
        "none": tiny.model_copy(update={"taesd": None}),
        "broken": tiny.model_copy(update={"taesd": "./no-such-taesd"}),  # local: no hub lookup
    }
    for label, manifest in cases.items():
        finished: list[TimingRecord] = []
        renderer = Renderer(settings, {"tiny-sd15": manifest}, on_record=finished.append)
        result = renderer.render({**REQUEST, "model": "tiny-sd15"}, LocalContext(f"p-{label}"))
        [note] = [n for n in result.settings.skipped if n.name == "taesd_preview"]
        expected = "names no taesd" if label == "none" else "cannot load taesd"
        assert expected in note.reason, note.reason
        [record] = finished
        assert result.images and record.previews == 0


def test_preview_steps_are_the_quarters_and_never_the_last() -> None:
    assert preview_steps(8) == {2, 4, 6}
    assert preview_steps(20) == {5, 10, 15}
    assert preview_steps(2) == {1}
    assert preview_steps(1) == set()
