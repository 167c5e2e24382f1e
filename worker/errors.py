"""Every exception the worker raises on purpose, in one place.

Two kinds matter to the worker loop. A job failure ends one job and the worker takes the next
(a refused payload, a request over its limits, a ladder out of rungs, a timeout). A fatal error
means this process can no longer render correctly (the device is lost or poisoned): the job in
hand fails with the reason, the worker exits non-zero and its supervisor starts a fresh one.
The client's errors (RequestRejected, RenderFailed, JobTimeout...) live in api_client.errors.
"""

from __future__ import annotations

from api_client.manifest import ManifestInvalid

# CUDA and HIP report a poisoned context as a RuntimeError (torch.AcceleratorError on newer
# torch, a RuntimeError subclass); after one of these every later kernel fails too.
_DEVICE_LOST_MARKERS = (
    "CUDA error",
    "HIP error",
    "device-side assert",
    "illegal memory access",
    "CUDA driver error",
    "unspecified launch failure",
)


class JobStopped(Exception):
    """A cancel was honoured at a step boundary; the job ends as stopped and is not retried."""


class ShutdownStop(JobStopped):
    """A second shutdown signal stopped the job at a step boundary; it is re-queued, not failed."""


class LeaseLost(JobStopped):
    """This worker no longer holds the job (its heartbeat lapsed during a stall and another
    worker took it over): the render stops and this worker writes nothing about the job."""


class JobDeadlineExceeded(BaseException):
    """The job ran past KILN_JOB_TIMEOUT_S. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way (a compile fallback, a preview, a quantization check) can
    swallow it and leave the job running unbounded, as RQ's Exception-based timeout would.
    (Not the client's JobTimeout, which means wait() gave up while the job goes on.)"""


class RefusedJob(Exception):
    """The job asks RQ for something other than kiln's render; nothing was run or imported."""


class OutOfMemory(RuntimeError):
    """The ladder ran out of rungs or retries; the message names model, rung and attempts."""


class CompileRequired(RuntimeError):
    """compile: required, the pipeline is fully resident, and torch.compile did not succeed."""


class PinRefused(RuntimeError):
    """The request pins a rung or a compile state (a replay does, so its pixels match) that this
    worker cannot give it; the message names the pin, the model and why. Never a silent
    descent or fallback: a replay on other settings would not reproduce its image."""


class CannotReplay(Exception):
    """An image cannot be rendered again: it carries no kiln generation details, or ones that do
    not parse; the message names the file and what is missing or wrong."""


class OutputError(RuntimeError):
    """The output directory cannot take the job's files (missing permission, full disk...)."""


class OtherRequest(OutputError):
    """A job id's stored result was rendered from a different request; never answer with it,
    never render over it."""


class InvalidFaults(ValueError):
    """KILN_FAULTS does not parse; the message shows the grammar."""


class FatalWorkerError(Exception):
    """This worker cannot go on (its device is lost): fail the job, exit, let a supervisor
    restart the process. Never raised for something one job did wrong."""


class ManifestDirectoryInvalid(FatalWorkerError):
    """One or more manifests are broken; a worker will not start on them."""

    def __init__(self, failures: list[ManifestInvalid]) -> None:
        self.failures = failures
        super().__init__("\n".join(str(f) for f in failures))


def device_lost(exc: BaseException) -> bool:
    """Whether exc says the accelerator context is gone, so no later job could succeed here."""
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_LOST_MARKERS)


class StoreUnavailable(OutputError):
    """The store failed in a way that heals: S3 5xx or throttling (SlowDown), a refused, reset or
    timed-out connection, a network mount that went away. The job can go back on its queue and
    run again later instead of failing for good; its files were removed. str() names the job's
    key or path and the store's words; `cause` is the store's words alone, for the failure once
    the retries are spent. (A sibling of StoreError, not a subclass: the local directory's
    outages are OutputErrors too.)"""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class StoreError(OutputError):
    """The S3 store cannot take or give a job's files, or KILN_OUTPUT_URL names no bucket; the
    message names endpoint, bucket and key (never a credential). Raised by worker.files.s3."""
