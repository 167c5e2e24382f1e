"""The store in an S3-compatible bucket (s3://bucket/prefix in KILN_OUTPUT_URL: AWS, MinIO, R2...),
through boto3, with the same layout and invariants as the local store (worker.files.store).

Every failure is named (endpoint, bucket, key; never a credential) and sorted: one that heals (a
5xx, throttling, a refused, reset or timed-out connection) raises StoreUnavailable, so the queue
runs the job again later; any other raises StoreError and fails the job at once."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from PIL import Image

from api_client.redact import redact
from api_client.schema import ImageFile, PreviewRef, RenderResult, VideoFile
from worker.errors import JobDeadlineExceeded, OutputError, StoreError, StoreUnavailable
from worker.files import output
from worker.files.jobfiles import PREVIEW_FILE, JobFiles, RecentPreviews
from worker.files.output import EncodedImage
from worker.settings import Settings

log = logging.getLogger(__name__)
StoredFile = TypeVar("StoredFile", ImageFile, VideoFile)

_CONTENT_TYPE = {
    "png": "image/png",
    "webp": "image/webp",
    "jpeg": "image/jpeg",
    "mp4": "video/mp4",
    "webm": "video/webm",
}
# S3 answers that heal: botocore's own transient and throttling codes and statuses (its standard
# retry mode retries these first). 501 NotImplemented does not heal.
_HEALING_STATUS = frozenset({429, 500, 502, 503, 504})
_HEALING_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
    }
)


class S3Store:
    """s3://bucket/prefix on AWS, MinIO, R2 or any S3-compatible service, through boto3.

    Every failure becomes one StoreError (or StoreUnavailable, when it heals) naming endpoint,
    bucket and key (never a credential); boto3 reconnects on its own, so a store that comes back
    serves the next job.
    """

    def __init__(self, url: str, settings: Settings) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise StoreError(f"KILN_OUTPUT_URL {url!r} is not s3://bucket[/prefix]")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.location = url
        self.expires_s = settings.url_expires_s
        self.endpoint = settings.aws_endpoint_url or "the AWS default endpoint"
        self._secrets = settings.secrets()
        self._client = _s3_client(settings)
        self._previews = RecentPreviews()
        self._files = JobFiles()

    def key(self, job_id: str, name: str) -> str:
        output.job_dir(Path("."), job_id)  # the same job id rules as on disk
        return "/".join(part for part in (self.prefix, job_id, name) if part)

    def save_images(self, job_id: str, images: list[EncodedImage]) -> list[ImageFile]:
        """Put each image; if one fails (or the deadline lands), none of the job's objects stay."""
        files: list[ImageFile] = []
        try:
            for index, image in enumerate(images):
                key = self.key(job_id, output.image_name(index, image))
                self._files.add(job_id, key)
                self._put(key, image.data, _CONTENT_TYPE[image.format])
                files.append(
                    ImageFile(
                        uri=f"s3://{self.bucket}/{key}",
                        url=self._presign(key),
                        width=image.width,
                        height=image.height,
                        format=image.format,
                        sha256=image.sha256,
                    )
                )
        except BaseException:
            self.close_job(job_id, keep=False)
            raise
        return files

    def save_preview(self, job_id: str, image: Image.Image) -> str:
        key = self.key(job_id, PREVIEW_FILE)
        data = output.preview_jpeg(image)
        self._files.add(job_id, key)
        self._put(key, data, "image/jpeg")
        uri = f"s3://{self.bucket}/{key}"
        self._previews.put(uri, data)
        return uri

    def preview_ref(self, uri: str) -> PreviewRef:
        key = urlparse(uri).path.lstrip("/")
        return PreviewRef(uri=uri, url=self._presign(key), data=self._previews.inline(uri))

    def write_result(self, result: RenderResult) -> None:
        """result.json, last; if it cannot be put, the job's images go too. (A put that timed out
        may still have landed: its key is deleted as well.)"""
        key = self.key(result.job_id, output.RESULT_FILE)
        self._files.add(result.job_id, key)
        try:
            self._put(key, result.model_dump_json(indent=2).encode(), "application/json")
        except BaseException:
            self.close_job(result.job_id, keep=False)
            raise

    def finished_result(self, job_id: str, request_digest: str) -> RenderResult | None:
        """The stored result of this request with fresh presigned URLs (the stored ones may have
        expired). None when there is none; StoreError when the store cannot be asked."""
        key = self.key(job_id, output.RESULT_FILE)
        data = self.get(key)
        if data is None:
            return None
        try:
            result = RenderResult.model_validate_json(data)
        except ValueError:
            return None
        result = output.same_request(result, request_digest, f"s3://{self.bucket}/{key}")
        images = [self._fresh(image) for image in result.images]
        videos = [self._fresh(video) for video in result.videos]
        return result.model_copy(update={"images": images, "videos": videos})

    def _fresh(self, stored: StoredFile) -> StoredFile:
        """A stored image or video with a new presigned URL for its object."""
        return stored.model_copy(update={"url": self._presign(urlparse(stored.uri or "").path[1:])})

    def close_job(self, job_id: str, *, keep: bool) -> None:
        keys = self._files.take(job_id)
        if not keep and keys:
            self._delete_quietly(job_id, keys)

    # -- boto3 calls, each failure named -------------------------------------------------------

    def _put(self, key: str, data: bytes, content_type: str) -> None:
        try:
            self._client.put_object(
                Bucket=self.bucket, Key=key, Body=data, ContentType=content_type
            )
        except Exception as exc:
            raise self._error("put", key, exc) from None

    def get(self, key: str) -> bytes | None:
        """The object's bytes; None when there is no such key (StoreError, StoreUnavailable
        when the store cannot be asked)."""
        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=key)
            data: bytes = answer["Body"].read()
            return data
        except Exception as exc:
            if _error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise self._error("get", key, exc) from None

    def _presign(self, key: str) -> str:
        url: str = self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=self.expires_s
        )
        return url

    def _delete_quietly(self, job_id: str, keys: list[str]) -> None:
        """Delete a failed job's objects, one by one (multi-object delete is not everywhere S3
        is). Never raises over the job's own error, not even the job's deadline landing in here;
        once the store is unreachable the rest are not tried (each would wait out the timeouts
        again): what stays behind is logged."""
        for done, key in enumerate(keys):
            try:
                self._client.delete_object(Bucket=self.bucket, Key=key)
            except (Exception, JobDeadlineExceeded) as exc:
                left = [f"s3://{self.bucket}/{k}" for k in keys[done:]]
                reason = redact(str(exc), self._secrets)
                log.warning(
                    "job %s did not finish; left behind %s: %s", job_id, ", ".join(left), reason
                )
                return

    def _error(self, verb: str, key: str, exc: BaseException) -> OutputError:
        """The failure, named; StoreUnavailable when it heals, StoreError when it will not."""
        code = _error_code(exc)
        reason = redact(str(exc), self._secrets)
        hint = {
            "NoSuchBucket": "the bucket does not exist",
            "InvalidAccessKeyId": "the access key is not known to the store",
            "SignatureDoesNotMatch": "the secret key is wrong",
            "AccessDenied": "the credentials may not do this",
        }.get(code or "", "")
        detail = f"{hint}: {reason}" if hint else reason
        message = f"cannot {verb} s3://{self.bucket}/{key} at endpoint {self.endpoint}: {detail}"
        if _heals(exc):
            return StoreUnavailable(message, cause=f"store at {self.endpoint}: {reason}")
        return StoreError(message)


def _error_code(exc: BaseException) -> str | None:
    response: Any = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    return None


def _heals(exc: BaseException) -> bool:
    """Whether an S3 failure heals: no answer at all (refused, reset, timed out), a 500, 502,
    503, 504 or 429, or a throttling code (SlowDown, RequestTimeout...). A TLS failure (a wrong
    certificate), a 501 and every other 4xx (NoSuchBucket, AccessDenied, InvalidAccessKeyId)
    do not."""
    from botocore import exceptions as boto

    if isinstance(exc, boto.SSLError):
        return False
    no_answer = (
        boto.ConnectionError,  # refused, DNS, connect timeout
        boto.HTTPClientError,  # reset, closed, read timeout, a body cut short
        boto.IncompleteReadError,
        ConnectionError,  # the builtin family: raised bare by a few code paths
        TimeoutError,
    )
    if isinstance(exc, no_answer):
        return True
    response: Any = getattr(exc, "response", None)
    meta = response.get("ResponseMetadata", {}) if isinstance(response, dict) else {}
    status = int(meta.get("HTTPStatusCode") or 0)
    return _error_code(exc) in _HEALING_CODES or status in _HEALING_STATUS


def _s3_client(settings: Settings) -> Any:
    """A boto3 S3 client with short timeouts and one retry: botocore's retry covers a blip,
    the queue's put-back with backoff covers an outage (StoreUnavailable). A call to a store
    that accepts connections and never answers gives up within about 2 x 10 s, a refused one
    within a second or two, so a dead store does not hold the GPU for minutes."""
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=3,
        read_timeout=10,
        retries={"max_attempts": 2, "mode": "standard"},
        signature_version="s3v4",
        s3={"addressing_style": "path"} if settings.aws_endpoint_url else None,
    )
    secret = settings.aws_secret_access_key
    return boto3.client(
        "s3",
        endpoint_url=settings.aws_endpoint_url,
        region_name=settings.aws_region,
        aws_access_key_id=settings.aws_access_key_id,
        aws_secret_access_key=secret.get_secret_value() if secret is not None else None,
        config=config,
    )
