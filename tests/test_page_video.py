"""The page with a video model (issue 41), in Debian's Chromium through chromium-driver against a
real `kiln api` and a real worker serving tiny-wan, with tests/test_page.py's browser and
helpers: the form follows the video manifest (frames on the family's rule, fps, the video
containers, the first frame for img2video; no images count, sampler, hires, controls or
reference), an off-rule frame count is refused in the browser and, past it, beside its field by
the gateway, and the finished videos play: the mp4 decoded by Chromium itself, the animated webp
in an <img>."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.support.inprocess import burst, make_renderer
from tests.test_page import (  # type: ignore[attr-defined]
    By,
    Select,
    browser,
    card,
    detail,
    field,
    fill,
    log_in,
    page,
    status,
    submit,
    wait,
)

FIXTURES = (browser, page)  # tests/test_page.py's, which pytest hands in by name
VIDEO = "tiny-wan"  # 4k+1 frames, default 9, max 33, 16 fps, sizes 64x64, 96x64, 64x96

# HAVE_CURRENT_DATA (2) or more: Chromium has decoded a frame of it, at the video's own size.
DECODED = """
const video = document.querySelector(`video[data-job-id="${arguments[0]}"]`);
return video && !video.error && video.readyState >= 2
  ? [video.videoWidth, video.videoHeight, video.duration, video.muted, video.loop] : null;
"""
ANIMATED = """
const img = document.querySelector(`img[data-job-id="${arguments[0]}"]`);
return img && img.complete && img.naturalWidth > 0 ? [img.naturalWidth, img.naturalHeight] : null;
"""
SENT = "return JSON.parse(localStorage['kiln.requests'])[arguments[0]].request"
IN_VIEW = """
const el = arguments[0], box = el.getBoundingClientRect();
const top = document.elementFromPoint(box.left + box.width / 2, box.top + box.height / 2);
return box.top >= 0 && box.bottom <= window.innerHeight && Boolean(top) && el.contains(top);
"""


def shown(driver: Any, element_id: str) -> bool:
    return bool(driver.find_element(By.ID, element_id).is_displayed())


def options(driver: Any, name: str) -> list[str]:
    return [str(o.get_attribute("value")) for o in Select(field(driver, name)).options]


def pick_video(driver: Any, gateway: Any) -> None:
    log_in(driver, gateway)  # tiny-sd15's form first
    Select(field(driver, "model")).select_by_value(VIDEO)
    wait(driver, lambda d: field(d, "frames").is_displayed(), "the frames field")


@pytest.fixture
def small_window(page: Any) -> Any:
    """1280x800, the smallest window the page keeps its Render button and newest job in."""
    viewport = {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False}
    page.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", viewport)
    yield page
    viewport["height"] = 900  # tests/test_page.py's window, for the next test
    page.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", viewport)


def test_the_form_follows_a_video_manifest_and_refuses_an_off_rule_frame_count(
    small_window: Any, gateway: Any, redis_conn: Redis
) -> None:
    page = small_window
    pick_video(page, gateway)
    frames = field(page, "frames")
    assert [frames.get_attribute(a) for a in ("min", "step", "max", "value")] == [
        "1", "4", "33", "9"
    ]  # fmt: skip
    assert field(page, "fps").get_attribute("value") == "16"
    assert options(page, "output_format") == ["mp4", "webm", "webp"]
    assert options(page, "mode") == ["txt2video", "img2video"]
    page.find_element(By.CSS_SELECTOR, "details.more summary").click()
    for gone in ("num_images-field", "sampler-field", "hires-field", "controls-field"):
        assert not shown(page, gone), gone
    assert not shown(page, "reference-field") and not shown(page, "image-field")
    Select(field(page, "mode")).select_by_value("img2video")
    assert shown(page, "image-field")
    assert page.find_element(By.ID, "image-label").text == "First frame"

    # 10 is off Wan's 4k+1: the browser refuses it and nothing is sent.
    fill(page, "prompt", "a lighthouse, turning")
    fill(page, "frames", "10")
    Select(field(page, "mode")).select_by_value("txt2video")
    page.find_element(By.CSS_SELECTOR, "#submit button[type='submit']").click()
    assert page.execute_script("return arguments[0].validity.stepMismatch", frames)
    assert not page.find_elements(By.CSS_SELECTOR, "[data-job-id][data-status]")

    # The browser's check off: the gateway refuses it, its words beside the field.
    page.execute_script("document.getElementById('submit').noValidate = true")
    page.find_element(By.CSS_SELECTOR, "#submit button[type='submit']").click()
    wait(page, lambda d: frames.get_attribute("aria-invalid") == "true", "frames marked invalid")
    words = page.find_element(By.ID, "frames-error").text
    assert words == "frames=10: family wan makes 4k+1 frames (1, 5, 9, ...)", words
    assert not redis_conn.keys("rq:queue:*"), "a refused job was enqueued"
    button = page.find_element(By.CSS_SELECTOR, "#submit button[type='submit']")
    assert page.execute_script(IN_VIEW, button), "the Render button at 1280x800"

    # Another family, another rule; an image model's form has none of the video fields.
    Select(field(page, "model")).select_by_value("tiny-ltx")
    wait(page, lambda d: frames.get_attribute("step") == "8", "LTX's 8k+1 rule")
    assert frames.get_attribute("aria-invalid") is None, "a new model clears the marks"
    Select(field(page, "model")).select_by_value("tiny-sd15")
    wait(page, lambda d: not frames.is_displayed(), "the frames field hidden")
    assert options(page, "output_format") == ["png", "webp", "jpeg"]
    assert shown(page, "num_images-field")


def test_a_video_and_an_animated_webp_rendered_and_played_in_the_browser(
    page: Any, gateway: Any, redis_conn: Redis, settings: Any, tmp_path: Path
) -> None:
    from PIL import Image

    first = tmp_path / "first.png"
    Image.new("RGB", (64, 64), (200, 120, 40)).save(first)
    pick_video(page, gateway)
    fill(page, "prompt", "a lighthouse, turning")
    fill(page, "steps", "2")
    fill(page, "frames", "9")
    video = submit(page)
    Select(field(page, "mode")).select_by_value("img2video")
    field(page, "image").send_keys(str(first))
    page.find_element(By.CSS_SELECTOR, "details.more summary").click()
    Select(field(page, "output_format")).select_by_value("webp")
    fill(page, "frames", "5")
    animated = submit(page)
    burst(redis_conn, make_renderer(settings, [VIDEO]), [VIDEO])

    for job in (video, animated):
        wait(page, lambda d, job=job: status(d, job) == "finished", f"job {job} finished")
    played = wait(page, lambda d: d.execute_script(DECODED, video), "Chromium decoding the mp4")
    width, height, duration, muted, loop = played
    assert (width, height) == (64, 64) and muted and loop, played
    assert duration == pytest.approx(9 / 16, abs=0.07), duration
    assert wait(page, lambda d: d.execute_script(ANIMATED, animated), "the webp") == [64, 64]
    assert detail(page, video, "frames") == "9 at 16 fps"
    assert detail(page, animated, "frames") == "5 at 16 fps"
    assert not card(page, video).find_elements(By.CSS_SELECTOR, "img[data-job-id]")

    sent = page.execute_script(SENT, video)
    assert sent["frames"] == 9 and sent["fps"] == 16 and sent["output_format"] == "mp4", sent
    assert "num_images" not in sent and sent["mode"] == "txt2video", sent
    again = page.execute_script(SENT, animated)
    assert again["mode"] == "img2video" and again["image"].startswith("kiln-input:"), again
    assert again["output_format"] == "webp" and again["frames"] == 5, again
