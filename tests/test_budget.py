"""The Redis budget of a job, counted by Redis itself (INFO commandstats) with a real worker and
client: at most 30 commands a job in fixed cost (submit, start, end, the client's wait), plus at
most 3 a second while it renders (heartbeats, progress events and the client reading them)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from redis import Redis

from tests.helpers import burst, client_for, make_renderer
from tests.workers import pace_here

REQUEST = {"model": "tiny-sd15", "prompt": "budget", "steps": 2}


def counted(conn: Redis, run: Any) -> int:
    conn.config_resetstat()
    run()
    stats = conn.info("commandstats")
    return sum(s["calls"] for name, s in stats.items() if name != "cmdstat_info")


def test_a_job_costs_at_most_30_commands_and_3_a_second_while_rendering(
    redis_conn: Redis, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = client_for(redis_conn, settings)
    renderer = make_renderer(settings, ["tiny-sd15"])
    client.submit(REQUEST)  # load outside the measurement
    burst(redis_conn, renderer, ["tiny-sd15"])

    def jobs(count: int, steps: int, live: bool = False) -> float:
        """Submit and work in a burst; live: the client waits while it renders, as a backend
        would, reading every event. Seconds rendered."""
        submitted = [client.submit({**REQUEST, "steps": steps, "seed": n}) for n in range(count)]
        waiting = [threading.Thread(target=job.wait, kwargs={"timeout": 120}) for job in submitted]
        for thread in waiting if live else []:
            thread.start()
        burst(redis_conn, renderer, ["tiny-sd15"])
        for thread in waiting if live else []:
            thread.join()
        return sum(job.wait(timeout=1).timings.total for job in submitted)

    one = counted(redis_conn, lambda: jobs(1, 2))
    fixed = (counted(redis_conn, lambda: jobs(11, 2)) - one) / 10
    # One job in flight, about 6 s long (20 steps paced to 0.3 s): heartbeats, progress, the
    # client reading it, against one 2-step job.
    pace_here(monkeypatch, 0.3)
    short: list[float] = []
    one_live = counted(redis_conn, lambda: short.append(jobs(1, 2, live=True)))
    seconds: list[float] = []
    long = counted(redis_conn, lambda: seconds.append(jobs(1, 20, live=True)))
    per_second = (long - one_live) / (seconds[0] - short[0])
    print(f"\n{fixed:.1f} commands a job in fixed cost; {per_second:.2f} a second while rendering")
    assert fixed <= 30, fixed
    assert per_second <= 3, (long, one_live, seconds, short)
