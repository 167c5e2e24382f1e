"""The memory gate before each pop: a worker takes no job while no served model's measured need
fits its memory (Renderer.cannot_fit), since it would take a job only to fail it. Why it waits
is published in its state (`blocked`, shown by `kiln models`) and in kiln_waiting_for_memory."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from worker.queue.upkeep import metrics

log = logging.getLogger(__name__)
MEMORY_POLL_S = 1.0  # how often a worker waiting for memory looks again


class MemoryGate:
    """Whether one worker may take a job now, and why not (`blocked`)."""

    def __init__(self, worker_name: str, cannot_fit: Callable[[], str | None]) -> None:
        self.worker_name = worker_name
        self.cannot_fit = cannot_fit  # why no served model fits now; None when one does
        self.blocked: str | None = None  # why no job is taken now, published with the state

    def wait(
        self,
        *,
        burst: bool,
        stopping: Callable[[], bool],
        changed: Callable[[], None],
        meanwhile: Callable[[], None],
    ) -> bool:
        """Wait until a served model fits, looking again every MEMORY_POLL_S; False (take
        nothing) for a burst worker or one that is stopping. changed publishes the worker's
        state as it starts and stops waiting; meanwhile runs between looks (the worker's
        maintenance: sweeps go on, for other workers' jobs)."""
        while (why := self.cannot_fit()) is not None:
            if self.blocked is None:
                log.warning("%s: %s", self.worker_name, why)
                self.blocked = why
                metrics.WAITING_FOR_MEMORY.set(1)
                changed()
            self.blocked = why  # the Pulse thread publishes it with the latest figures
            if burst or stopping():
                return False
            time.sleep(MEMORY_POLL_S)
            meanwhile()
        if self.blocked is not None:
            log.info("%s: memory fits again; taking jobs", self.worker_name)
            self.blocked = None
            metrics.WAITING_FOR_MEMORY.set(0)
            changed()
        return True
