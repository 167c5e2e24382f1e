"""Generation details inside every image: PNG, WebP and JPEG each carry one JSON document that
reads back equal to the job's resolved request and result; the worst case still fits a JPEG; a
file without details, or with broken ones, is refused naming the file and what is wrong."""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from redis import Redis

from api_client.schema import OutputFormat
from tests.support.images import tiny_details
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.errors import CannotReplay
from worker.files import output
from worker.files.details import kiln_version, parse_details, read_details

MODEL = "tiny-sd15"
FORMATS: list[OutputFormat] = ["png", "webp", "jpeg"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_carries_the_details_of_its_job(
    redis_conn: Redis, settings: Any, fmt: OutputFormat
) -> None:
    client = client_for(redis_conn, settings)
    request = {
        "model": MODEL,
        "prompt": "a red fox 🦊 im Schnee, 狐狸",
        "negative_prompt": "blurry",
        "steps": 2,
        "guidance": 5.5,
        "seed": 4242,
        "num_images": 2,
        "output_format": fmt,
    }
    resolved = client.validate(request)
    job = client.submit(request)
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    result = job.wait(timeout=30)
    [record] = records(settings.timings_log)

    for index, image in enumerate(result.images):
        path = Path(image.path or "")
        assert hashlib.sha256(path.read_bytes()).hexdigest() == image.sha256  # details included
        details = read_details(path)
        assert details == tiny_details(
            fmt,
            prompt=resolved.prompt,
            negative_prompt="blurry",
            seed=result.seed,
            steps=result.steps,
            guidance=result.guidance,
            true_cfg=result.true_cfg,
            scheduler=record.scheduler,
            num_images=2,
            index=index,
            rung=result.rung,
            dtype=result.dtype,
            compiled=result.compiled,
            device=result.device,
            quantized=result.quantized,
        )
        # Replayed, it is the job's own resolved request with its rung and compile pinned.
        again = client.validate(details.replay_request())
        pins = {"rung": "full", "compile": False, "step_cache": False}  # every step computed
        assert again == resolved.model_copy(update=pins)


def test_a_png_also_says_it_in_a1111_parameters(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    job = client.submit({"model": MODEL, "prompt": "a fox", "steps": 2, "seed": 7, "num_images": 2})
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    second = job.wait(timeout=30).images[1]
    with Image.open(second.path or "") as image:
        text: dict[str, str] = image.text  # type: ignore[attr-defined]
    assert text["Software"] == f"kiln {kiln_version()}"
    prompt, line = text["parameters"].split("\n")
    assert prompt == "a fox"
    assert line.startswith("Steps: 2, Sampler: ") and "CFG scale: 7.0" in line
    assert "Seed: 8, Size: 128x128, Model: tiny-sd15" in line  # image 1 of the batch: seed + 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_largest_request_still_fits_and_reads_back(tmp_path: Path, fmt: OutputFormat) -> None:
    """Two 4000-character prompts outside the BMP: about 33 kB of UTF-16, in a JPEG's 64 kB."""
    details = tiny_details(fmt, prompt="🦊" * 4000, negative_prompt="\u202e𝄞" * 2000)
    encoded = output.encode_image(Image.new("RGB", (64, 64), (200, 90, 20)), fmt, details)
    path = tmp_path / f"big.{output.extension(fmt)}"
    path.write_bytes(encoded.data)
    assert read_details(path) == details


def test_the_details_add_little_to_encoding() -> None:
    """What the details add to encoding one 128 px image, best of 50 (-s prints it): measured
    here 0.02-0.08 ms; the bound leaves room for a loaded machine."""
    image = Image.new("RGB", (128, 128), (10, 120, 200))
    for fmt in FORMATS:
        details = tiny_details(fmt, negative_prompt="blurry, low quality")
        with_details = best_of(lambda f=fmt, d=details: output.encode_image(image, f, d))
        plain = best_of(lambda f=fmt: plain_encode(image, f))
        print(f"{fmt}: {1000 * with_details:.3f} ms, {1000 * (with_details - plain):+.3f} ms")
        assert with_details - plain < 0.005, fmt


def test_an_image_without_details_is_refused_naming_the_file(tmp_path: Path) -> None:
    plain = {fmt: tmp_path / f"plain.{fmt}" for fmt in ("png", "webp", "jpeg", "gif")}
    for path in plain.values():
        Image.new("RGB", (32, 32)).save(path)
    with pytest.raises(CannotReplay, match=rf"^{plain['png']}: .*no 'kiln' PNG chunk"):
        read_details(plain["png"])
    for fmt in ("webp", "jpeg"):
        with pytest.raises(CannotReplay, match=rf"^{plain[fmt]}: .*no UNICODE EXIF UserComment"):
            read_details(plain[fmt])
    with pytest.raises(CannotReplay, match=r"a GIF image carries no kiln details"):
        read_details(plain["gif"])
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(CannotReplay, match=r"notes.png: not an image kiln can read"):
        read_details(tmp_path / "notes.png")
    with pytest.raises(CannotReplay, match=r"missing.png: not an image kiln can read"):
        read_details(tmp_path / "missing.png")


def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda data: data.__setitem__(field, value)


@pytest.mark.parametrize(
    ("tamper", "named"),
    [
        (_set("steps", "two"), "steps='two': Input should be a valid integer"),
        (lambda data: data.pop("seed"), "seed: missing"),
        (_set("rung", "basement"), "rung='basement': Input should be 'full'"),
        (_set("colour", "red"), "colour='red': Extra inputs are not permitted"),
        (_set("details_version", 2), "version 2; this kiln reads version 1 (details_version)"),
    ],
)
def test_tampered_details_are_refused_naming_what_is_wrong(
    tamper: Callable[[dict[str, Any]], None], named: str
) -> None:
    data = tiny_details("png").model_dump(mode="json")
    tamper(data)
    with pytest.raises(CannotReplay, match=rf"^img\.png: its kiln details .*{re.escape(named)}"):
        parse_details(json.dumps(data), "img.png")


@pytest.mark.parametrize(
    ("document", "named"), [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object")]
)
def test_details_that_are_not_a_json_object_are_refused(document: str, named: str) -> None:
    with pytest.raises(CannotReplay, match=rf"^img\.png: its kiln details are {named}"):
        parse_details(document, "img.png")


def plain_encode(image: Image.Image, fmt: OutputFormat) -> str:
    """encode_image's work (convert, encode, sha256) without the details, to time what they add."""
    buffer = io.BytesIO()
    options = {"png": {"compress_level": 4}, "webp": {"quality": 95}, "jpeg": {"quality": 95}}[fmt]
    image.convert("RGB").save(
        buffer, format={"png": "PNG", "webp": "WEBP", "jpeg": "JPEG"}[fmt], **options
    )
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def best_of(encode: Callable[[], object], rounds: int = 50) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        encode()
        best = min(best, time.perf_counter() - started)
    return best
