"""The short chaos run (bench/chaos.py): tens of jobs over two real workers and their own Redis
under SIGKILL, SIGSTOP past a lease, Redis restarts and receiver outages, with a fixed seed.
Nothing may be lost, rendered twice, or end without its webhook."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

JOBS, FAULTS, SEED = 20, 6, 28
LINE = re.compile(
    r"jobs=(?P<jobs>\d+) finished=(?P<finished>\d+) failed=(?P<failed>\d+) lost=(?P<lost>\d+)"
    r" twice=(?P<twice>\d+) webhooks_missing=(?P<webhooks_missing>\d+)"
    r" webhooks_duplicated=(?P<webhooks_duplicated>\d+)"
)


@pytest.mark.slow  # 50 s of kill drills: make test keeps under 12 minutes; CI runs it
def test_a_short_chaos_run_loses_nothing_and_renders_nothing_twice(tiny_dir: Path) -> None:
    argv = [sys.executable, str(ROOT / "bench" / "chaos.py"), "--jobs", str(JOBS)]
    argv += ["--faults", str(FAULTS), "--seed", str(SEED), "--seconds", "20"]
    argv += ["--models-dir", str(tiny_dir), "--deadline-s", "90", "--verbose"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400)
    print(done.stdout)  # the schedule as it ran and the summary, for `pytest -s`
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-4000:]
    match = LINE.fullmatch(lines[-1])
    assert match, f"last line is not the chaos line:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    counts = {name: int(value) for name, value in match.groupdict().items()}
    report = done.stdout[-4000:] + done.stderr[-2000:]
    assert counts["jobs"] == JOBS, report
    assert (counts["lost"], counts["twice"], counts["webhooks_missing"]) == (0, 0, 0), report
    assert counts["finished"] + counts["failed"] == JOBS, report
    assert done.returncode == 0, report
