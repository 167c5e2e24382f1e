"""A job's input images, read and checked again on the worker (never trust the queue): an upload
from Redis with its sha256 checked, an inline data: URL, or a file inside this worker's own store;
then opened as the pipeline takes them (images RGB, masks L) within the same caps as the client's.

The grammar of a reference lives in api_client.inputs. Failures that heal (the store's S3 5xx,
throttling, a refused connection) raise the store's StoreUnavailable, so the queue runs the job
again later; everything else raises InputUnavailable, which fails the job with its one line.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from api_client.connection import connect
from api_client.errors import short
from api_client.inputs import (
    DATA_URL_MAX_BYTES,
    DEFAULT_MAX_MB,
    DEFAULT_TTL_S,
    MAX_PIXELS,
    MB,
    InputRef,
    InputRefused,
    decode_image,
    expired_rule,
    megabytes,
    output_image,
    parse_ref,
    uploaded_bytes,
    within_store,
)
from worker.errors import StoreError
from worker.files.details import InputDigest
from worker.files.local import LocalStore
from worker.files.s3 import S3Store
from worker.files.store import Store
from worker.pipelines import control
from worker.pipelines.control import Control

if TYPE_CHECKING:
    from PIL import Image
    from redis import Redis

    from api_client.manifest import Manifest
    from api_client.schema import RenderRequest
    from worker.settings import Settings


class InputUnavailable(Exception):
    """An input image cannot be used: expired, changed after upload, outside the store, missing,
    or not an image within the caps. The message is one line naming the field, the uri (a data:
    URL shortened) and what went wrong."""


@dataclass(frozen=True)
class LoadedInput:
    """An input ready for the pipeline, with the sha256 of the bytes it was decoded from (for the
    generation details an image carries)."""

    image: Image.Image
    sha256: str


def load_input(
    uri: str, conn: Redis, store: Store, settings: Settings, *, field: str = "image"
) -> LoadedInput:
    """Read the reference and open it: field "mask" gives an L image, anything else RGB."""
    max_mb, ttl_s = settings.input_max_mb, settings.input_ttl_s
    data = read_input(uri, conn, store, field=field, max_mb=max_mb, ttl_s=ttl_s)
    image = open_input(data, uri, field=field, max_mb=max_mb)
    return LoadedInput(image=image, sha256=hashlib.sha256(data).hexdigest())


def read_input(
    uri: str,
    conn: Redis,
    store: Store,
    *,
    field: str = "image",
    max_mb: float = DEFAULT_MAX_MB,
    ttl_s: int = DEFAULT_TTL_S,
) -> bytes:
    """The reference's bytes: an upload's checked against its sha256, a store file's read only
    from inside the store. InputUnavailable otherwise (ttl_s only names the lifetime)."""
    try:
        ref = parse_ref(uri, field)
    except InputRefused as exc:
        raise InputUnavailable(_line(field, uri, exc.problem.rule)) from None
    max_bytes = int(max_mb * MB)
    if ref.kind == "data":
        return ref.data or b""
    if ref.kind == "upload":
        return _uploaded(ref, conn, field, ttl_s)
    expected = None
    if ref.kind == "output":
        ref, expected = _output(ref, conn, field)
    data = _from_store(ref, store, field, max_bytes)
    if len(data) > max_bytes:
        raise InputUnavailable(_line(field, uri, _over(len(data), max_bytes)))
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise InputUnavailable(_line(field, uri, "changed in the store since its job wrote it"))
    return data


def _output(ref: InputRef, conn: Redis, field: str) -> tuple[InputRef, str | None]:
    """The store object a kiln-output: reference names, still named by the reference in every
    error (the requester never learns the store's path), and the sha256 its job recorded."""
    try:
        image = output_image(conn, ref, field)
        stored = parse_ref(image.uri or "", field)
    except InputRefused as exc:
        raise InputUnavailable(_line(field, ref.uri, exc.problem.rule)) from None
    return dataclasses.replace(stored, uri=ref.uri), image.sha256


def open_input(
    data: bytes,
    uri: str,
    *,
    field: str = "image",
    max_mb: float = DEFAULT_MAX_MB,
    max_pixels: int = MAX_PIXELS,
) -> Image.Image:
    """The decoded image, upright (EXIF orientation applied), RGB (L for a mask), after the
    client's checks again: PNG, JPEG or WebP, within the byte and pixel caps, not truncated."""
    from PIL import ImageOps

    cap = DATA_URL_MAX_BYTES if uri.startswith("data:") else int(max_mb * MB)
    try:
        _, decoded = decode_image(data, field, max_bytes=cap, max_pixels=max_pixels)
    except InputRefused as exc:
        raise InputUnavailable(_line(field, uri, exc.problem.rule)) from None
    upright = ImageOps.exif_transpose(decoded)
    return eight_bit(upright).convert("L" if field == "mask" else "RGB")


def eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit grey image (Pillow's I;16 modes, or I from a PNG) as 8-bit L, each value's high
    byte: Pillow's own convert() clips 16-bit values at 255, so an ordinary 16-bit grey PNG would
    render 99 % white. 8-bit and colour images come back as they are (Pillow reads 16-bit colour
    PNGs as 8-bit RGB already)."""
    if image.mode not in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        return image
    import numpy
    from PIL import Image

    pixels = numpy.asarray(image).astype(numpy.int64)
    return Image.fromarray((numpy.clip(pixels, 0, 65535) >> 8).astype(numpy.uint8), "L")


def check_mask_size(image: Image.Image, mask: Image.Image, mask_uri: str) -> None:
    """InputUnavailable naming both sizes unless the mask is exactly the image's size."""
    if image.size != mask.size:
        (iw, ih), (mw, mh) = image.size, mask.size
        rule = f"is {mw}x{mh}; a mask must be the image's size, {iw}x{ih}"
        raise InputUnavailable(_line("mask", mask_uri, rule))


# -- the reads -----------------------------------------------------------------------------------


def _uploaded(ref: InputRef, conn: Redis, field: str, ttl_s: int) -> bytes:
    expected = ref.sha256 or ""
    data = uploaded_bytes(conn, expected)
    if data is None:
        raise InputUnavailable(_line(field, ref.uri, expired_rule(ttl_s)))
    found = hashlib.sha256(data).hexdigest()
    if found != expected:
        rule = (
            f"the bytes in Redis hash to sha256 {found}, not {expected}: the input was changed"
            " after upload; upload it again"
        )
        raise InputUnavailable(_line(field, ref.uri, rule))
    return data


def _from_store(ref: InputRef, store: Store, field: str, max_bytes: int) -> bytes:
    """A file of this worker's store, never one outside it (StoreUnavailable passes through)."""
    outside = (
        f"is outside the worker's store {store.location}: only files in the store"
        " (KILN_OUTPUT_URL) may be read"
    )
    if isinstance(store, S3Store):
        if ref.kind != "s3" or not within_store(ref, store.location):
            raise InputUnavailable(_line(field, ref.uri, outside))
        try:
            data = store.get(ref.key or "")
        except StoreError as exc:
            raise InputUnavailable(_line(field, ref.uri, f"cannot be read: {exc}")) from None
        if data is None:
            raise InputUnavailable(_line(field, ref.uri, "is not in the store (no such key)"))
        return data
    if isinstance(store, LocalStore):
        if ref.kind != "file":
            raise InputUnavailable(_line(field, ref.uri, outside))
        return _local_file(ref, store, field, max_bytes, outside)
    raise InputUnavailable(
        _line(field, ref.uri, f"this worker's store {store.location} has no reads")
    )


def _local_file(
    ref: InputRef, store: LocalStore, field: str, max_bytes: int, outside: str
) -> bytes:
    # Resolved on this disk, symlinks followed: a link inside the store to /etc stays outside.
    directory = os.path.realpath(store.directory)
    path = os.path.realpath(ref.path or "")
    if os.path.commonpath([directory, path]) != directory or path == directory:
        raise InputUnavailable(_line(field, ref.uri, outside))
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > max_bytes:
                raise InputUnavailable(_line(field, ref.uri, _over(size, max_bytes)))
            return handle.read(max_bytes + 1)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InputUnavailable(_line(field, ref.uri, f"cannot be read: {reason}")) from None


def _over(size: int, max_bytes: int) -> str:
    return (
        f"is {size} bytes, over the cap of {max_bytes} bytes"
        f" ({megabytes(max_bytes)} MB, KILN_INPUT_MAX_MB)"
    )


def _line(field: str, uri: str, rule: str) -> str:
    shown = f"{uri[:40]}... ({len(uri)} chars)" if len(uri) > 120 else uri
    return f"{field} {shown}: {rule}"


class InputReader:
    """The renderer's inputs step: a job's images read, checked and opened within the settings'
    caps; uploads come from the worker's Redis, its connection opened at the first one read."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @functools.cached_property
    def redis(self) -> Redis:
        return connect(self.settings.redis_url, ride_out_restarts=True)

    def read(self, request: RenderRequest, manifest: Manifest, store: Store) -> JobInputs:
        """The inputs as the pipeline takes them (image, mask_image), the controls with their
        images preprocessed, the reference image, and each input's sha256."""
        read = JobInputs()
        if request.image is not None:
            image = self._sized(request, request.image, "image", store)
            read.sources["image"] = image.image
            read.digests.append(InputDigest(field="image", sha256=image.sha256))
        if request.mask is not None:
            mask = load_input(request.mask, self.redis, store, self.settings, field="mask")
            check_mask_size(read.sources["image"], mask.image, request.mask)
            read.sources["mask_image"] = mask.image
            read.digests.append(InputDigest(field="mask", sha256=mask.sha256))
        for index, choice in enumerate(request.controls or []):
            field: ControlField = "controls.0.image" if index == 0 else "controls.1.image"
            given = self._sized(request, choice.image, field, store)
            ready = control.preprocess(given.image, choice.preprocess)
            read.controls.append(Control(choice, manifest.controlnets[choice.name], ready))
            read.digests.append(InputDigest(field=field, sha256=given.sha256))
        if request.reference is not None:  # any size: its image encoder resizes and crops it
            uri = request.reference.image
            ref = load_input(uri, self.redis, store, self.settings, field="reference.image")
            read.reference = ref.image
            read.digests.append(InputDigest(field="reference.image", sha256=ref.sha256))
        return read

    def _sized(self, request: RenderRequest, uri: str, field: str, store: Store) -> LoadedInput:
        """An RGB input that must be the job's size (kiln never resizes one)."""
        loaded = load_input(uri, self.redis, store, self.settings, field=field)
        if loaded.image.size != (request.width, request.height):
            width, height = loaded.image.size
            raise InputUnavailable(
                f"{field} {short(uri)}: is {width}x{height}, not the job's size"
                f" {request.width}x{request.height} (kiln never resizes an input)"
            )
        return loaded


ControlField = Literal["controls.0.image", "controls.1.image"]


@dataclass
class JobInputs:
    """What the inputs step read for a job: the pipeline's own inputs (image, mask_image), its
    controls ready for the ControlNets, its reference image for the IP-Adapter, and every
    input's sha256 for the image details."""

    sources: dict[str, Image.Image] = field(default_factory=dict)
    controls: list[Control] = field(default_factory=list)
    reference: Image.Image | None = None  # the IP-Adapter's reference image, as given
    digests: list[InputDigest] = field(default_factory=list)
