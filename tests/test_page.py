"""The web page in a real browser (headless Debian chromium through selenium) against a real
`kiln api` and a real worker (a burst worker in this process): log in, render and watch the job
live, a refusal shown beside its field, and the gallery's "render again". The page runs under
the gateway's own CSP; a violation or an uncaught script error fails the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.conftest import ROOT
from tests.fixtures.gate import hold_here
from tests.support.inprocess import burst, make_renderer

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = ROOT / "docs" / "page.png"
MODEL = "tiny-sd15"
WAIT_S = 60  # a loaded 2-core machine; every wait is on a condition, never a fixed sleep

if not (Path(CHROMEDRIVER).exists() and Path(CHROMIUM).exists()):
    pytest.skip(
        f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}):"
        " apt-get install chromium chromium-driver",
        allow_module_level=True,
    )
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the dev extra)")

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument("--window-size=1280,900")
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    # The viewport itself 1280x900 (a window size counts the browser's own frame too).
    viewport = {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", viewport)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser: Any, gateway: Any) -> Iterator[Any]:
    """The browser on this test's gateway (its own origin: no cookie or storage carries over),
    its console checked when the test ends."""
    browser.get_log("browser")  # drop what an earlier test left
    yield browser
    problems = [
        entry["message"]
        for entry in browser.get_log("browser")
        if "Content Security Policy" in entry["message"] or "Uncaught" in entry["message"]
    ]
    assert not problems, problems


def wait(driver: Any, condition: Any, what: str, timeout: float = WAIT_S) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition, message=what)


def log_in(driver: Any, gateway: Any) -> None:
    driver.get(f"{gateway.url}/?token={gateway.token}")
    wait(driver, lambda d: d.current_url == gateway.url + "/", "the token dropped from the URL")
    pick_model(driver)


def pick_model(driver: Any) -> None:
    model = wait(driver, lambda d: d.find_element(By.NAME, "model"), "the form")
    wait(driver, lambda d: model.find_elements(By.CSS_SELECTOR, f"option[value='{MODEL}']"), MODEL)
    Select(model).select_by_value(MODEL)
    wait(driver, lambda d: field(d, "steps").get_attribute("max") == "50", "the manifest's steps")


def field(driver: Any, name: str) -> Any:
    return driver.find_element(By.CSS_SELECTOR, f"#submit [name='{name}']")


def fill(driver: Any, name: str, value: str) -> None:
    element = field(driver, name)
    element.clear()
    element.send_keys(value)


def job_ids(driver: Any) -> list[str]:
    cards = driver.find_elements(By.CSS_SELECTOR, "[data-job-id][data-status]")
    return [card.get_attribute("data-job-id") for card in cards]


def submit(driver: Any) -> str:
    """Press the form's submit button; the id of the job that appears."""
    before = set(job_ids(driver))
    driver.find_element(By.CSS_SELECTOR, "#submit button[type='submit']").click()
    return submit_seen(driver, before)


def submit_seen(driver: Any, before: set[str]) -> str:
    new = wait(driver, lambda d: [i for i in job_ids(d) if i not in before], "a new job element")
    assert len(new) == 1, new
    return str(new[0])


def card(driver: Any, job_id: str) -> Any:
    return driver.find_element(By.CSS_SELECTOR, f"[data-job-id='{job_id}'][data-status]")


def status(driver: Any, job_id: str) -> str:
    return str(card(driver, job_id).get_attribute("data-status"))


SHOWS_LIVE = """
const card = document.querySelector(`[data-job-id="${arguments[0]}"][data-status]`);
const preview = card && card.querySelector("img[data-preview]");
return Boolean(card && card.dataset.status === "started"
  && card.textContent.includes("denoise") && card.textContent.includes("step 2/4")
  && preview && !preview.hidden && preview.complete && preview.naturalWidth > 0
  && !preview.hasAttribute("data-job-id"));
"""
IMAGE_LOADED = """
const images = [...document.querySelectorAll(`img[data-job-id="${arguments[0]}"]`)];
return images.length > 0 && images.every((img) => img.complete && img.naturalWidth > 0);
"""


def finished(driver: Any, job_id: str) -> None:
    wait(driver, lambda d: status(d, job_id) == "finished", f"job {job_id} finished on the page")
    wait(driver, lambda d: d.execute_script(IMAGE_LOADED, job_id), f"job {job_id}'s image")


def detail(driver: Any, job_id: str, name: str) -> str:
    return str(card(driver, job_id).find_element(By.CSS_SELECTOR, f"[data-detail='{name}']").text)


@pytest.fixture
def work(redis_conn: Redis, settings: Any) -> Any:
    """Run the queued jobs with a burst worker in this process; one renderer for the test, so
    its pipeline stays resident from one job to the next (a worker's own steady state)."""
    renderer = make_renderer(settings, [MODEL])
    return lambda: burst(redis_conn, renderer, [MODEL])


def test_a_job_rendered_and_watched_live_in_the_browser(
    page: Any, gateway: Any, redis_conn: Redis, work: Any, monkeypatch: Any
) -> None:
    log_in(page, gateway)
    assert field(page, "previews").is_selected(), "tiny-sd15 names a TAESD: previews default on"
    fill(page, "prompt", "a lighthouse at dusk")
    fill(page, "steps", "4")
    job_id = submit(page)
    assert status(page, job_id) in ("queued", "started")

    # The worker holds the job at denoise step 2 until the browser shows that step and a
    # TAESD preview, so the page is seen live, mid-job, on a signal rather than a clock.
    seen_live: list[bool] = []

    def browser_shows_step_2(step: int) -> bool:
        if not seen_live and page.execute_script(SHOWS_LIVE, job_id):
            seen_live.append(True)
        return bool(seen_live)

    hold_here(monkeypatch, browser_shows_step_2, at=2, limit_s=WAIT_S)
    work()
    assert seen_live, "the page never showed denoise step 2/4 with a preview while the job ran"

    finished(page, job_id)
    preview = card(page, job_id).find_element(By.CSS_SELECTOR, "img[data-preview]")
    assert not preview.is_displayed(), "the preview stays up after the final image"
    assert detail(page, job_id, "steps") == "4" and detail(page, job_id, "model") == MODEL
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.execute_script("window.scrollTo(0, 0)")
    assert page.save_screenshot(str(SCREENSHOT)), "the screenshot was not written"


def test_a_refusal_is_shown_beside_its_field(page: Any, gateway: Any, redis_conn: Redis) -> None:
    # No session: / is the login form, which posts the token to /login.
    page.get(gateway.url + "/")
    token = wait(page, lambda d: d.find_element(By.NAME, "token"), "the login form")
    token.send_keys("kiln_not-a-token")
    page.find_element(By.CSS_SELECTOR, "button[type='submit']").click()
    refused = "unknown, revoked or expired"
    wait(page, lambda d: refused in d.page_source, "the refused token's message")
    page.find_element(By.NAME, "token").send_keys(gateway.token)
    page.find_element(By.CSS_SELECTOR, "button[type='submit']").click()
    pick_model(page)

    # The browser's own checks off, so the gateway is the one refusing.
    page.execute_script("document.getElementById('submit').noValidate = true")
    fill(page, "prompt", "too many steps")
    fill(page, "steps", "999")
    page.execute_script("document.querySelector('#submit [name=width]').value = '333'")
    page.find_element(By.CSS_SELECTOR, "#submit button[type='submit']").click()

    steps = field(page, "steps")
    wait(page, lambda d: steps.get_attribute("aria-invalid") == "true", "steps marked invalid")
    beside = page.find_element(By.ID, steps.get_attribute("aria-describedby").split()[-1])
    assert "steps=999: must be between 1 and 50 (manifest max)" in beside.text, beside.text
    size = page.find_element(By.ID, "f-size")
    assert size.get_attribute("aria-invalid") == "true"
    assert field(page, "width").get_attribute("aria-invalid") == "true"
    assert (
        'width x height="333x128": must be one of 128x128'
        in page.find_element(By.ID, "size-error").text
    )
    assert not page.find_element(By.ID, "form-error").is_displayed(), "all fields were found"
    assert field(page, "guidance").get_attribute("aria-invalid") is None
    assert not job_ids(page) and not redis_conn.keys("rq:queue:*"), "a refused job was enqueued"

    # Fixed, the same form goes through and the marks are gone.
    fill(page, "steps", "2")
    page.execute_script("document.getElementById('f-size').dispatchEvent(new Event('change'))")
    queued = submit(page)
    assert steps.get_attribute("aria-invalid") is None and not beside.text

    # No worker runs here: the job waits in its queue until its Cancel button takes it out.
    card(page, queued).find_element(By.CSS_SELECTOR, "button.cancel").click()
    wait(page, lambda d: status(d, queued) == "canceled", "the queued job canceled")
    assert not redis_conn.llen(f"rq:queue:kiln:{MODEL}")


def test_the_gallery_shows_details_and_renders_again_with_the_same_seed(
    page: Any, gateway: Any, redis_conn: Redis, work: Any
) -> None:
    log_in(page, gateway)
    fill(page, "prompt", "a red fox")
    fill(page, "steps", "2")
    first = submit(page)  # seed left blank: the worker picks one
    work()
    finished(page, first)

    # A reload lists it from GET /v1/jobs, with the request this page sent kept for it.
    page.refresh()
    wait(page, lambda d: first in job_ids(d), "the gallery to list the job")
    finished(page, first)
    seed = detail(page, first, "seed")
    assert seed.isdigit()
    assert detail(page, first, "size") == "128×128" and detail(page, first, "rung")
    assert detail(page, first, "guidance") == "7" and detail(page, first, "total").endswith("s")
    assert card(page, first).find_element(By.CLASS_NAME, "job-prompt").text == "a red fox"

    before = set(job_ids(page))
    card(page, first).find_element(By.CSS_SELECTOR, "button.again").click()
    again = submit_seen(page, before)
    assert job_ids(page)[0] == again, "the new job goes first"
    work()
    finished(page, again)
    assert detail(page, again, "seed") == seed
    assert detail(page, again, "steps") == "2"

    # "Use as input": the image goes back through POST /v1/uploads into an img2img request.
    card(page, again).find_element(By.CSS_SELECTOR, "button.as-input").click()
    note = page.find_element(By.CSS_SELECTOR, "[data-note-for='image']")
    wait(page, lambda d: note.is_displayed(), "the uploaded input shown in the form")
    assert Select(field(page, "mode")).first_selected_option.text == "img2img"
    fill(page, "prompt", "the fox again, repainted")
    remade = submit(page)
    work()
    finished(page, remade)
    sent = page.execute_script(
        "return JSON.parse(localStorage['kiln.requests'])[arguments[0]].request", remade
    )
    assert sent["mode"] == "img2img" and sent["image"].startswith("kiln-input:"), sent


def test_a_step_cache_is_offered_where_the_model_has_one(
    page: Any, gateway: Any, redis_conn: Redis, settings: Any
) -> None:
    """tiny-sd15 declares no step cache: no field. tiny-flux does: a fast draft asked for in the
    form goes out as step_cache: true, and the job's details say how many steps it reused."""
    log_in(page, gateway)
    cache_field = page.find_element(By.ID, "step_cache-field")
    assert cache_field.get_attribute("hidden") is not None
    Select(field(page, "model")).select_by_value("tiny-flux")
    wait(page, lambda d: cache_field.get_attribute("hidden") is None, "the step cache field")
    page.find_element(By.CSS_SELECTOR, "details.more summary").click()
    Select(field(page, "step_cache")).select_by_value("true")
    fill(page, "prompt", "a kiln, drafted")
    fill(page, "steps", "8")
    drafted = submit(page)
    burst(redis_conn, make_renderer(settings, ["tiny-flux"]), ["tiny-flux"])
    finished(page, drafted)
    reused = detail(page, drafted, "step cache")
    assert reused.startswith("first_block: ") and reused.endswith(" of 8 reused"), reused
    sent = page.execute_script(
        "return JSON.parse(localStorage['kiln.requests'])[arguments[0]].request", drafted
    )
    assert sent["step_cache"] is True, sent


def test_an_upscale_a_control_a_reference_and_a_hires_pass_from_the_form(
    page: Any, gateway: Any, redis_conn: Redis, settings: Any, tmp_path: Path
) -> None:
    """An upscaler's form is the image alone (no prompt, no sampling); tiny-sd15's offers its
    ControlNets (the image uploaded, Canny asked of the worker), its IP-Adapter's reference
    image and a hires pass, sent as the request's controls, reference and hires and rendered
    at twice the size."""
    from tests.support.images import square_png

    picture = tmp_path / "square.png"
    picture.write_bytes(square_png())
    log_in(page, gateway)
    Select(field(page, "model")).select_by_value("tiny-upscaler")
    wait(page, lambda d: not field(d, "prompt").is_displayed(), "the prompt hidden")
    assert not field(page, "reference_image").is_displayed()
    field(page, "image").send_keys(str(picture))
    upscaled = submit(page)
    Select(field(page, "model")).select_by_value(MODEL)
    wait(page, lambda d: field(d, "prompt").is_displayed(), "the prompt back")
    fill(page, "prompt", "a lighthouse, traced")
    fill(page, "steps", "4")
    Select(field(page, "control_name")).select_by_value("canny")
    field(page, "control_image").send_keys(str(picture))
    field(page, "control_canny").click()
    field(page, "reference_image").send_keys(str(picture))
    fill(page, "reference_strength", "0.6")
    page.find_element(By.CSS_SELECTOR, "details.more summary").click()
    Select(field(page, "hires_scale")).select_by_value("2")
    Select(field(page, "hires_upscaler")).select_by_value("tiny-upscaler")
    traced = submit(page)
    models = [MODEL, "tiny-upscaler"]
    burst(redis_conn, make_renderer(settings, models), models)
    for job in (upscaled, traced):
        finished(page, job)
    sizes = page.execute_script(
        "return [...document.querySelectorAll(`img[data-job-id]`)].map("
        "(i) => [i.dataset.jobId, i.naturalWidth]);"
    )
    assert [upscaled, 256] in sizes and [traced, 256] in sizes, sizes
    sent = page.execute_script(
        "return JSON.parse(localStorage['kiln.requests'])[arguments[0]].request", traced
    )
    [control] = sent["controls"]
    assert control["name"] == "canny" and control["preprocess"] == "canny"
    assert control["image"].startswith("kiln-input:")
    assert sent["reference"]["strength"] == 0.6
    assert sent["reference"]["image"].startswith("kiln-input:")
    assert sent["hires"] == {"scale": 2, "upscaler": "tiny-upscaler"}
    alone = page.execute_script(
        "return JSON.parse(localStorage['kiln.requests'])[arguments[0]].request", upscaled
    )
    assert alone["mode"] == "upscale" and "prompt" not in alone, alone
