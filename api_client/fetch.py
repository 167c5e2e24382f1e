"""Read a result's images and videos from wherever the worker stored them, from any host: the
presigned HTTPS url (no S3 credentials needed), a file:// uri or path, or s3:// with boto3 if
installed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from api_client.errors import KilnError
from api_client.redact import redact
from api_client.schema import ImageFile, VideoFile

FETCH_TIMEOUT_S = 30.0


class FetchFailed(KilnError):
    """A result's file could not be read, or its bytes do not match the sha256 in the result."""


def fetch_image(image: ImageFile | VideoFile, timeout: float = FETCH_TIMEOUT_S) -> bytes:
    """The bytes of one file of a result, an image or a video (both are stored and named alike),
    checked against its sha256; FetchFailed naming where it looked."""
    import urllib.error  # with urllib.request (and ssl) on first use, not at `import api_client`

    tried: list[str] = []
    for where, read in _sources(image, timeout):
        try:
            data: bytes = read()
        except (OSError, urllib.error.URLError, FetchFailed) as exc:
            tried.append(f"{redact(where)}: {exc}")
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest != image.sha256:
            raise FetchFailed(
                f"{redact(where)}: sha256 {digest} does not match the result's {image.sha256}"
            )
        return data
    if not tried:
        raise FetchFailed(f"the {_kind(image)} has no url, uri or path to read it from")
    raise FetchFailed(f"cannot read the {_kind(image)}: " + "; ".join(tried))


def _kind(file: ImageFile | VideoFile) -> str:
    return "video" if isinstance(file, VideoFile) else "image"


def _sources(image: ImageFile | VideoFile, timeout: float) -> list[tuple[str, Any]]:
    sources: list[tuple[str, Any]] = []
    if image.url:
        sources.append((image.url, lambda: _http(image.url or "", timeout)))
    if image.uri and image.uri.startswith("file://"):
        path = Path(unquote(urlparse(image.uri).path))
        sources.append((image.uri, path.read_bytes))
    elif image.path and not image.uri:
        sources.append((image.path, Path(image.path).read_bytes))
    if image.uri and image.uri.startswith("s3://"):
        sources.append((image.uri, lambda: _s3(image.uri or "", timeout)))
    return sources


def _http(url: str, timeout: float) -> bytes:
    import urllib.request

    if not url.startswith(("https://", "http://")):
        raise FetchFailed(f"url scheme is not http(s): {url[:40]!r}")
    with urllib.request.urlopen(url, timeout=timeout) as response:
        data: bytes = response.read()
        return data


def _s3(uri: str, timeout: float) -> bytes:
    """The fallback when the presigned url is missing or expired: needs boto3 and AWS_* settings
    (the backend's own credentials). Imported here only, so `import api_client` stays light."""
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        raise FetchFailed("no presigned url usable, and boto3 is not installed") from None
    parsed = urlparse(uri)
    config = Config(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 2})
    client = boto3.client("s3", config=config)  # boto3 reads AWS_ENDPOINT_URL and the keys
    try:
        body = client.get_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))["Body"]
        data: bytes = body.read()
        return data
    except (BotoCoreError, ClientError) as exc:
        raise FetchFailed(str(exc)) from None
