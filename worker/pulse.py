"""The worker's side thread: keeps the running job's heartbeat fresh, publishes the worker's
state, and hands jobs whose worker died back to their queue."""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class Beating(Protocol):
    name: str
    heartbeat_interval_s: float
    sweep_interval_s: float
    state_interval_s: float

    def maintain_running_job(self, look_for_stop: bool = True) -> bool: ...

    def publish_state(self) -> None: ...

    def recover_abandoned(self) -> None: ...


class Pulse(threading.Thread):
    """Beside the render: every heartbeat_interval_s the running job's heartbeat, every
    sweep_interval_s a look for abandoned jobs, every state_interval_s the worker's state and a
    look for a cancel of the running job that did not arrive over pub/sub.

    SimpleWorker only heartbeats between jobs; a render that outlives the heartbeat TTL would look
    abandoned, and a TTL long enough to cover any render would leave a killed worker's job stuck
    for that long. Every Redis call here goes through the worker's pool, which is thread-safe.
    """

    def __init__(self, worker: Beating) -> None:
        super().__init__(name=f"kiln-pulse-{worker.name}", daemon=True)
        self.worker = worker
        self.stopping = threading.Event()
        self._state_at = time.monotonic()  # the worker publishes its state as it starts
        self._swept_at = float("-inf")

    def run(self) -> None:
        while not self.stopping.wait(self.worker.heartbeat_interval_s):
            self.beat()

    def beat(self) -> None:
        try:
            state_due = time.monotonic() - self._state_at >= self.worker.state_interval_s
            fresh = self.worker.maintain_running_job(look_for_stop=state_due)
            if state_due:
                self._state_at = time.monotonic()
                self.worker.publish_state()
            # Only sweep after our own heartbeat landed: after a Redis outage our own job's entry
            # may have lapsed, and it must not be mistaken for an abandoned one.
            if fresh and time.monotonic() - self._swept_at >= self.worker.sweep_interval_s:
                self._swept_at = time.monotonic()
                self.worker.recover_abandoned()
        except REDIS_ERRORS as exc:
            log.warning(
                "pulse: Redis unavailable (%s); retrying in %.0f s",
                exc,
                self.worker.heartbeat_interval_s,
            )
        except Exception:
            log.exception("pulse: unexpected error; carrying on")

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)
