"""The type of every Redis key a worker reads or writes, so that a key a client overwrote with
another type (anyone with the kiln-client ACL can SET a queue or a job's event stream to a
string) is moved aside by quarantine.repair_types instead of stopping the worker for good."""

from __future__ import annotations

from api_client import keys

_REGISTRIES = ("wip", "finished", "failed", "deferred", "scheduled", "canceled")


def shared(queue_names: list[str], worker_key: str) -> dict[str, str]:
    """Keys every worker of these queues uses: queues, registries, published state."""
    expected = {
        keys.MANIFESTS_KEY: "hash",
        keys.FITS_KEY: "hash",
        keys.WORKERS_KEY: "zset",
        keys.WEBHOOK_TARGETS_KEY: "set",
        keys.STORES_KEY: "set",
        keys.QUARANTINE_KEY: "hash",
        keys.QUARANTINE_ORDER_KEY: "zset",
        "rq:queues": "set",
        "rq:workers": "set",
        worker_key: "hash",
    }
    for name in queue_names:
        expected[f"rq:queue:{name}"] = "list"
        expected[f"rq:queue:{name}:intermediate"] = "list"
        expected[f"rq:workers:{name}"] = "set"
        expected[keys.queue_events_key(keys.model_of(name))] = "stream"
        for registry in _REGISTRIES:
            expected[f"rq:{registry}:{name}"] = "zset"
    return expected


def of_job(job_id: str) -> dict[str, str]:
    """Keys of one job: its hash, event stream, RQ results stream and dependents."""
    return {
        f"rq:job:{job_id}": "hash",
        keys.events_key(job_id): "stream",
        f"rq:results:{job_id}": "stream",
        f"rq:job:{job_id}:dependents": "set",
    }
