"""Redis names shared by client and worker: two queues per model (its interactive and batch
lanes) and the published state; and the few of RQ's names the client reads or writes itself
(tests/test_client_import.py checks them against rq's own), so `import api_client` need not
load rq."""

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
# set: each worker's store (KILN_OUTPUT_URL: s3://bucket/prefix, or its directory's absolute
# path), so a client refuses an input uri outside every store before it enqueues
STORES_KEY = "kiln:stores"
QUARANTINE_KEY = "kiln:quarantine"  # hash: job id -> JSON {reason, at, queue, fields}, bounded
QUARANTINE_ORDER_KEY = "kiln:quarantine:order"  # sorted set: job id -> unix time quarantined
INPUT_KEY_PREFIX = "kiln:input:"  # string with TTL: an uploaded input image's bytes, by sha256

RQ_JOB_PREFIX = "rq:job:"  # hash: one job's record (Job.key)
RQ_QUEUE_PREFIX = "rq:queue:"  # list: queued job ids, taken from the left (Queue.key)
RQ_STARTED_PREFIX = "rq:wip:"  # sorted set: "<job id>:<execution>" -> heartbeat expiry
RQ_CANCELED_PREFIX = "rq:canceled:"  # sorted set: job id -> expiry (CanceledJobRegistry)
RQ_DEFERRED_PREFIX = "rq:deferred:"
RQ_SCHEDULED_PREFIX = "rq:scheduled:"


LANES = ("interactive", "batch")  # a request's priority; interactive is the default
# Workers take interactive jobs first, but after BATCH_EVERY - 1 of them in a row they look at
# the batch lanes first (worker/queue/lanes.py); ETAs count the jobs ahead by the same rule.
BATCH_EVERY = 4
BATCH_SUFFIX = ":batch"  # model ids never hold a colon (their manifest's id pattern)


def queue_name(model_id: str, lane: str = "interactive") -> str:
    """A model's queue for one lane: kiln:<model id> (interactive), kiln:<model id>:batch."""
    if lane not in LANES:
        raise ValueError(f"lane {lane!r}: must be one of {', '.join(LANES)}")
    return f"{QUEUE_PREFIX}{model_id}{BATCH_SUFFIX if lane == 'batch' else ''}"


def lane_queues(model_id: str) -> list[str]:
    """Both lanes' queues of a model, interactive first: what lists, cleans or counts by queue."""
    return [queue_name(model_id, lane) for lane in LANES]


def model_of(queue: str) -> str:
    """The model a queue (a job's origin) belongs to, whichever its lane."""
    return queue.removeprefix(QUEUE_PREFIX).removesuffix(BATCH_SUFFIX)


def lane_of(queue: str) -> str:
    return "batch" if queue.endswith(BATCH_SUFFIX) else "interactive"


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
    """RQ's list of one queue (queue as in a job's origin: kiln:<model id>[:batch])."""
    return f"{RQ_QUEUE_PREFIX}{queue}"
