"""Where a job's files go: what the renderer asks of a store (Store), and open_store, which makes
the one KILN_OUTPUT_URL names: a local directory (worker.files.local) or an S3-compatible bucket
(worker.files.s3). Each store satisfies Store by its shape, not by subclassing it.

Layout in both: <location>/<job id>/<n>.<ext>, preview.jpg and result.json. The crash invariant
holds in both: result.json is put last, so a result never points at an image that is not there,
and a job whose result.json exists is answered from the store instead of rendered again.

A job that does not finish leaves nothing behind: each store remembers every file it began to
write for a job (before the write, so a deadline landing mid-write is covered), a failed image or
result write removes them at once, and close_job removes them for any other way out (a timeout,
a stop, a failure after a preview). A finished job keeps all its files, its last preview too (the
uri its last preview event named). Failures that heal (S3 5xx, throttling, a refused or timed-out
connection, a network mount gone) raise StoreUnavailable, so the queue can run the job again
later; the rest raise StoreError (S3) or OutputError (a directory) and fail the job at once.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from PIL import Image

from api_client.schema import ImageFile, PreviewRef, RenderResult
from worker.files.local import LocalStore
from worker.files.output import EncodedImage
from worker.files.s3 import S3Store
from worker.settings import Settings


class Store(Protocol):
    """What the renderer needs from wherever files go."""

    location: str

    def save_images(self, job_id: str, images: list[EncodedImage]) -> list[ImageFile]: ...

    def save_preview(self, job_id: str, image: Image.Image) -> str: ...

    def preview_ref(self, uri: str) -> PreviewRef: ...

    def write_result(self, result: RenderResult) -> None: ...

    def finished_result(self, job_id: str, request_digest: str) -> RenderResult | None: ...

    def close_job(self, job_id: str, *, keep: bool) -> None:
        """The job's render is over: keep its files (it finished) or remove every file this
        store began to write for it (any other way out). Never raises."""


_stores: dict[tuple[Any, ...], Store] = {}
_stores_lock = threading.Lock()


def open_store(settings: Settings) -> Store:
    """The store the settings name, made once per distinct configuration and then reused;
    StoreError when KILN_OUTPUT_URL is s3:// without a bucket."""
    location = settings.store_location
    secret = settings.aws_secret_access_key
    key = (
        location,
        settings.url_expires_s,
        settings.aws_endpoint_url,
        settings.aws_region,
        settings.aws_access_key_id,
        secret.get_secret_value() if secret is not None else None,
    )
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            if location.startswith("s3://"):
                store = S3Store(location, settings)
            else:
                path = urlparse(location).path if location.startswith("file://") else location
                store = LocalStore(Path(path))
            _stores[key] = store
        return store
