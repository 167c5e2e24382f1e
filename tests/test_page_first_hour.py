"""The page as a newcomer first meets it (issue 40): it opens on a model a live worker serves,
a mask is painted on the input image with a brush and an eraser, the job's prompt shows whatever
submitted it, and the login form, not raw JSON, says when Redis cannot be reached. Driven in
Debian's Chromium through chromium-driver, with tests/test_page.py's browser and helpers."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from api_client import keys
from tests.fixtures.gateway import call
from tests.support.fleet import live_worker
from tests.support.inprocess import client_for
from tests.test_page import (
    MODEL,
    By,
    Select,
    browser,
    field,
    fill,
    finished,
    log_in,
    page,
    submit,
    wait,
    work,
)

FIXTURES = (browser, page, work)  # tests/test_page.py's, which pytest hands in by name


def test_the_page_opens_on_a_served_model(page: Any, gateway: Any, redis_conn: Redis) -> None:
    live_worker(redis_conn, [MODEL])
    page.get(f"{gateway.url}/?token={gateway.token}")
    select = wait(page, lambda d: d.find_element(By.NAME, "model"), "the form")
    wait(page, lambda d: Select(select).first_selected_option.get_attribute("value"), "a model")
    assert Select(select).first_selected_option.get_attribute("value") == MODEL
    groups = [g.get_attribute("label") for g in select.find_elements(By.TAG_NAME, "optgroup")]
    assert groups == ["served now", "no worker serves it now"]


def test_a_mask_painted_with_brush_and_eraser_inpaints(
    page: Any, gateway: Any, redis_conn: Redis, work: Any, tmp_path: Path
) -> None:
    from PIL import Image
    from selenium.webdriver.common.action_chains import ActionChains

    source = tmp_path / "fox.png"
    Image.new("RGB", (128, 128), (200, 40, 40)).save(source)
    log_in(page, gateway)
    Select(page.find_element(By.NAME, "mode")).select_by_value("inpaint")
    page.find_element(By.NAME, "image").send_keys(str(source))
    page.find_element(By.ID, "mask-paint").click()
    canvas = wait(page, lambda d: d.find_element(By.ID, "mask-canvas"), "the mask canvas")
    wait(page, lambda d: canvas.is_displayed() and canvas.size["width"] > 0, "the painter")
    width = canvas.size["width"]
    brush = ActionChains(page).move_to_element_with_offset(canvas, -width // 4, -width // 4)
    brush.click_and_hold().move_by_offset(0, width // 2).release().perform()  # a left stroke
    page.find_element(By.CSS_SELECTOR, "[data-tool='eraser']").click()
    erase = ActionChains(page).move_to_element_with_offset(canvas, -width // 4, width // 5)
    erase.click_and_hold().move_by_offset(0, width // 10).release().perform()  # its bottom out
    fill(page, "prompt", "a fox, repainted on the left")
    fill(page, "steps", "4")
    job_id = submit(page)
    work()
    finished(page, job_id)

    view = json.loads(call("GET", gateway.url + f"/v1/jobs/{job_id}", gateway.token)[2])
    assert view["request"]["mode"] == "inpaint", view["request"]
    sha = view["request"]["mask"].removeprefix("kiln-input:")
    mask = Image.open(io.BytesIO(redis_conn.get(keys.input_key(sha)) or b"")).convert("L")
    assert mask.size == (128, 128)
    assert mask.getpixel((32, 40)) > 200  # under the brush: repainted
    assert mask.getpixel((96, 64)) < 30  # never painted: kept
    assert mask.getpixel((32, 100)) < 30  # painted, then erased: kept


def test_a_job_from_the_python_client_shows_its_prompt(
    page: Any, gateway: Any, redis_conn: Redis, settings: Any
) -> None:
    made = client_for(redis_conn, settings).submit(
        {"model": MODEL, "prompt": "a lighthouse from python", "steps": 2}
    )
    log_in(page, gateway)
    card = wait(
        page,
        lambda d: d.find_element(By.CSS_SELECTOR, f"[data-job-id='{made.id}'][data-status]"),
        "the Python client's job on the admin's page",
    )
    wait(page, lambda d: "a lighthouse from python" in card.text, "its prompt")


IN_VIEW = """
const el = arguments[0], box = el.getBoundingClientRect();
const x = box.left + box.width / 2, y = box.top + box.height / 2;
const top = document.elementFromPoint(x, y);
return box.top >= 0 && box.bottom <= window.innerHeight && Boolean(top)
  && (top === el || el.contains(top));
"""


def test_the_render_button_and_the_newest_job_stay_in_view_at_1280x800(
    page: Any, gateway: Any, redis_conn: Redis, work: Any
) -> None:
    """tiny-sd15's form is taller than 800 px: its fields scroll inside the form's panel, so
    the Render button (uncovered: the point at its centre is itself) and the job it makes are
    both in the window, and the form's last field still takes a click."""
    viewport = {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False}
    page.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", viewport)
    try:
        live_worker(redis_conn, [MODEL])
        log_in(page, gateway)
        button = page.find_element(By.CSS_SELECTOR, "#submit button[type='submit']")
        assert page.execute_script(IN_VIEW, button), "the Render button at 1280x800"
        fields = page.find_element(By.CSS_SELECTOR, ".form-fields")
        assert page.execute_script("return arguments[0].scrollHeight", fields) > 400
        previews = field(page, "previews")  # the last field, at the bottom of the scroll
        page.execute_script("arguments[0].scrollIntoView({block: 'end'})", previews)
        ticked = previews.is_selected()
        page.find_element(By.CSS_SELECTOR, "label[for='f-previews']").click()
        assert previews.is_selected() != ticked, "the last field took the click"
        fill(page, "prompt", "a harbour at dusk")
        fill(page, "steps", "2")
        job_id = submit(page)
        card = page.find_element(By.CSS_SELECTOR, f"[data-job-id='{job_id}'][data-status]")
        assert page.execute_script(IN_VIEW, button), "the Render button after submitting"
        assert page.execute_script(IN_VIEW, card.find_element(By.CSS_SELECTOR, ".job-prompt"))
        assert page.execute_script("return window.scrollY") == 0  # nothing scrolled away
        work()
    finally:
        viewport["height"] = 900  # tests/test_page.py's window, for the next test
        page.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", viewport)


def test_a_live_preview_the_api_serves_is_not_black(
    gateway: Any, redis_conn: Redis, work: Any
) -> None:
    from PIL import Image, ImageStat

    live_worker(redis_conn, [MODEL])
    body = {"model": MODEL, "prompt": "a lit window", "steps": 4, "previews": True}
    job_id = json.loads(call("POST", gateway.url + "/v1/jobs", gateway.token, body)[2])["id"]
    work()
    status, _headers, data = call("GET", gateway.url + f"/v1/jobs/{job_id}/preview", gateway.token)
    assert status == 200, data
    stat = ImageStat.Stat(Image.open(io.BytesIO(data)).convert("L"))
    assert stat.mean[0] > 16 and stat.stddev[0] > 4, (stat.mean, stat.stddev)


def test_the_login_form_says_when_redis_cannot_be_reached(redis_url: str) -> None:
    from starlette.testclient import TestClient

    from api_client.http.app import create_app
    from api_client.http.settings import ApiSettings

    app = create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0"))
    with TestClient(app, base_url="http://127.0.0.1:8700") as web:
        answer = web.get("/?token=kiln_anything")
    assert answer.status_code == 503 and "text/html" in answer.headers["content-type"]
    assert "cannot reach its Redis" in answer.text


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
