"""Keys a client overwrote with another type (a queue made a string, a job hash a list): the
worker's own keys and a job's are moved aside into the quarantine (upkeep/quarantine.py), and
the call that met one is sent once more. Shared by the worker's dequeue, its lease keeper, its
sweeper and its state publisher."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError

from worker.queue.upkeep import keytypes, quarantine


class KeyRepair:
    """The keys one worker expects (its queues, its RQ worker hash, a job's keys) and what to do
    when a client retyped one of them."""

    def __init__(self, connection: Redis, queue_names: list[str], worker_key: str) -> None:
        self.connection = connection
        self.queue_names = queue_names
        self.worker_key = worker_key

    def repair(self, job_id: str | None = None) -> list[str]:
        """Move aside this worker's keys (and job_id's) that a client overwrote with another
        type (worker/queue/upkeep/keytypes.py); the keys moved."""
        expected = keytypes.shared(self.queue_names, self.worker_key)
        if job_id is not None:
            expected |= keytypes.of_job(job_id)
        return quarantine.repair_types(self.connection, expected)

    def call(self, job_id: str | None, call: Callable[[], Any]) -> Any:
        """call(), and once more if it met a key of the wrong type that was then moved aside."""
        try:
            return call()
        except ResponseError as exc:
            if not quarantine.wrong_type(exc) or not self.repair(job_id):
                raise
        return call()
