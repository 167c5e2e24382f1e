"""Input images: client.upload() into Redis by sha256, the references a request may carry (and
the ones it never may: http(s), worker paths, files outside the store), and the worker's own
read, which checks the sha256 and the caps again. Real Redis; moto's S3 server for the store."""

from __future__ import annotations

import base64
import hashlib
import io
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from redis import Redis

from api_client import RequestRejected, keys
from api_client.inputs import (
    DATA_URL_MAX_BYTES,
    MAX_PIXELS,
    InputImage,
    InputRefused,
    check_image,
    check_mask,
    input_bytes,
    inspect_image,
    upload,
)
from tests.conftest import ROOT
from tests.s3server import BUCKET, MotoServer
from tests.workers import wait_until
from worker.files.local import LocalStore
from worker.files.store import open_store
from worker.render.inputs import InputUnavailable, check_mask_size, load_input, read_input

SSRF_AND_PATHS = [
    ("http://169.254.169.254/latest/meta-data/", "server-side request forgery"),
    ("https://example.com/cat.png", "server-side request forgery"),
    ("/etc/passwd", "bare path"),
    ("outputs/job/0.png", "bare path"),
    ("ftp://example.com/cat.png", "scheme ftp:// is not accepted"),
    ("gopher://127.0.0.1:6379/_FLUSHALL", "scheme gopher:// is not accepted"),
    ("kiln-input:1234", "64 lowercase hex digits"),
    ("kiln-input:" + "A" * 64, "64 lowercase hex digits"),
    ("file://otherhost/etc/passwd", "no host"),
    ("s3://bucket/../x.png", "no empty, . or .. parts"),
    ("", "must be a kiln-input: uri"),
]


def image_bytes(
    fmt: str = "PNG", size: tuple[int, int] = (64, 64), color: str = "red", **save: Any
) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format=fmt, **save)
    return buffer.getvalue()


def noise_bytes(fmt: str, size: tuple[int, int] = (128, 128)) -> bytes:
    """An image that does not compress: cut in half, its pixels (not its header) are missing."""
    noise = Image.frombytes("RGB", size, random.Random(0).randbytes(size[0] * size[1] * 3))
    buffer = io.BytesIO()
    noise.save(buffer, format=fmt, **({"compress_level": 0} if fmt == "PNG" else {}))
    return buffer.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


@pytest.fixture
def store(settings: Any) -> LocalStore:
    local = open_store(settings)
    assert isinstance(local, LocalStore)
    return local


# -- upload ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_upload_keeps_the_bytes_by_sha256_with_a_lifetime_and_the_worker_reads_them(
    redis_conn: Redis, store: LocalStore, settings: Any, fmt: str
) -> None:
    data = image_bytes(fmt)
    sha = hashlib.sha256(data).hexdigest()
    uri = upload(redis_conn, data)
    assert uri == f"kiln-input:{sha}"
    assert redis_conn.get(keys.input_key(sha)) == data
    assert 86400 - 5 < redis_conn.ttl(f"kiln:input:{sha}") <= 86400

    redis_conn.expire(keys.input_key(sha), 100)
    assert upload(redis_conn, data) == uri  # same bytes, same uri, a fresh lifetime
    assert redis_conn.ttl(keys.input_key(sha)) > 100

    assert read_input(uri, redis_conn, store) == data
    loaded = load_input(uri, redis_conn, store, settings)
    assert (loaded.image.mode, loaded.image.size, loaded.sha256) == ("RGB", (64, 64), sha)
    mask = load_input(uri, redis_conn, store, settings, field="mask")
    assert mask.image.mode == "L"


def test_upload_reads_a_path_given_as_path_or_text(redis_conn: Redis, tmp_path: Path) -> None:
    data = image_bytes("PNG")
    path = tmp_path / "in.png"
    path.write_bytes(data)
    expected = f"kiln-input:{hashlib.sha256(data).hexdigest()}"
    assert upload(redis_conn, path) == upload(redis_conn, str(path)) == expected
    with pytest.raises(RequestRejected, match="kiln never fetches URLs"):
        upload(redis_conn, "https://example.com/in.png")
    with pytest.raises(RequestRejected, match="cannot be read"):
        upload(redis_conn, tmp_path / "missing.png")


def test_an_overwritten_upload_fails_on_read_naming_its_sha256(
    redis_conn: Redis, store: LocalStore
) -> None:
    uri = upload(redis_conn, image_bytes("PNG", color="red"))
    sha = uri.removeprefix("kiln-input:")
    redis_conn.set(keys.input_key(sha), image_bytes("PNG", color="blue"), keepttl=True)
    with pytest.raises(InputUnavailable) as caught:
        read_input(uri, redis_conn, store)
    message = str(caught.value)
    assert sha in message and "changed after upload" in message
    assert "\n" not in message


def test_an_expired_or_never_uploaded_input_is_named_with_the_ttl_setting(
    redis_conn: Redis, store: LocalStore
) -> None:
    uri = upload(redis_conn, image_bytes("PNG"))
    sha = uri.removeprefix("kiln-input:")
    redis_conn.pexpire(keys.input_key(sha), 1)
    wait_until(lambda: not redis_conn.exists(keys.input_key(sha)), 5, "the input to expire")
    with pytest.raises(InputUnavailable) as caught:
        read_input(uri, redis_conn, store, ttl_s=600)
    message = str(caught.value)
    assert sha in message and "expired" in message and "KILN_INPUT_TTL_S, 600 s" in message
    problem = check_image(uri, "image", conn=redis_conn)
    assert problem is not None and problem.field == "image" and "never uploaded" in problem.rule
    assert check_image(upload(redis_conn, image_bytes("PNG")), conn=redis_conn) is None


def test_too_big_an_upload_is_refused_naming_field_size_and_cap(
    redis_conn: Redis, tmp_path: Path
) -> None:
    data = noise_bytes("PNG", (256, 256))
    with pytest.raises(RequestRejected) as caught:
        upload(redis_conn, data, max_mb=0.1)
    (problem,) = caught.value.problems
    assert problem.field == "image"
    assert f"is {len(data)} bytes" in problem.rule and "cap of 104857 bytes" in problem.rule
    assert "KILN_INPUT_MAX_MB" in problem.rule
    path = tmp_path / "big.png"
    path.write_bytes(data)
    with pytest.raises(RequestRejected, match=f"is {len(data)} bytes"):
        upload(redis_conn, path, max_mb=0.1)  # refused from its size, before it is read
    assert redis_conn.keys("kiln:input:*") == []


def test_too_many_pixels_is_refused_naming_the_size_and_the_cap(redis_conn: Redis) -> None:
    data = image_bytes("PNG", size=(4097, 4096), color="black")
    with pytest.raises(RequestRejected) as caught:
        upload(redis_conn, data)
    rule = caught.value.problems[0].rule
    assert f"is 4097x4096 = {4097 * 4096} pixels" in rule and f"cap of {MAX_PIXELS}" in rule


@pytest.mark.parametrize(
    ("data", "rule"),
    [
        (b"just some text, not an image", "not a PNG, JPEG or WebP image"),
        (image_bytes("GIF"), "a GIF image"),
        (image_bytes("BMP"), "a BMP image"),
        (image_bytes("PNG")[:30], "not an image Pillow can open"),
        (noise_bytes("PNG")[:20000], "truncated or corrupt"),
        (noise_bytes("JPEG")[:5000], "truncated or corrupt"),
        (noise_bytes("WEBP")[:5000], "not an image Pillow can open"),  # WebP demuxes at open
    ],
    ids=["text", "gif", "bmp", "png-header-only", "cut-png", "cut-jpeg", "cut-webp"],
)
def test_what_is_not_a_whole_png_jpeg_or_webp_is_refused(
    redis_conn: Redis, data: bytes, rule: str
) -> None:
    with pytest.raises(RequestRejected, match=rule) as caught:
        upload(redis_conn, data)
    assert caught.value.problems[0].field == "image"
    assert redis_conn.keys("kiln:input:*") == []


def test_a_phones_mpo_jpeg_is_a_jpeg_and_an_animated_png_is_refused(redis_conn: Redis) -> None:
    first, second = Image.new("RGB", (64, 64), "red"), Image.new("RGB", (64, 64), "blue")
    buffer = io.BytesIO()
    first.save(buffer, format="MPO", save_all=True, append_images=[second])
    assert inspect_image(buffer.getvalue(), max_bytes=1 << 20).format == "JPEG"
    buffer = io.BytesIO()
    first.save(buffer, format="PNG", save_all=True, append_images=[second])
    with pytest.raises(RequestRejected, match="is animated"):
        upload(redis_conn, buffer.getvalue())


def test_importing_the_inputs_module_loads_neither_pillow_nor_redis() -> None:
    probe = (
        "import sys, api_client.inputs; "
        "print([m for m in ('PIL', 'redis', 'rq', 'torch') if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_without_pillow_the_client_checks_the_signature_and_leaves_the_rest_to_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    png, gif, small = image_bytes("PNG"), image_bytes("GIF"), image_bytes("PNG", size=(32, 32))
    monkeypatch.setitem(sys.modules, "PIL", None)  # `import PIL` now raises ImportError
    found = inspect_image(png, max_bytes=1 << 20)
    assert (found.format, found.width, found.height) == ("PNG", None, None)
    with pytest.raises(InputRefused, match="a GIF image"):
        inspect_image(gif, max_bytes=1 << 20)
    assert check_mask(png, small) is None


# -- data: URLs --------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "media"), [("PNG", "png"), ("JPEG", "jpeg"), ("WEBP", "webp")])
def test_a_small_data_url_is_accepted_and_read(
    redis_conn: Redis, store: LocalStore, settings: Any, fmt: str, media: str
) -> None:
    data = image_bytes(fmt)
    url = data_url(data, f"image/{media}")
    assert check_image(url, "image") is None
    assert input_bytes(redis_conn, url) == data
    assert read_input(url, redis_conn, store) == data
    assert load_input(url, redis_conn, store, settings).image.size == (64, 64)


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        (data_url(b"<script>", "text/html"), "media type 'text/html'"),
        (data_url(image_bytes("GIF"), "image/gif"), "media type 'image/gif'"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64,@@@@not-base64", "not valid base64"),
        (data_url(image_bytes("JPEG"), "image/png"), "says image/png but holds a JPEG image"),
        (data_url(b"x" * 100, "image/png"), "not a PNG, JPEG or WebP image"),
        ("data:image/png;base64," + "A" * (DATA_URL_MAX_BYTES * 4 // 3 + 8), "over the 2 MB cap"),
    ],
    ids=["html", "gif", "not-base64-flag", "bad-base64", "mislabelled", "not-image", "too-big"],
)
def test_data_urls_of_other_types_too_big_or_undecodable_are_refused(
    redis_conn: Redis, store: LocalStore, settings: Any, url: str, rule: str
) -> None:
    problem = check_image(url, "mask")
    assert problem is not None and problem.field == "mask" and rule in problem.rule
    assert len(str(problem)) < 1000  # the value is shortened, not a 2 MB echo
    with pytest.raises(InputUnavailable, match=re.escape(rule)) as caught:
        load_input(url, redis_conn, store, settings, field="mask")
    assert str(caught.value).startswith("mask data:") and len(str(caught.value)) < 1000


# -- what is never read ------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "rule"), SSRF_AND_PATHS)
def test_urls_worker_paths_and_malformed_references_are_refused_naming_the_rule(
    redis_conn: Redis, store: LocalStore, value: str, rule: str
) -> None:
    problem = check_image(value, "image", store_location="s3://bucket/renders")
    assert problem is not None and problem.field == "image" and rule in problem.rule
    assert problem.value == value
    with pytest.raises(InputUnavailable, match=rule):
        read_input(value, redis_conn, store)


def test_file_uris_outside_the_store_are_refused_by_client_and_worker(
    redis_conn: Redis, store: LocalStore, tmp_path: Path
) -> None:
    location = str(store.directory)
    secret = tmp_path / "secret.png"
    secret.write_bytes(image_bytes("PNG"))
    link = store.directory / "job" / "0.png"
    link.parent.mkdir(parents=True)
    link.symlink_to(secret)
    outside = [
        "file:///etc/passwd",
        secret.as_uri(),
        f"file://{store.directory}/../secret.png",
        f"file://{store.directory}-evil/0.png",
    ]
    for uri in outside:
        problem = check_image(uri, "image", store_location=location)
        assert problem is not None and "outside the worker's store" in problem.rule, uri
        with pytest.raises(InputUnavailable, match="outside the worker's store"):
            read_input(uri, redis_conn, store)
    # Inside the store by its name, outside once the link is followed: only the worker can tell.
    assert check_image(link.as_uri(), "image", store_location=location) is None
    with pytest.raises(InputUnavailable, match="outside the worker's store"):
        read_input(link.as_uri(), redis_conn, store)
    with pytest.raises(InputUnavailable, match="outside the worker's store"):
        read_input("s3://bucket/renders/0.png", redis_conn, store)


# -- the worker's store ------------------------------------------------------------------------


def test_a_file_inside_the_local_store_is_read(
    redis_conn: Redis, store: LocalStore, settings: Any
) -> None:
    data = image_bytes("WEBP")
    path = store.directory / "job-1" / "0.webp"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    assert check_image(path.as_uri(), store_location=str(store.directory)) is None
    assert check_image(path.as_uri()) is None  # store unknown to the client: the worker decides
    assert read_input(path.as_uri(), redis_conn, store) == data
    assert load_input(path.as_uri(), redis_conn, store, settings).image.size == (64, 64)
    with pytest.raises(InputUnavailable, match="cannot be read: No such file"):
        read_input((store.directory / "job-1" / "9.png").as_uri(), redis_conn, store)
    with pytest.raises(InputUnavailable, match="over the cap"):
        read_input(path.as_uri(), redis_conn, store, max_mb=len(data) / 2 / (1 << 20))


def test_an_object_inside_the_s3_store_prefix_is_read_and_one_outside_refused(
    redis_conn: Redis, make_settings: Any, s3: MotoServer
) -> None:
    settings = make_settings(**s3.store_settings(prefix="renders"))
    store = open_store(settings)
    data = image_bytes("JPEG")
    s3.client().put_object(Bucket=BUCKET, Key="renders/job-1/0.jpeg", Body=data)
    s3.client().put_object(Bucket=BUCKET, Key="private/0.jpeg", Body=data)
    inside = f"s3://{BUCKET}/renders/job-1/0.jpeg"
    assert check_image(inside, store_location=settings.store_location) is None
    assert read_input(inside, redis_conn, store) == data
    assert load_input(inside, redis_conn, store, settings).image.size == (64, 64)
    with pytest.raises(InputUnavailable, match="not in the store"):
        read_input(f"s3://{BUCKET}/renders/job-1/missing.png", redis_conn, store)
    for outside in (
        f"s3://{BUCKET}/private/0.jpeg",
        f"s3://{BUCKET}/renders-other/0.jpeg",
        "s3://other-bucket/renders/job-1/0.jpeg",
        "file:///etc/passwd",
    ):
        problem = check_image(outside, store_location=settings.store_location)
        assert problem is not None and "outside the worker's store" in problem.rule, outside
        with pytest.raises(InputUnavailable, match="outside the worker's store"):
            read_input(outside, redis_conn, store)


# -- masks -------------------------------------------------------------------------------------


def test_a_mask_of_another_size_is_named_with_both_sizes(
    redis_conn: Redis, store: LocalStore, settings: Any
) -> None:
    image, mask = image_bytes("PNG"), image_bytes("PNG", size=(64, 32), color="white")
    problem = check_mask(image, mask)
    assert problem is not None and problem.field == "mask" and problem.value == "64x32"
    assert "64x64" in problem.rule
    assert check_mask(image, image_bytes("WEBP", color="white")) is None
    loaded = load_input(upload(redis_conn, image), redis_conn, store, settings)
    mask_uri = upload(redis_conn, mask)
    loaded_mask = load_input(mask_uri, redis_conn, store, settings, field="mask")
    with pytest.raises(InputUnavailable, match="is 64x32; a mask must be the image's size, 64x64"):
        check_mask_size(loaded.image, loaded_mask.image, mask_uri)


def test_sizes_are_judged_upright_after_the_exif_orientation(
    redis_conn: Redis, store: LocalStore, settings: Any
) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: a phone held upright
    rotated = image_bytes("JPEG", size=(64, 32), exif=exif.tobytes())
    found = inspect_image(rotated, max_bytes=1 << 20)
    assert isinstance(found, InputImage) and (found.width, found.height) == (32, 64)
    assert check_mask(rotated, image_bytes("PNG", size=(32, 64))) is None
    loaded = load_input(upload(redis_conn, rotated), redis_conn, store, settings)
    assert loaded.image.size == (32, 64)
