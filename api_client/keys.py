"""Redis names shared by client and worker: one queue per model, and the published state; and
the few of RQ's names the client reads or writes itself (tests/test_client_import.py checks them
against rq's own), so `import api_client` need not load rq."""

from __future__ import annotations

QUEUE_PREFIX = "kiln:"
MANIFESTS_KEY = "kiln:manifests"  # hash: model id -> manifest JSON
FITS_KEY = "kiln:fits"  # hash: "<model>:<w>x<h>" -> timing fit JSON
WORKERS_KEY = "kiln:workers"  # sorted set: worker name -> last heartbeat (unix s)
WORKER_KEY_PREFIX = "kiln:worker:"  # string with TTL: worker name -> state JSON
STOP_KEY_PREFIX = "kiln:stop:"  # string with TTL: job id -> "1" when a cancel was asked
EVENTS_KEY_PREFIX = "kiln:events:"  # stream with TTL, capped: one job's life as JobEvents
QUEUE_EVENTS_KEY_PREFIX = "kiln:queue-events:"  # stream, trimmed by age: one model's job events
WEBHOOK_TARGETS_KEY = "kiln:webhook-targets"  # set: target names in workers' KILN_WEBHOOKS
QUARANTINE_KEY = "kiln:quarantine"  # hash: job id -> JSON {reason, at, queue, fields}, bounded
QUARANTINE_ORDER_KEY = "kiln:quarantine:order"  # sorted set: job id -> unix time quarantined
INPUT_KEY_PREFIX = "kiln:input:"  # string with TTL: an uploaded input image's bytes, by sha256

RQ_JOB_PREFIX = "rq:job:"  # hash: one job's record (Job.key)
RQ_QUEUE_PREFIX = "rq:queue:"  # list: queued job ids, taken from the left (Queue.key)
RQ_STARTED_PREFIX = "rq:wip:"  # sorted set: "<job id>:<execution>" -> heartbeat expiry
RQ_CANCELED_PREFIX = "rq:canceled:"  # sorted set: job id -> expiry (CanceledJobRegistry)
RQ_DEFERRED_PREFIX = "rq:deferred:"
RQ_SCHEDULED_PREFIX = "rq:scheduled:"


def queue_name(model_id: str) -> str:
    return f"{QUEUE_PREFIX}{model_id}"


def stop_key(job_id: str) -> str:
    return f"{STOP_KEY_PREFIX}{job_id}"


def worker_key(name: str) -> str:
    return f"{WORKER_KEY_PREFIX}{name}"


def fit_field(model_id: str, width: int, height: int) -> str:
    return f"{model_id}:{width}x{height}"


def events_key(job_id: str) -> str:
    return f"{EVENTS_KEY_PREFIX}{job_id}"


def queue_events_key(model_id: str) -> str:
    return f"{QUEUE_EVENTS_KEY_PREFIX}{model_id}"


def input_key(sha256: str) -> str:
    """Where client.upload() keeps an input image: the key of `kiln-input:<sha256>`."""
    return f"{INPUT_KEY_PREFIX}{sha256}"


def rq_job_key(job_id: str) -> str:
    return f"{RQ_JOB_PREFIX}{job_id}"


def rq_queue_key(queue: str) -> str:
    """RQ's list of one queue (queue as in a job's origin: kiln:<model id>)."""
    return f"{RQ_QUEUE_PREFIX}{queue}"
