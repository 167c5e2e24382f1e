"""The worker process on RQ. Here, a job's path: worker (the loop and a job's five steps),
memory_gate, lanes, claim, lease, job, execution, events, and build (the worker from its parts);
in upkeep/, what runs by the clock or out of band beside it (pulse, sweep, repair, keytypes,
quarantine, publisher, webhooks, metrics, backlog).

`worker.queue.render_job` is the function every kiln job names (api_client.schema.RENDER_FUNC),
so queued records and RQ's readers keep resolving it. A kiln worker never calls it: RenderJob
runs the worker's own render (worker/queue/worker.py). A plain RQ worker that picks a kiln job
up calls it and fails the job with the reason, instead of rendering without a resident pipeline.
"""

from __future__ import annotations

from typing import Any


def render_job(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "kiln jobs run only under `kiln worker`: a plain RQ worker has no resident pipeline "
        "and no lease (start `kiln worker --models ...` on the queue instead)"
    )
