"""Video on the same worker (#41): a video model's request is checked at submit against its
family's frame rule and its manifest (frames, fps, container, one video a job, video modes only),
an image model refuses the video fields, and tiny-wan and tiny-ltx render through a real worker
into MP4, WebM and animated WebP files whose frames, rate, size and details read back, the
details giving back the request that rendered them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis import Redis

from api_client import RequestRejected
from api_client.manifest import ManifestInvalid, load_manifest_file
from tests.conftest import MANIFESTS
from tests.support.images import png
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.files import video
from worker.files.details import read_details

WAN = {"model": "tiny-wan", "prompt": "a fox running", "steps": 2, "seed": 11}


@pytest.mark.parametrize(
    ("request_", "field", "words"),
    [
        ({**WAN, "frames": 10}, "frames", "family wan makes 4k+1 frames (1, 5, 9, ...)"),
        ({**WAN, "model": "tiny-ltx", "frames": 13}, "frames", "family ltx makes 8k+1 frames"),
        ({**WAN, "frames": 37}, "frames", "must be at most 33 (manifest max)"),
        ({**WAN, "fps": 0}, "fps", "must be between 1 and 60"),
        ({**WAN, "output_format": "png"}, "output_format", "makes videos: mp4, webm, webp"),
        ({**WAN, "num_images": 2}, "num_images", "makes one video a job"),
        ({**WAN, "mode": "txt2img"}, "mode", "must be one of txt2video, img2video"),
        ({**WAN, "mode": "img2video"}, "image", "mode img2video needs an image"),
        ({**WAN, "strength": 0.5}, "strength", "mode txt2video takes none"),
        ({**WAN, "model": "tiny-sd15", "frames": 9}, "frames", "makes images; frames is a video"),
        ({**WAN, "model": "tiny-sd15", "fps": 8}, "fps", "makes images; fps is a video"),
        ({**WAN, "model": "tiny-sd15", "output_format": "mp4"}, "output_format", "makes images"),
        ({**WAN, "model": "tiny-sd15", "mode": "txt2video"}, "mode", "must be one of txt2img"),
    ],
)
def test_a_video_request_off_its_rules_is_refused_at_submit_naming_the_field(
    redis_conn: Redis, settings: Any, request_: dict[str, Any], field: str, words: str
) -> None:
    client = client_for(redis_conn, settings)
    with pytest.raises(RequestRejected) as refused:
        client.submit(request_)
    named = {problem.field: problem.rule for problem in refused.value.problems}
    assert field in named and words in named[field], refused.value
    assert redis_conn.keys("rq:job:*") == []  # nothing was enqueued


def test_a_video_manifest_names_frames_on_its_family_rule_and_an_image_one_none(
    tmp_path: Path,
) -> None:
    base = (MANIFESTS / "tiny-wan.yaml").read_text()
    cases = {
        "frames: {default: 9, max: 33}": ("frames: {default: 10, max: 33}", "frames.default 10"),
        "fps: 16\n": ("", "frames and fps: a wan manifest names both"),
        "modes: [txt2video, img2video]": ("modes: [txt2img]", "txt2img: family wan serves"),
    }
    for found, (replaced, words) in cases.items():
        path = tmp_path / "tiny-wan.yaml"
        path.write_text(base.replace(found, replaced))
        with pytest.raises(ManifestInvalid, match=words.replace("(", r"\(").replace(")", r"\)")):
            load_manifest_file(path)
    image = (MANIFESTS / "tiny-sd15.yaml").read_text() + "frames: {default: 9, max: 9}\n"
    (tmp_path / "tiny-sd15.yaml").write_text(image)
    with pytest.raises(ManifestInvalid, match="frames: family sd15 makes images"):
        load_manifest_file(tmp_path / "tiny-sd15.yaml")


def test_wan_and_ltx_render_videos_whose_files_read_back_and_name_their_request(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    first = png((64, 64))
    models = ["tiny-wan", "tiny-ltx"]
    jobs = {
        "wan-mp4": client.submit(WAN),
        "wan-webp": client.submit({**WAN, "frames": 5, "fps": 8, "output_format": "webp"}),
        "ltx-webm": client.submit(
            {**WAN, "model": "tiny-ltx", "image": client.upload(first), "output_format": "webm"}
        ),
    }
    burst(redis_conn, make_renderer(settings, models), models)
    results = {name: job.wait(timeout=10) for name, job in jobs.items()}
    by_id = {r.job_id: r for r in records(settings.timings_log)}

    expected = {"wan-mp4": (9, 16, "mp4"), "wan-webp": (5, 8, "webp"), "ltx-webm": (9, 24, "webm")}
    for name, result in results.items():
        frames, fps, fmt = expected[name]
        assert result.images == [] and len(result.videos) == 1, name
        made = result.videos[0]
        assert (made.frames, made.fps, made.format, made.width, made.height) == (
            frames,
            fps,
            fmt,
            64,
            64,
        ), name
        assert made.duration_s == pytest.approx(frames / fps)
        data = client.fetch(made)  # sha256 checked against the result
        info = video.probe(data)
        assert (info.width, info.height, info.format) == (64, 64, fmt), name
        if fmt != "webp":  # libwebp may merge frames that do not differ (worker/files/video.py)
            assert (info.frames, round(info.fps)) == (frames, fps), name
        assert np.asarray(video.frame(data)).std() > 1.0, name  # a picture, not a flat fill
        record = by_id[result.job_id]
        assert (record.frames, record.fps, record.status) == (frames, fps, "done"), name
        assert record.timings.video_encode > 0 and record.timings.image_encode == 0, name
    ltx = by_id[results["ltx-webm"].job_id]
    assert ltx.mode == "img2video"

    # The file alone says how to render it again: the same resolved request, pinned.
    path = Path(str(results["wan-mp4"].videos[0].path))
    again = read_details(path).replay_request()
    original = jobs["wan-mp4"].snapshot().request
    assert original is not None
    pinned = {"rung": "full", "compile": False, "step_cache": False}
    assert again.model_dump(exclude=set(pinned)) == original.model_dump(exclude=set(pinned))
    assert {name: getattr(again, name) for name in pinned} == pinned
