"""A worker's start, phase by phase, from the creation of its process to ready for a job: the
`startup_s` of its `worker_started` record (and of bench/coldstart.py's rows)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# In the order a start runs them (cli, then serve): interpreter (Python and kiln's command line
# up to the verb), settings, manifests, redis (connect and ping), weights (the check, and a pull
# when some are missing), imports (torch, diffusers, the served families' pipeline classes),
# device (the probe), setup (queues, renderer, worker), then prewarm (--prewarm's renders, of
# which load and compile are also given on their own).
PHASES = (
    "interpreter",
    "settings",
    "manifests",
    "redis",
    "weights",
    "imports",
    "device",
    "setup",
    "prewarm",
)


@dataclass
class StartClock:
    """Laps on the wall clock (a process's creation time is only known as one) from `since`."""

    since: float
    last: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    within_prewarm: dict[str, float] = field(default_factory=lambda: {"load": 0.0, "compile": 0.0})

    def __post_init__(self) -> None:
        self.last = self.last or self.since

    @classmethod
    def from_process_start(cls) -> StartClock:
        """From when this process was created (psutil), else from now."""
        try:
            import psutil

            return cls(psutil.Process().create_time())
        except Exception:  # no psutil, or a platform it cannot read: the laps still hold
            return cls(time.time())

    def lap(self, phase: str) -> None:
        """The seconds since the last lap are phase's."""
        if phase not in PHASES:
            raise ValueError(f"start phase {phase!r}: must be one of {', '.join(PHASES)}")
        now = time.time()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self.last, 3)
        self.last = now

    def prewarmed(self, load_s: float, compile_s: float) -> None:
        """A prewarm job's load and compile, part of the prewarm phase."""
        self.within_prewarm["load"] += load_s
        self.within_prewarm["compile"] += compile_s

    def report(self) -> dict[str, float]:
        """Each phase in order (0 for one not run), the prewarm's load and compile, and ready:
        seconds from the process's creation to now."""
        laps = {phase: self.phases.get(phase, 0.0) for phase in PHASES}
        parts = {f"prewarm_{k}": round(v, 3) for k, v in self.within_prewarm.items()}
        return {**laps, **parts, "ready": round(time.time() - self.since, 3)}
