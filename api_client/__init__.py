"""kiln's client: submit render jobs to kiln workers through Redis. Never imports torch."""

from api_client.client import KilnClient, ModelInfo
from api_client.errors import (
    JobTimeout,
    KilnError,
    Problem,
    RenderFailed,
    RequestRejected,
    UnknownJob,
)
from api_client.fetch import FetchFailed
from api_client.job import KilnJob
from api_client.manifest import Manifest, ManifestInvalid
from api_client.schema import (
    ImageFile,
    JobEvent,
    Progress,
    RenderRequest,
    RenderResult,
    TimingFit,
    WorkerState,
)
from api_client.webhooks import WebhookInvalid, verify_webhook

__all__ = [
    "FetchFailed",
    "ImageFile",
    "JobEvent",
    "JobTimeout",
    "KilnClient",
    "KilnError",
    "KilnJob",
    "Manifest",
    "ManifestInvalid",
    "ModelInfo",
    "Problem",
    "Progress",
    "RenderFailed",
    "RenderRequest",
    "RenderResult",
    "RequestRejected",
    "TimingFit",
    "UnknownJob",
    "WebhookInvalid",
    "WorkerState",
    "verify_webhook",
]
