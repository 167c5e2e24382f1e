"""bench/video_bench.py's fits and tables on made-up cells (the bench itself renders for minutes),
and `make run`'s video: the demo suite's last job is a tiny-wan txt2video its manifest accepts,
and the demo prints each finished video's file, frames and fps."""

from __future__ import annotations

import json

import pytest

from api_client import RenderRequest
from api_client.manifest import load_manifest_file
from api_client.resolve import resolve_request
from api_client.schema import VideoFile
from bench.demo import video_lines
from bench.video_bench import Cell, Job, fit, report
from tests.conftest import MANIFESTS, ROOT


def test_fit_is_kiln_benchs_least_squares_over_frames() -> None:
    line, note = fit([(9, 100.0), (17, 116.0), (33, 148.0), (33, 148.0)])
    assert line == pytest.approx((82.0, 2.0)) and note == ""
    assert fit([(9, 1.0), (9, 2.0)]) == (None, "one frame count: no fit")


def test_a_fit_the_spread_outweighs_is_called_noise_with_its_numbers() -> None:
    line, note = fit([(9, 1300.0), (17, 1310.0), (33, 1290.0)])
    assert line is not None and line[1] < 0 and note.startswith("slope negative")
    line, note = fit([(9, 0.5), (33, 3.5)])
    assert line is not None and line[0] < 0 and note.startswith("intercept negative")


def _job(fmt: str, encode: float, total: float, peak_mb: float) -> Job:
    phases = {"text_encode": 0.1, "denoise": 0.4, "decode": 0.5, "save": 0.0}
    return Job(fmt, {**phases, "video_encode": encode, "total": total}, 0.1, int(peak_mb * 1e6))


def test_report_gives_medians_the_encodes_share_per_format_and_both_fits() -> None:
    formats = ("mp4", "webm", "webp")
    cells = [
        Cell("tiny-wan", n, [5.0, 7.0, 6.0], [_job(f, 0.1 * n / 9, 2.0, 1000 + n) for f in formats])
        for n in (9, 33)
    ]
    text = report(cells, steps=4, repeats=1)
    row = "| tiny-wan | 9 | 0.100 | 0.400 | 0.100 | 0.500 | 0.100 | 2.000 | 2.000 | 1009 | 6.0 |"
    assert row in text
    assert "| tiny-wan | 33 | 18.3% (0.367 s) | 18.3% (0.367 s) | 18.3% (0.367 s) |" in text
    assert "- tiny-wan peak = 1000.000 MB + 1.0000 MB x frames (6 jobs)" in text
    assert "- tiny-wan total = 2.000 s + 0.0000 s x frames (6 jobs)" in text


def test_the_demo_suite_ends_with_a_short_tiny_wan_video_its_manifest_accepts() -> None:
    suite = json.loads((ROOT / "bench" / "suites" / "demo.json").read_text())
    last = suite["jobs"][-1]
    assert (last["model"], last["frames"], last["width"], last["height"], last["steps"]) == (
        "tiny-wan",
        9,
        64,
        64,
        4,
    )
    manifest = load_manifest_file(MANIFESTS / "tiny-wan.yaml")
    resolved = resolve_request(RenderRequest.model_validate(last), manifest)
    assert (resolved.mode, resolved.output_format, resolved.fps) == ("txt2video", "mp4", 16)
    assert not any("frames" in job for job in suite["jobs"][:-1])  # the one video is last


def test_the_demo_prints_each_videos_file_frames_and_fps() -> None:
    video = VideoFile(
        path="/out/j1/0.mp4",
        width=64,
        height=64,
        frames=9,
        fps=16,
        format="mp4",
        sha256="0" * 64,
        duration_s=0.5625,
    )
    assert video_lines([video]) == [
        "[bold]video[/]: /out/j1/0.mp4 (64x64 mp4, 9 frames at 16 fps, 0.56 s)"
    ]
