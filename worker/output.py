"""Images and results on disk: <output_dir>/<job id>/<n>.<ext> and result.json, written once."""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from api_client.schema import ImageFile, OutputFormat, RenderResult
from worker.errors import OtherRequest, OutputError

RESULT_FILE = "result.json"
RECORDED_MARK = ".recorded"  # the job's timing record was written (after result.json)
_PIL_FORMAT = {"png": "PNG", "webp": "WEBP", "jpeg": "JPEG"}
_EXTENSION = {"png": "png", "webp": "webp", "jpeg": "jpg"}


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


def extension(fmt: OutputFormat) -> str:
    return _EXTENSION[fmt]


def preview_jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


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
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, preview_jpeg(image))
    except OSError as exc:
        raise OutputError(
            f"cannot write preview for job {job_id} under {directory}: {exc}"
        ) from exc
    return str(path.resolve())


def write_result(output_dir: Path, result: RenderResult) -> None:
    """result.json is written last: its presence means the job's files are complete."""
    path = job_dir(output_dir, result.job_id) / RESULT_FILE
    try:
        _write_atomic(path, result.model_dump_json(indent=2).encode())
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc}") from exc


def finished_result(output_dir: Path, job_id: str, request_digest: str) -> RenderResult | None:
    """The result of this request completed on disk (a worker died before reporting it)."""
    path = job_dir(output_dir, job_id) / RESULT_FILE
    try:
        result = RenderResult.model_validate_json(path.read_bytes())
    except (OSError, ValueError):
        return None
    return same_request(result, request_digest, str(path))


def same_request(result: RenderResult, request_digest: str, where: str) -> RenderResult:
    """result, if it answers this request; OtherRequest when the job id's result came from a
    different request (or from a kiln that kept no digest): answering with it would hand back
    someone else's images, and rendering over it would destroy them."""
    if result.request_sha256 != request_digest:
        stored = (result.request_sha256 or "missing")[:12]
        raise OtherRequest(
            f"job {result.job_id}: {where} holds the result of a different request"
            f" (request_sha256 {stored}, this request {request_digest[:12]});"
            " submit it under a new job id"
        )
    return result


def mark_recorded(output_dir: Path, job_id: str) -> bool:
    """The job's one timing record is written; a worker answering it from disk writes none.
    False if the mark cannot be made: at worst a crash then costs a second record, not the job."""
    try:
        (job_dir(output_dir, job_id) / RECORDED_MARK).touch()
    except OSError:
        return False
    return True


def recorded(output_dir: Path, job_id: str) -> bool:
    return (job_dir(output_dir, job_id) / RECORDED_MARK).exists()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)
