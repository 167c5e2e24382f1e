"""`kiln top --once` against two running workers and their two queues: each worker named on one
line with its device, resident model and rung, the running job's phase and step, and jobs done;
each queue with its depth; the last jobs with their phases; nothing wrapped on a narrow terminal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from redis import Redis

from api_client import KilnClient, keys
from api_client.schema import PHASES, WorkerState
from tests.conftest import ROOT, kiln
from tests.fixtures.gate import Gate
from tests.workers import WorkerProcess, gated, wait_until


def published(conn: Redis, name: str) -> WorkerState | None:
    raw = conn.get(keys.worker_key(name))
    return WorkerState.model_validate_json(raw) if raw else None


@pytest.mark.slow  # two worker processes; the display's logic is tested without them
def test_top_once_shows_two_workers_and_two_queues(
    redis_conn: Redis, kiln_env: dict[str, str], tmp_path: Path
) -> None:
    # The sd15 worker's long job waits at a gate (never opened), mid-denoise when top looks.
    gate = Gate(tmp_path / "gate")
    slow = WorkerProcess(kiln_env, tmp_path / "a.log", "--models", "tiny-sd15", options=gated(gate))
    quick = WorkerProcess(kiln_env, tmp_path / "b.log", "--models", "tiny-sdxl")
    client = KilnClient(connection=redis_conn, manifests_dir=ROOT / "manifests")
    try:
        slow.wait_ready(redis_conn)
        quick.wait_ready(redis_conn)
        ended = [
            client.submit({"model": model, "prompt": "warm", "steps": 2})
            for model in ("tiny-sd15", "tiny-sdxl")
        ]
        for job in ended:
            job.wait(timeout=120)
        long = client.submit({"model": "tiny-sd15", "prompt": "long", "steps": 50})
        behind = client.submit({"model": "tiny-sd15", "prompt": "behind", "steps": 2})

        def running() -> bool:
            state = published(redis_conn, slow.name)
            progress = long.progress()
            held = progress is not None and progress.phase == "denoise" and gate.held()
            return bool(state and state.running == long.id and held)

        # The state is published every 10 s; the job's progress once a second.
        wait_until(running, 40, "the slow worker to publish its running job", poll=0.3)
        shown = kiln("top", "--once", env={**kiln_env, "COLUMNS": "40"}, check=True)
    finally:
        slow.stop()
        quick.stop()

    lines = shown.stdout.splitlines()
    assert lines[0].startswith("kiln top") and "2 workers, 2 queues" in lines[0], shown.stdout

    def line_of(*parts: str) -> str:
        found = [line for line in lines if all(part in line for part in parts)]
        assert len(found) == 1, f"{parts} on one line of:\n{shown.stdout}"
        return found[0]

    # Each worker on one line, however narrow the terminal: name, device, resident@rung, done.
    slow_line = line_of(slow.name, "(cpu)", "tiny-sd15@", long.id, "denoise")
    assert re.search(rf"{long.id} \(tiny-sd15\) denoise \d+/50", slow_line), slow_line
    quick_line = line_of(quick.name, "(cpu)", "tiny-sdxl@full", " GB")
    assert re.search(r"\s1\s", quick_line), quick_line  # one job done
    # Both queues, the sd15 one with the job waiting behind the long one.
    assert re.search(r"kiln:tiny-sd15\s+1\s", line_of("kiln:tiny-sd15 ", slow.name)), shown.stdout
    assert re.search(r"kiln:tiny-sdxl\s+0\s", line_of("kiln:tiny-sdxl ", quick.name))
    assert behind.id not in shown.stdout  # a queued job is counted, not listed
    # The last jobs: both warm-up jobs, done, with the worker that ran each and their phases.
    for job, worker in zip(ended, (slow, quick), strict=True):
        row = line_of(job.id, " done ", worker.name)
        assert len(re.findall(r"\b\d+\.\d\d\b", row)) == len(PHASES), row  # every phase, seconds


def test_top_reads_entries_that_do_not_parse_as_nothing(redis_conn: Redis) -> None:
    """Anyone who may write to Redis can put anything in a queue stream or the manifests hash:
    the view skips what does not parse instead of failing."""
    from api_client.manifest import load_manifest_file
    from worker.ops.top import render, snapshot

    manifest = load_manifest_file(ROOT / "manifests" / "tiny-sd15.yaml")
    redis_conn.hset(keys.MANIFESTS_KEY, mapping={"tiny-sd15": manifest.model_dump_json()})
    redis_conn.hset(keys.MANIFESTS_KEY, "broken", "{not json")
    redis_conn.xadd(keys.queue_events_key("tiny-sd15"), {"event": "garbage"})
    redis_conn.rpush(keys.rq_queue_key(keys.queue_name("tiny-sd15")), "queued-id")
    frame = snapshot(redis_conn)
    assert [(b.model, b.depth) for b, _ in frame.queues] == [("tiny-sd15", 1)]
    assert frame.ended == [] and frame.workers == []
    render(frame)
