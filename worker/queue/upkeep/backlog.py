"""What waits per model, as an operator reads it: the depth of its queue (LLEN) and the ETA of a
default job submitted now, from the published timing fits and the jobs ahead of it.

The ETA is api_client.eta's own (the one `job.eta()` gives a client), asked for a job that is
not in the queue yet, so it counts every job queued and running ahead of it, and reads only a
bounded amount (eta.AHEAD_READ jobs at most). Used by /metrics at scrape time and by `kiln top`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from api_client import keys
from api_client.eta import JobSummary, job_eta
from api_client.manifest import Manifest

if TYPE_CHECKING:
    from redis import Redis

# The id of the job that is not queued: LPOS does not find it, so it stands behind them all.
NEXT_JOB_ID = "kiln-next-default-job"


@dataclass(frozen=True)
class Backlog:
    model: str
    depth: int  # jobs waiting in the model's queues, both lanes
    eta_s: float | None  # a default job submitted now; None until its size has a measured fit


def default_request(manifest: Manifest) -> dict[str, int]:
    """The fields an ETA reads, at the manifest's defaults (what `kiln submit` sends unset)."""
    width, height = manifest.default_size
    return {"width": width, "height": height, "steps": manifest.steps.default, "num_images": 1}


def next_job_eta(connection: Redis, manifest: Manifest) -> float | None:
    """Seconds until a default job of this model, submitted now, would have its result; None
    for an upscaler (no default job: each is its image's size)."""
    if not manifest.resolutions:
        return None
    job = JobSummary(
        id=NEXT_JOB_ID,
        status="queued",
        origin=keys.queue_name(manifest.id),
        request=default_request(manifest),
        started_at=None,
    )
    return job_eta(connection, job)


def backlogs(
    connection: Redis, models: list[str], manifests: Mapping[str, Manifest]
) -> list[Backlog]:
    """Depth and next-job ETA of each model's queue: one LLEN round trip, then one ETA for each
    model with a manifest (None without one)."""
    with connection.pipeline(transaction=False) as pipe:
        for model in models:
            for queue in keys.lane_queues(model):  # interactive and batch (worker/queue/lanes.py)
                pipe.llen(keys.rq_queue_key(queue))
        found = iter(pipe.execute())
    depths = [sum(next(found) for _ in keys.LANES) for _ in models]
    return [
        Backlog(
            model,
            int(depth),
            next_job_eta(connection, manifests[model]) if model in manifests else None,
        )
        for model, depth in zip(models, depths, strict=True)
    ]
