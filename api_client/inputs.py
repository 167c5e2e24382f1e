"""Input images for img2img, inpaint and edit jobs: upload them into Redis, and check a request's
image or mask reference before anything is enqueued. The worker reads with the same grammar.

A reference is one of four forms, and nothing else:

    kiln-input:<sha256>                 bytes client.upload() kept in Redis (kiln:input:<sha256>)
    kiln-output:<job id>/<n>            image n of a finished job's result, wherever it is stored
    s3://bucket/prefix/...  file:///... a file inside the worker's own store (KILN_OUTPUT_URL)
    data:image/png;base64,...           a small inline image (png, jpeg or webp; DATA_URL_MAX_BYTES)

Never an http(s) URL (a worker that fetched one would make requests on the sender's behalf into
its own network: server-side request forgery), never a bare path on the worker's disk.

Pillow is imported only when an image is checked, so `import api_client` stays light; a backend
without Pillow still gets the format checked from the file's signature, and the worker decodes
and checks everything again (never trust the queue).

Over 400 lines because the three forms' grammar, the image checks (format, size, pixels, the
mask against its image) and the store bounds are one set of rules that client, gateway and worker
must read the same way."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import posixpath
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import unquote, urlparse

from api_client.errors import Problem, RequestRejected, short
from api_client.keys import input_key

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage
    from redis import Redis

    from api_client.schema import ImageFile

INPUT_SCHEME = "kiln-input:"
OUTPUT_SCHEME = "kiln-output:"  # the gateway shows a result's images as these: no store path
MB = 1024 * 1024
DEFAULT_MAX_MB = 16.0  # KILN_INPUT_MAX_MB's default
DEFAULT_TTL_S = 86400  # KILN_INPUT_TTL_S's default
# 4096x4096: twice the side of the largest resolution any manifest renders (2048), decoded as
# RGB 48 MiB in the worker's memory; far under Pillow's own decompression-bomb limit (89 Mpx).
MAX_PIXELS = 4096 * 4096
# Inline images travel inside the request itself (the RQ job hash, its digest, the queue), so
# they stay small; anything bigger goes through client.upload().
DATA_URL_MAX_BYTES = 2 * MB
# Pillow reads a PNG's chunks one by one in Python: 200,000 tiny ones cost about 3 s per decode
# (20 s at the 16 MB cap), so they are counted first, from their length fields. An encoder writes
# its pixels in IDAT chunks of 8 KiB (libpng) to 64 KiB (Pillow): 2,048 at most for 16 MB, and
# a handful of others. 10,000 leaves room for encoders with 2 KiB IDATs.
MAX_PNG_CHUNKS = 10_000
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FORMATS = ("PNG", "JPEG", "WEBP")  # Pillow's names; the data: media types are their lower case
_SHA256 = re.compile(r"[0-9a-f]{64}")
_OUTPUT = re.compile(r"(?P<job>[A-Za-z0-9_-]{1,200})/(?P<n>[0-9]{1,2})")
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.ASCII)
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
)
_SWAPS_SIDES = (5, 6, 7, 8)  # EXIF orientations that rotate by 90 degrees
ACCEPTED = (
    "a kiln-input: uri from client.upload(), a finished job's image as kiln-output:<job id>/<n>,"
    " a uri inside the worker's store (KILN_OUTPUT_URL: s3:// or file://) or a small"
    " data:image/(png|jpeg|webp);base64 URL"
)


@dataclass(frozen=True)
class InputImage:
    """What checking an image's bytes found: its format and its size as displayed (after the
    EXIF orientation); width and height are None when Pillow is not installed here."""

    sha256: str
    format: str
    width: int | None
    height: int | None
    size_bytes: int


@dataclass(frozen=True)
class InputRef:
    """A parsed reference: kind says which form; sha256 for uploads, job_id/index for a job's
    output, data for inline images, bucket/key for s3:// and path for file://."""

    kind: Literal["upload", "output", "data", "s3", "file"]
    uri: str
    sha256: str | None = None
    job_id: str | None = None
    index: int | None = None
    data: bytes | None = None
    bucket: str | None = None
    key: str | None = None
    path: str | None = None


class InputRefused(ValueError):
    """A reference or an image broke a rule; carries the one Problem (field, value, rule)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        super().__init__(str(problem))


# -- uploading -----------------------------------------------------------------------------------


def upload(
    conn: Redis,
    data: bytes | str | Path,
    *,
    max_mb: float = DEFAULT_MAX_MB,
    ttl_s: int = DEFAULT_TTL_S,
    field: str = "image",
) -> str:
    """Keep an image in Redis under its sha256 for ttl_s seconds and return its uri,
    `kiln-input:<sha256>`. data is the bytes or a local file's path (never a URL).

    The image is checked first (PNG, JPEG or WebP, at most max_mb and MAX_PIXELS, not
    truncated); RequestRejected names the field, the value and the rule. Uploading the same
    bytes again gives the same uri, rewrites the bytes (healing a key changed in Redis) and
    starts their lifetime again.
    """
    if max_mb <= 0 or ttl_s < 1:
        raise ValueError(f"max_mb must be > 0 and ttl_s >= 1, got {max_mb} and {ttl_s}")
    max_bytes = int(max_mb * MB)
    try:
        raw = _read_local(data, field, max_bytes)
        found = inspect_image(raw, field, max_bytes=max_bytes)
    except InputRefused as exc:
        raise RequestRejected([exc.problem]) from None
    # A plain SET, not NX: the same key always gets the right bytes and a fresh lifetime.
    conn.set(input_key(found.sha256), raw, ex=ttl_s)
    return f"{INPUT_SCHEME}{found.sha256}"


def _read_local(data: bytes | str | Path, field: str, max_bytes: int) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    text = str(data)
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://|data:|kiln-input:", text):
        raise InputRefused(
            Problem(
                field,
                short(text, 80),
                "upload takes bytes or a local file's path; this is a"
                " URL, and kiln never fetches URLs",
            )
        )
    path = Path(data)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise InputRefused(Problem(field, str(path), _too_big(size, max_bytes)))
        return path.read_bytes()
    except OSError as exc:
        raise InputRefused(Problem(field, str(path), f"cannot be read: {exc}")) from None


# -- checking bytes ------------------------------------------------------------------------------


def inspect_image(
    data: bytes,
    field: str = "image",
    *,
    max_bytes: int,
    max_pixels: int = MAX_PIXELS,
    cap: str = "KILN_INPUT_MAX_MB",
) -> InputImage:
    """The image's format and size; InputRefused when it breaks a rule: over max_bytes, not
    PNG/JPEG/WebP, over max_pixels, animated, truncated or corrupt. With Pillow the header is
    checked before any pixel is decoded (so a decompression bomb is refused unread), then the
    whole image is verified and loaded; without it only the file's signature is checked."""
    sniffed = _check_bytes(data, field, max_bytes, cap)
    try:
        import PIL  # noqa: F401
    except ImportError:  # a backend with the client package alone: the worker decodes it
        return InputImage(hashlib.sha256(data).hexdigest(), sniffed, None, None, len(data))
    found, _ = decode_image(data, field, max_bytes=max_bytes, max_pixels=max_pixels, cap=cap)
    return found


def decode_image(
    data: bytes,
    field: str = "image",
    *,
    max_bytes: int,
    max_pixels: int = MAX_PIXELS,
    cap: str = "KILN_INPUT_MAX_MB",
) -> tuple[InputImage, PILImage]:
    """inspect_image's checks, and the decoded image as stored (not yet turned upright by its
    EXIF orientation, which InputImage's size already counts). Needs Pillow."""
    from PIL import Image

    _check_bytes(data, field, max_bytes, cap)
    digest = hashlib.sha256(data).hexdigest()
    value = f"<{len(data)} bytes, sha256 {digest[:12]}>"
    if data.startswith(_PNG_SIGNATURE) and png_chunks(data) > MAX_PNG_CHUNKS:
        rule = (
            f"has more than {MAX_PNG_CHUNKS} PNG chunks (MAX_PNG_CHUNKS): no encoder writes"
            " that many; save it again"
        )
        raise InputRefused(Problem(field, value, rule))
    try:
        with Image.open(io.BytesIO(data)) as image:  # the header only: no pixel decoded yet
            kind, (width, height) = image.format, image.size
            animated = bool(getattr(image, "is_animated", False))
    except Exception as exc:  # Pillow raises many types for hostile bytes; all mean "not one"
        raise InputRefused(
            Problem(field, value, f"is not an image Pillow can open: {exc}")
        ) from None
    if kind == "MPO":  # a JPEG with a second view (phones, 3D cameras): its first frame is used
        kind, animated = "JPEG", False
    if kind not in FORMATS:
        raise InputRefused(
            Problem(field, value, f"is {kind}: accepted formats are PNG, JPEG, WebP")
        )
    if width * height > max_pixels:
        raise InputRefused(Problem(field, value, _too_many_pixels(width, height, max_pixels)))
    if animated:
        raise InputRefused(Problem(field, value, "is animated: give a single still frame"))
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()  # checksums and structure, where the format has them (PNG)
        decoded = Image.open(io.BytesIO(data))
        decoded.load()  # every pixel: a truncated JPEG or WebP fails here
        orientation = decoded.getexif().get(0x0112, 1)  # a PNG's eXIf may follow its pixels
    except Exception as exc:
        raise InputRefused(Problem(field, value, f"is truncated or corrupt: {exc}")) from None
    if orientation in _SWAPS_SIDES:
        width, height = height, width
    return InputImage(digest, kind, width, height, len(data)), decoded


def png_chunks(data: bytes, stop_after: int = MAX_PNG_CHUNKS) -> int:
    """How many chunks a PNG holds up to IEND, walked by their length fields alone (nothing
    inflated, no CRC checked); the walk stops one past stop_after, or at the data's end."""
    offset, count = len(_PNG_SIGNATURE), 0
    while offset + 8 <= len(data) and count <= stop_after:
        length, kind = struct.unpack_from(">I4s", data, offset)
        count += 1
        if kind == b"IEND":
            break
        offset += 12 + length  # length, type, the chunk's data, its CRC
    return count


def sniff_format(data: bytes) -> str | None:
    """The format a file's first bytes announce (PNG, JPEG, WEBP, GIF, BMP), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for magic, name in _SIGNATURES if data.startswith(magic)), None)


def _check_bytes(data: bytes, field: str, max_bytes: int, cap: str) -> str:
    """The format the signature announces, once size and signature pass (Pillow not needed)."""
    if len(data) > max_bytes:
        raise InputRefused(Problem(field, _bytes_shown(data), _too_big(len(data), max_bytes, cap)))
    sniffed = sniff_format(data)
    if sniffed not in FORMATS:
        kind = f"a {sniffed} image" if sniffed else "not a PNG, JPEG or WebP image"
        rule = f"is {kind}: accepted formats are PNG, JPEG, WebP"
        raise InputRefused(Problem(field, _bytes_shown(data), rule))
    return sniffed


def _bytes_shown(data: bytes) -> str:
    return f"<{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:12]}>"


def check_mask(image: bytes | InputImage, mask: bytes | InputImage) -> Problem | None:
    """A Problem naming both sizes when the mask's size differs from the image's; None when they
    match, or when a size cannot be known here (no Pillow, or bytes whose own check fails and
    names what is wrong with them): the worker compares them again."""
    found_image, found_mask = (_quiet_inspect(item) for item in (image, mask))
    if found_image is None or found_mask is None or found_image.width is None:
        return None
    if found_mask.width is None or (found_image.width, found_image.height) == (
        found_mask.width,
        found_mask.height,
    ):
        return None
    return Problem(
        "mask",
        f"{found_mask.width}x{found_mask.height}",
        f"must be the image's size, {found_image.width}x{found_image.height}",
    )


def _quiet_inspect(data: bytes | InputImage) -> InputImage | None:
    if isinstance(data, InputImage):
        return data
    try:
        return inspect_image(data, max_bytes=len(data))
    except InputRefused:
        return None  # its own check names what is wrong with it


# -- checking references -------------------------------------------------------------------------


def parse_ref(value: str, field: str = "image") -> InputRef:
    """The reference's form and parts; InputRefused naming field, value and rule for anything
    but the three accepted forms. A data: URL is decoded here (its cap is checked first); no
    store location is consulted (see within_store)."""
    shown = _shown(value)
    if not isinstance(value, str) or not value:
        raise InputRefused(Problem(field, shown, f"must be {ACCEPTED}"))
    if value.startswith(INPUT_SCHEME):
        sha = value[len(INPUT_SCHEME) :]
        if not _SHA256.fullmatch(sha):
            rule = f"must be kiln-input:<sha256>, 64 lowercase hex digits (got {len(sha)} chars)"
            raise InputRefused(Problem(field, shown, rule))
        return InputRef("upload", value, sha256=sha)
    if value.startswith(OUTPUT_SCHEME):
        found = _OUTPUT.fullmatch(value[len(OUTPUT_SCHEME) :])
        if found is None:
            rule = "must be kiln-output:<job id>/<n>: a job id, then the image's 0-based index"
            raise InputRefused(Problem(field, shown, rule))
        return InputRef("output", value, job_id=found["job"], index=int(found["n"]))
    if value.startswith("data:"):
        return InputRef("data", value, data=_data_url_bytes(value, field))
    scheme = urlparse(value).scheme.lower() if "://" in value else ""
    if scheme in ("http", "https"):
        rule = (
            f"is an {scheme} URL; kiln never fetches URLs (a worker that did would make requests"
            f" into its own network for the sender: server-side request forgery); give {ACCEPTED}"
        )
        raise InputRefused(Problem(field, shown, rule))
    if scheme == "s3":
        return _s3_ref(value, field, shown)
    if scheme == "file":
        return _file_ref(value, field, shown)
    if scheme:
        raise InputRefused(
            Problem(field, shown, f"scheme {scheme}:// is not accepted: give {ACCEPTED}")
        )
    rule = (
        "is a bare path; a path on the worker's disk is never read: upload the image with"
        " client.upload() and give the kiln-input: uri it returns"
    )
    raise InputRefused(Problem(field, shown, rule))


def path_and_strength(text: str) -> tuple[str, float | None]:
    """A flag's PATH[:STRENGTH] (`--control NAME:PATH:0.5`, `--reference PATH:0.5`): a path may
    hold colons, so a last part that is no number belongs to the path."""
    head, colon, tail = text.rpartition(":")
    if colon and head:
        try:
            return head, float(tail)
        except ValueError:
            pass
    return text, None


def within_store(ref: InputRef, store_location: str) -> bool:
    """Whether an s3:// or file:// reference lies inside store_location (KILN_OUTPUT_URL: a
    directory, file:// or s3://bucket/prefix). Lexical only, for the client: the worker also
    resolves symlinks on its own disk. A relative directory cannot be judged from another host,
    so any absolute file:// passes here and the worker decides."""
    if store_location.startswith("s3://"):
        parsed = urlparse(store_location)
        prefix = parsed.path.strip("/")
        inside = not prefix or (ref.key or "").startswith(prefix + "/")
        return ref.kind == "s3" and ref.bucket == parsed.netloc and inside
    if ref.kind != "file":
        return False
    directory = (
        urlparse(store_location).path if store_location.startswith("file://") else store_location
    )
    if not posixpath.isabs(directory):
        return True
    directory = posixpath.normpath(unquote(directory))
    return posixpath.commonpath([directory, ref.path or ""]) == directory


def check_store_uri(value: str, field: str, stores: list[str]) -> Problem | None:
    """A Problem when an s3:// or file:// input lies outside every store a worker published
    (file:///etc/passwd is refused here, at submit, not only by the worker)."""
    try:
        ref = parse_ref(value, field)
    except InputRefused as exc:
        return exc.problem
    if any(within_store(ref, store) for store in stores):
        return None
    where = ", ".join(stores) if stores else "none published yet (no worker has started)"
    rule = (
        f"is outside every worker's store ({where}): only files in a store (KILN_OUTPUT_URL)"
        " may be read"
    )
    return Problem(field, _shown(value), rule)


def check_image(
    value: str,
    field: str = "image",
    *,
    store_location: str | None = None,
    conn: Redis | None = None,
    max_mb: float = DEFAULT_MAX_MB,
    max_pixels: int = MAX_PIXELS,
) -> Problem | None:
    """One Problem (field, shortened value, rule) when a request's image or mask reference is
    refused, else None. Nothing is fetched from outside: a data: URL is decoded and checked,
    a kiln-input: uri is looked up in Redis when conn is given (its bytes checked, an expired
    one named), a store uri is checked against store_location when it is known."""
    try:
        ref = parse_ref(value, field)
        if ref.kind == "data":
            inspect_image(
                ref.data or b"",
                field,
                max_bytes=DATA_URL_MAX_BYTES,
                max_pixels=max_pixels,
                cap="the inline data: URL cap",
            )
        elif ref.kind == "output":
            if conn is not None:
                output_image(conn, ref, field)  # InputRefused: no such finished job or image
        elif ref.kind in ("s3", "file"):
            if store_location is not None and not within_store(ref, store_location):
                rule = (
                    f"is outside the worker's store {store_location}: only files in the store"
                    " (KILN_OUTPUT_URL) may be read"
                )
                return Problem(field, _shown(value), rule)
        elif conn is not None:
            data = uploaded_bytes(conn, ref.sha256 or "")
            if data is None:
                return Problem(field, value, expired_rule())
            inspect_image(data, field, max_bytes=int(max_mb * MB), max_pixels=max_pixels)
    except InputRefused as exc:
        return exc.problem
    return None


VIDEO_INPUT = (
    "names a video job's file: an input is an image (give an image job's kiln-output:, an"
    " upload or a data: URL)"
)


def output_image(conn: Redis, ref: InputRef, field: str = "image") -> ImageFile:
    """The result image a kiln-output: reference names (its store uri, size and sha256);
    InputRefused when that job is unknown, expired, not finished or has no such image. Who may
    name which job is the gateway's check (api_client.http.tenancy), not this one."""
    from api_client.errors import KilnError
    from api_client.job import KilnJob

    rule = "names no image of a finished job (unknown, expired, not finished, or no such index)"
    try:
        result = KilnJob(ref.job_id or "", conn).result()
    except KilnError:
        result = None
    if result is not None and result.videos and not result.images:
        raise InputRefused(Problem(field, ref.uri, VIDEO_INPUT))
    if result is None or not 0 <= (ref.index or 0) < len(result.images):
        raise InputRefused(Problem(field, ref.uri, rule))
    image = result.images[ref.index or 0]
    if not image.uri:
        raise InputRefused(Problem(field, ref.uri, rule))
    return image


def input_bytes(conn: Redis, value: str, field: str = "image") -> bytes | None:
    """The bytes of an uploaded or inline reference (for check_mask before enqueueing); None
    for a store uri (the client has no store credentials) or an upload no longer in Redis."""
    ref = parse_ref(value, field)
    if ref.kind == "data":
        return ref.data
    if ref.kind == "upload":
        return uploaded_bytes(conn, ref.sha256 or "")
    return None


def uploaded_bytes(conn: Redis, sha256: str) -> bytes | None:
    """An upload's bytes as Redis holds them now (unchecked), or None once it has expired."""
    data = conn.get(input_key(sha256))
    if data is not None and not isinstance(data, bytes):
        raise TypeError("input images need a Redis connection without decode_responses")
    return data


def expired_rule(ttl_s: int | None = None) -> str:
    lifetime = f"{ttl_s} s" if ttl_s is not None else f"default {DEFAULT_TTL_S} s"
    return (
        "no uploaded input has this sha256 in Redis: it expired (inputs live KILN_INPUT_TTL_S,"
        f" {lifetime}) or was never uploaded; upload it again"
    )


# -- the parts -----------------------------------------------------------------------------------


def _data_url_bytes(value: str, field: str) -> bytes:
    shown = _shown(value)
    head = _DATA_URL.match(value[:256])
    media = head["type"].lower() if head else ""
    if head is None or media not in ("image/png", "image/jpeg", "image/webp"):
        rule = f"must be data:image/(png|jpeg|webp);base64,... (media type {media or 'missing'!r})"
        raise InputRefused(Problem(field, shown, rule))
    if ";base64" not in head["params"].lower():
        raise InputRefused(Problem(field, shown, "data: URL must be base64 (;base64,)"))
    body = value[head.end() :]
    # 4 characters carry 3 bytes: judge the size before decoding anything.
    decoded_size = len(body) * 3 // 4
    if decoded_size > DATA_URL_MAX_BYTES + 2:
        rule = (
            f"holds about {decoded_size} bytes, over the {DATA_URL_MAX_BYTES // MB} MB cap for"
            f" inline images; upload it with client.upload() (up to {DEFAULT_MAX_MB:g} MB)"
        )
        raise InputRefused(Problem(field, shown, rule))
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputRefused(Problem(field, shown, f"data: URL is not valid base64: {exc}")) from None
    found = sniff_format(data)
    if found is not None and found in FORMATS and media != f"image/{found.lower()}":
        rule = f"says {media} but holds a {found} image"
        raise InputRefused(Problem(field, shown, rule))
    return data


def _s3_ref(value: str, field: str, shown: str) -> InputRef:
    parsed = urlparse(value)
    key = unquote(parsed.path.lstrip("/"))
    parts = key.split("/")
    if not parsed.netloc or not key or any(p in ("", ".", "..") for p in parts):
        rule = "must be s3://bucket/key inside the worker's store, with no empty, . or .. parts"
        raise InputRefused(Problem(field, shown, rule))
    if parsed.query or parsed.fragment:
        raise InputRefused(Problem(field, shown, "s3:// uri must not carry a query or fragment"))
    return InputRef("s3", value, bucket=parsed.netloc, key=key)


def _file_ref(value: str, field: str, shown: str) -> InputRef:
    parsed = urlparse(value)
    path = unquote(parsed.path)
    if parsed.netloc not in ("", "localhost") or not posixpath.isabs(path):
        rule = "must be file:///absolute/path inside the worker's store (no host)"
        raise InputRefused(Problem(field, shown, rule))
    if parsed.query or parsed.fragment or "\x00" in path:
        raise InputRefused(Problem(field, shown, "file:// uri must be a plain path"))
    return InputRef("file", value, path=posixpath.normpath(path))


def _shown(value: object) -> str:
    """A reference fit to echo: a data: URL shows its head and length, anything else is cut."""
    if isinstance(value, str) and value.startswith("data:") and len(value) > 64:
        return f"{value[:40]}... ({len(value)} chars)"
    shown: str = short(value if isinstance(value, str) else repr(value), 120)
    return shown


def _too_big(size: int, max_bytes: int, cap: str = "KILN_INPUT_MAX_MB") -> str:
    return (
        f"is {size} bytes ({megabytes(size)} MB), over the cap of {max_bytes} bytes"
        f" ({megabytes(max_bytes)} MB, {cap})"
    )


def megabytes(size: int) -> str:
    """size in MiB for a message: 16, 0.1, 2.35."""
    return f"{size / MB:.2f}".rstrip("0").rstrip(".")


def _too_many_pixels(width: int, height: int, max_pixels: int) -> str:
    return f"is {width}x{height} = {width * height} pixels, over the cap of {max_pixels} pixels"
