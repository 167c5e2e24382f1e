"""A finished job's files as the gateway serves them (/v1/jobs/{id}/images/{n} and
/videos/{n}): which file a route names, read from a local store only where a worker published
that store, or a redirect to S3's presigned URL; and a video's byte ranges.

Ranges (RFC 9110 section 14): a browser's <video> asks for `Range: bytes=a-b` to start and to
seek, and seeks only in what a server answers with 206 and Content-Range. One range is served; a
header not taken whole (several ranges, a unit other than bytes, bad syntax) is ignored and the
whole file is the answer, as the RFC lets a server do. A file's ETag is its sha256 (its bytes
never change), so If-Range holds a range to the bytes it was asked of."""

from __future__ import annotations

import re
from typing import Literal, overload
from urllib.parse import unquote, urlparse

from fastapi import HTTPException
from fastapi.responses import RedirectResponse, Response

from api_client import inputs, keys
from api_client.client import KilnClient
from api_client.errors import RenderFailed, UnknownJob
from api_client.fetch import FetchFailed, fetch_image
from api_client.job import KilnJob
from api_client.schema import ImageFile, RenderResult, VideoFile

Kind = Literal["image", "video"]
PRIVATE_CACHE = {"Cache-Control": "private, max-age=3600"}
# A video's media type by its format (worker.files.video.FORMATS says the same; the gateway
# imports no worker code). An animated WebP is an image to a browser.
VIDEO_TYPES = {"mp4": "video/mp4", "webm": "video/webm", "webp": "image/webp"}
SINGLE_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@overload
def stored(
    client: KilnClient, job: KilnJob, n: int, kind: Literal["image"]
) -> ImageFile | RedirectResponse: ...
@overload
def stored(
    client: KilnClient, job: KilnJob, n: int, kind: Literal["video"]
) -> VideoFile | RedirectResponse: ...
def stored(
    client: KilnClient, job: KilnJob, n: int, kind: Kind
) -> ImageFile | VideoFile | RedirectResponse:
    """The job's n-th image or video, or the redirect to it in S3; 404 naming why there is none
    (a finished job of the other kind names the route its files are at)."""
    try:
        result = job.result()
    except (UnknownJob, RenderFailed):
        result = None
    files = [] if result is None else result.images if kind == "image" else result.videos
    if result is None or not 0 <= n < len(files):
        raise HTTPException(404, _none(job.id, n, kind, result))
    found = files[n]
    if found.uri and found.uri.startswith("s3://"):
        if not found.url:
            raise HTTPException(404, f"the {kind} is in S3 and has no presigned URL")
        return RedirectResponse(found.url, status_code=307)
    if not in_published_store(client, found.uri or found.path or ""):
        raise HTTPException(404, f"the {kind} lies outside every store the workers published")
    return found


def _none(job_id: str, n: int, kind: Kind, result: RenderResult | None) -> str:
    if kind == "image" and result is not None and result.videos:
        return f"job {job_id!r} is a video job: its videos are at /v1/jobs/{job_id}/videos/<n>"
    if kind == "video" and result is not None and result.images:
        return f"job {job_id!r} is an image job: its images are at /v1/jobs/{job_id}/images/<n>"
    return f"job {job_id!r} has no {kind} {n}"


def read(found: ImageFile | VideoFile) -> bytes:
    """A local store's file, sha256 checked; 404 naming what went wrong."""
    try:
        return fetch_image(found)
    except FetchFailed as exc:
        raise HTTPException(404, str(exc)) from None


def in_published_store(client: KilnClient, where: str) -> bool:
    """Whether a file the gateway is about to read lies in a store a worker published (the
    gateway never reads a path a Redis entry merely names)."""
    stores = client.connection.smembers(keys.STORES_KEY)
    if not where:
        return False
    path = unquote(urlparse(where).path) if where.startswith("file://") else where
    ref = inputs.InputRef(kind="file", uri=where, path=path)
    return any(inputs.within_store(ref, s.decode() if isinstance(s, bytes) else s) for s in stores)


# -- byte ranges ---------------------------------------------------------------------------------


class Unsatisfiable(Exception):
    """A range that starts past the file's end: 416, naming the file's size."""

    def __init__(self, size: int) -> None:
        super().__init__(f"no byte of the range lies within the file's {size} bytes")
        self.size = size


def wanted(header: str | None, size: int) -> tuple[int, int] | None:
    """The first and last byte (inclusive) one range asks for, cut to the file; None for the
    whole file (no header, or one not taken); Unsatisfiable when it starts past the end."""
    found = SINGLE_RANGE.fullmatch((header or "").strip())
    if found is None or found.group(1) == found.group(2) == "":
        return None
    first, last = found.group(1), found.group(2)
    if first == "":  # bytes=-n: the last n bytes
        if int(last) == 0:
            raise Unsatisfiable(size)
        return max(size - int(last), 0), size - 1
    start = int(first)
    if last != "" and int(last) < start:
        return None  # bytes=5-2 is not a range: ignored
    end = size - 1 if last == "" else min(int(last), size - 1)
    if end < start:
        raise Unsatisfiable(size)
    return start, end


def ranged(
    data: bytes, video: VideoFile, range_header: str | None, if_range: str | None
) -> Response:
    """The video whole (200) or the range asked for (206 with Content-Range); 416 with
    `Content-Range: bytes */size` for a range past the end. Every answer says Accept-Ranges."""
    etag = f'"{video.sha256}"'
    headers = {**PRIVATE_CACHE, "Accept-Ranges": "bytes", "ETag": etag}
    if if_range is not None and if_range.strip() != etag:
        range_header = None  # a range of other bytes than these: the whole file
    media_type = VIDEO_TYPES[video.format]
    try:
        taken = wanted(range_header, len(data))
    except Unsatisfiable as exc:
        headers["Content-Range"] = f"bytes */{exc.size}"
        raise HTTPException(416, str(exc), headers=headers) from None
    if taken is None:
        return Response(data, media_type=media_type, headers=headers)
    start, end = taken
    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
    return Response(data[start : end + 1], 206, media_type=media_type, headers=headers)
