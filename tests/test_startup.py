"""A worker's start record (`worker_started`'s startup_s, worker/startup.py): every phase from
the process's creation, summing to its ready, with a prewarm's load and compile given apart."""

from __future__ import annotations

import json
import time

import pytest
from redis import Redis

from tests.conftest import kiln
from worker.startup import PHASES, StartClock


@pytest.mark.slow  # a real worker start, timed phase by phase
def test_a_real_start_accounts_for_its_seconds_phase_by_phase(
    redis_conn: Redis, kiln_env: dict[str, str]
) -> None:
    launched = time.time()
    done = kiln(
        "worker", "--burst", "--prewarm", "--models", "tiny-sd15", env=kiln_env, timeout=300
    )
    took = time.time() - launched
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    [started] = [line["startup_s"] for line in lines if line.get("event") == "worker_started"]
    assert list(started) == [*PHASES, "prewarm_load", "prewarm_compile", "ready"]
    assert all(started[phase] >= 0 for phase in PHASES)
    # Python and the command line run before kiln's first lap; torch comes after Redis.
    assert started["interpreter"] > 0 and started["imports"] > started["redis"]
    assert started["prewarm"] > started["prewarm_load"] > 0  # the model was read for it
    assert started["prewarm_compile"] == 0  # KILN_COMPILE=auto is off on a CPU
    laps = sum(started[phase] for phase in PHASES)
    assert laps - 0.01 <= started["ready"] <= laps + 0.5, started  # the laps leave nothing out
    # The interpreter's lap starts at the process's creation time, which Linux gives psutil as
    # boot time (whole seconds, /proc/stat btime) plus ticks: up to a second off either way.
    assert started["ready"] < took + 1.0


def test_a_lap_must_name_a_phase() -> None:
    clock = StartClock(time.time())
    with pytest.raises(ValueError, match="start phase 'warmup': must be one of interpreter, "):
        clock.lap("warmup")
    clock.lap("settings")
    clock.lap("settings")  # a phase run twice adds up
    report = clock.report()
    assert report["settings"] >= 0 and report["interpreter"] == 0
