"""Images and results on disk: <output_dir>/<job id>/<n>.<ext> and result.json, written once."""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from api_client.schema import ImageFile, OutputFormat, RenderResult

RESULT_FILE = "result.json"
REQUEST_FILE = "request.sha256"  # the resolved request's digest, written just before result.json
_PIL_FORMAT = {"png": "PNG", "webp": "WEBP", "jpeg": "JPEG"}
_EXTENSION = {"png": "png", "webp": "webp", "jpeg": "jpg"}


class OutputError(RuntimeError):
    """The output directory cannot take the job's files (missing permission, full disk...)."""


@dataclass(frozen=True)
class EncodedImage:
    data: bytes
    width: int
    height: int
    format: OutputFormat
    sha256: str


def encode_image(image: Image.Image, fmt: OutputFormat) -> EncodedImage:
    buffer = io.BytesIO()
    options = {"png": {"compress_level": 4}, "webp": {"quality": 95}, "jpeg": {"quality": 95}}[fmt]
    image.convert("RGB").save(buffer, format=_PIL_FORMAT[fmt], **options)
    data = buffer.getvalue()
    return EncodedImage(data, image.width, image.height, fmt, hashlib.sha256(data).hexdigest())


def job_dir(output_dir: Path, job_id: str) -> Path:
    if not job_id or "/" in job_id or job_id in (".", "..") or "\x00" in job_id:
        raise OutputError(f"job id {job_id!r} cannot name an output directory")
    return output_dir / job_id


def save_images(output_dir: Path, job_id: str, images: list[EncodedImage]) -> list[ImageFile]:
    """Write each image atomically (temp file + rename), so a crash never leaves half a file."""
    directory = job_dir(output_dir, job_id)
    files: list[ImageFile] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for index, image in enumerate(images):
            path = directory / f"{index}.{_EXTENSION[image.format]}"
            _write_atomic(path, image.data)
            files.append(
                ImageFile(
                    path=str(path.resolve()),
                    width=image.width,
                    height=image.height,
                    format=image.format,
                    sha256=image.sha256,
                )
            )
    except OSError as exc:
        raise OutputError(f"cannot write images for job {job_id} under {directory}: {exc}") from exc
    return files


def save_preview(output_dir: Path, job_id: str, image: Image.Image) -> str:
    """The latest denoising preview, replaced in place: <job dir>/preview.jpg."""
    directory = job_dir(output_dir, job_id)
    path = directory / "preview.jpg"
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=85)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, buffer.getvalue())
    except OSError as exc:
        raise OutputError(
            f"cannot write preview for job {job_id} under {directory}: {exc}"
        ) from exc
    return str(path.resolve())


class OtherRequest(RuntimeError):
    """A job id's files on disk were rendered from a different request; never answer with them."""


def write_result(output_dir: Path, result: RenderResult, request_digest: str = "") -> None:
    """result.json is written last: its presence means the job's files are complete. Beside it,
    the digest of the request they were rendered from, so a reused job id is never answered
    with another request's images."""
    path = job_dir(output_dir, result.job_id) / RESULT_FILE
    try:
        _write_atomic(path.with_name(REQUEST_FILE), request_digest.encode())
        _write_atomic(path, result.model_dump_json(indent=2).encode())
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc}") from exc


def finished_result(output_dir: Path, job_id: str, request_digest: str = "") -> RenderResult | None:
    """The result of this request completed on disk (a worker died before reporting it).

    OtherRequest when the job id's files come from a different request (or from a kiln that
    kept no digest): answering with them would hand back someone else's images, and rendering
    over them would destroy them."""
    directory = job_dir(output_dir, job_id)
    try:
        result = RenderResult.model_validate_json((directory / RESULT_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    try:
        stored = (directory / REQUEST_FILE).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        stored = ""
    if stored != request_digest:
        raise OtherRequest(
            f"job {job_id}: {directory} already holds the result of a different request"
            f" ({REQUEST_FILE} {stored[:12] or 'missing'}, this request {request_digest[:12]});"
            " submit it under a new job id"
        )
    return result


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)
