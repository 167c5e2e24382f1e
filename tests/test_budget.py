"""The Redis budget of a job, counted by Redis itself (INFO commandstats) with a real worker and
client: at most 30 commands a job in fixed cost (submit, start, end, the client's wait), plus at
most 3 a second while it renders (heartbeats, progress events and the client reading them),
beside the worker's own sweep for lapsed leases, which runs whether it renders or not: one
script every 5 s reading two registries per lane it listens to (1 a second for one model's two
lanes; the priority lanes doubled it, and a 10 s window read 3.15-3.19 a second in all). The
fixed cost is what ten more jobs add, less what runs by the clock over the seconds those jobs
took (the sweep, the lease pushes, the state beat, the memory gate's read of the measured
peaks): a loaded machine stretches them without adding a command a job. Left in, on a machine
whose other tests made ten 2-step jobs take 50 s, they read as 33.2 commands a job (32.5 in the
issue that asked for this count), against 28-29 by the job."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from redis import Redis

from api_client import keys
from tests.support.inprocess import burst, client_for, make_renderer
from tests.workers import pace_here
from worker.memory.peaks import REREAD_S
from worker.queue.upkeep.publisher import STATE_INTERVAL_S

REQUEST = {"model": "tiny-sd15", "prompt": "budget", "steps": 2}


def counted(conn: Redis, run: Any) -> int:
    conn.config_resetstat()
    run()
    stats = conn.info("commandstats")
    return sum(s["calls"] for name, s in stats.items() if name != "cmdstat_info")


@pytest.mark.serial
def test_a_job_costs_at_most_30_commands_and_3_a_second_while_rendering(
    redis_conn: Redis, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = client_for(redis_conn, settings)
    renderer = make_renderer(settings, ["tiny-sd15"])
    client.submit(REQUEST)  # load outside the measurement
    idle = burst(redis_conn, renderer, ["tiny-sd15"])
    # The state beat's commands (the worker's state, RQ's worker hash), every STATE_INTERVAL_S.
    state = counted(redis_conn, idle.publish_state) / STATE_INTERVAL_S
    idle.publisher.withdraw()  # that beat published it again: gone, as after its burst

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

    def timed(run: Any) -> tuple[int, float, float]:
        """Commands, wall seconds and seconds rendered of one burst."""
        started, rendered = time.monotonic(), []
        commands = counted(redis_conn, lambda: rendered.append(run()))
        return commands, time.monotonic() - started, rendered[0]

    queues = len(keys.LANES)  # the worker of one model listens to its two lanes
    sweep = (1 + 2 * queues) / settings.sweep_s  # execution.ANY_DUE, one EVALSHA
    one, one_wall, one_rendered = timed(lambda: jobs(1, 2))
    many, many_wall, many_rendered = timed(lambda: jobs(11, 2))
    # What runs by the clock, not by the job, is the budget's other two terms: the sweep beside
    # every worker, and a lease push every heartbeat interval while a job renders. A loaded
    # machine stretches the ten extra jobs' seconds; charged by the clock, those commands are
    # not the jobs' fixed cost (the per-second check below bounds them).
    clocked = (
        (sweep + state + 1 / REREAD_S) * (many_wall - one_wall)  # REREAD_S: one HSCAN
        + (many_rendered - one_rendered) / settings.heartbeat_s
    )
    fixed = (many - one - clocked) / 10
    # One job in flight, about 10 s long (40 steps paced to 0.25 s): heartbeats, progress, the
    # client reading it, against one 2-step job. Long enough that where the worker's 5 s sweep
    # falls (two commands, once or twice in the window) moves the rate by 0.2 a second at most:
    # a 6 s window read 2.3-3.2 a second on the same code.
    pace_here(monkeypatch, 0.25)
    short: list[float] = []
    one_live = counted(redis_conn, lambda: short.append(jobs(1, 2, live=True)))
    seconds: list[float] = []
    long = counted(redis_conn, lambda: seconds.append(jobs(1, 40, live=True)))
    per_second = (long - one_live) / (seconds[0] - short[0])
    print(
        f"\n{fixed:.1f} commands a job in fixed cost ({clocked:.1f} by the clock left out of"
        f" {many - one}); {per_second:.2f} a second while rendering,"
        f" {sweep:.2f} of them the sweep's"
    )
    assert fixed <= 30, (fixed, many, one, many_wall, one_wall)
    assert per_second <= 3 + sweep, (long, one_live, seconds, short)
