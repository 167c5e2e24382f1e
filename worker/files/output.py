"""Images and results on disk: <output_dir>/<job id>/<n>.<ext> (generation details inside each,
worker/files/details.py) and result.json, written once.
A job that fails leaves none of its files behind (discard), and an OSError that heals (a network
mount gone away) is told apart from one that needs an operator (a full disk, a permission)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from api_client.schema import (
    ImageFile,
    OutputFormat,
    RenderRequest,
    RenderResult,
    StepCacheReport,
    VideoFile,
)
from worker.errors import JobDeadlineExceeded, OtherRequest, OutputError, StoreUnavailable
from worker.files.details import ImageDetails, InputDigest, image_details, save_options

if TYPE_CHECKING:
    from worker.pipelines.resident import Rendered

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
_PIL_FORMAT = {"png": "PNG", "webp": "WEBP", "jpeg": "JPEG"}
_EXTENSION = {"png": "png", "webp": "webp", "jpeg": "jpg", "mp4": "mp4", "webm": "webm"}
# OSErrors that heal on their own: an output directory on a network mount that timed out or
# lost its server. A full disk (ENOSPC, EDQUOT) does not heal within a few retries (it waits for
# an operator) and re-rendering the job to hit it again only burns device time, so it fails the
# job at once and says so; nor do EACCES, EROFS or EIO (a failing disk must not be retried).
_HEALING_ERRNOS = frozenset(
    {
        errno.ETIMEDOUT,
        errno.ESTALE,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.ENOTCONN,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EAGAIN,
    }
)


@dataclass(frozen=True)
class EncodedImage:
    """One file of a job's result, encoded: an image, or a video (with its frames and fps)."""

    data: bytes
    width: int
    height: int
    format: OutputFormat
    sha256: str
    frames: int | None = None  # a video's
    fps: int | None = None

    def as_video(self, stored: ImageFile) -> VideoFile:
        """This video's entry in a result, from the store's entry for its file."""
        assert self.frames is not None and self.fps is not None
        duration_s = round(self.frames / self.fps, 6)
        return VideoFile(
            **stored.model_dump(), frames=self.frames, fps=self.fps, duration_s=duration_s
        )


def encode_image(image: Image.Image, fmt: OutputFormat, details: ImageDetails) -> EncodedImage:
    """The image file's bytes, its generation details inside; sha256 is of exactly these bytes,
    what the store keeps."""
    buffer = io.BytesIO()
    options = {"png": {"compress_level": 4}, "webp": {"quality": 95}, "jpeg": {"quality": 95}}[fmt]
    options.update(save_options(details, fmt))
    image.convert("RGB").save(buffer, format=_PIL_FORMAT[fmt], **options)
    data = buffer.getvalue()
    return EncodedImage(data, image.width, image.height, fmt, hashlib.sha256(data).hexdigest())


def encode_images(
    images: list[Image.Image],
    request: RenderRequest,
    loaded: Rendered,
    inputs: list[InputDigest],
    device: str,
    step_cache: StepCacheReport | None = None,
) -> list[EncodedImage]:
    """A job's image files, each with the details that rendered it inside (image_details)."""
    details = [
        image_details(request, loaded, i, inputs, device, step_cache) for i in range(len(images))
    ]
    return [
        encode_image(image, request.output_format, about)
        for image, about in zip(images, details, strict=True)
    ]


def encode_video(
    frames: list[Image.Image],
    request: RenderRequest,
    loaded: Rendered,
    inputs: list[InputDigest],
    device: str,
    step_cache: StepCacheReport | None = None,
) -> list[EncodedImage]:
    """A video job's one file: its frames in the request's container at its fps, with the
    details that rendered it inside (worker.files.video says where each container keeps them)."""
    from worker.files import video

    assert request.fps is not None and request.output_format in video.VIDEO_FORMATS
    details = image_details(request, loaded, 0, inputs, device, step_cache)
    fmt = request.output_format
    data = video.encode(frames, request.fps, fmt, details.document())
    width, height = frames[0].size
    digest = hashlib.sha256(data).hexdigest()
    return [EncodedImage(data, width, height, fmt, digest, frames=len(frames), fps=request.fps)]


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


def image_name(index: int, image: EncodedImage) -> str:
    return f"{index}.{_EXTENSION[image.format]}"


def save_images(output_dir: Path, job_id: str, images: list[EncodedImage]) -> list[ImageFile]:
    """Write each image atomically (temp file + rename), so a crash never leaves half a file.
    If any write fails, or the job's deadline lands in the middle, the images already written
    are removed before the error goes on: a failed save leaves no partial result."""
    directory = job_dir(output_dir, job_id)
    files: list[ImageFile] = []
    names: list[str] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for index, image in enumerate(images):
            names.append(image_name(index, image))
            path = directory / names[-1]
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
    except BaseException as exc:
        discard(output_dir, job_id, names)
        if isinstance(exc, OSError):
            message = f"cannot write images for job {job_id} under {directory}: {exc}"
            raise output_error(message, exc) from exc
        raise
    return files


def save_preview(output_dir: Path, job_id: str, image: Image.Image) -> str:
    """The latest denoising preview, replaced in place: <job dir>/preview.jpg."""
    directory = job_dir(output_dir, job_id)
    path = directory / "preview.jpg"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, preview_jpeg(image))
    except OSError as exc:
        message = f"cannot write preview for job {job_id} under {directory}: {exc}"
        raise output_error(message, exc) from exc
    return str(path.resolve())


def write_result(output_dir: Path, result: RenderResult) -> None:
    """result.json is written last: its presence means the job's files are complete."""
    path = job_dir(output_dir, result.job_id) / RESULT_FILE
    try:
        _write_atomic(path, result.model_dump_json(indent=2).encode())
    except OSError as exc:
        raise output_error(f"cannot write {path}: {exc}", exc) from exc


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


def discard(output_dir: Path, job_id: str, names: list[str]) -> None:
    """Remove these files of a failed job (and their temp files, which a deadline landing inside
    a write can leave), then its directory if nothing else is in it. Best effort and never
    raising: the job's own error is the one to report, and a file that cannot go is logged."""
    directory = job_dir(output_dir, job_id)
    for name in names:
        for path in (directory / name, _tmp_path(directory / name)):
            try:
                path.unlink(missing_ok=True)
            except (Exception, JobDeadlineExceeded) as exc:
                log.warning("job %s did not finish; left behind %s: %s", job_id, path, exc)
    with contextlib.suppress(OSError):  # not empty (a result kept, other files) or gone already
        directory.rmdir()


def output_error(message: str, exc: OSError) -> OutputError:
    """An OSError as the job's failure: StoreUnavailable when it heals, else an OutputError."""
    if exc.errno in _HEALING_ERRNOS:
        return StoreUnavailable(message, cause=str(exc))
    return OutputError(message)


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = _tmp_path(path)
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)
