"""Cancel: a queued job is removed before any worker sees it; a running job stops at its next
denoise step with status stopped and is not retried. Progress comes from the worker alone."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from api_client import KilnClient, Progress, RenderFailed, keys
from tests.fixtures.gate import hold_here
from tests.support.inprocess import burst, make_renderer
from tests.support.records import records
from tests.workers import SLOW_MODEL, slow_manifests, wait_until


@pytest.fixture
def slow_settings(make_settings: Any, tmp_path: Path) -> Any:
    return make_settings(manifests=slow_manifests(tmp_path / "manifests"))


def test_cancel_a_queued_job_removes_it(redis_conn: Redis, settings: Any) -> None:
    client = KilnClient(connection=redis_conn, manifests_dir=settings.manifests)
    doomed = client.submit({"model": "tiny-sd15", "prompt": "never", "steps": 2})
    kept = client.submit({"model": "tiny-sd15", "prompt": "kept", "steps": 2})
    assert doomed.cancel() == "queued"
    assert redis_conn.lrange("rq:queue:kiln:tiny-sd15", 0, -1) == [kept.id.encode()]
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    with pytest.raises(RenderFailed) as caught:
        doomed.wait(timeout=5)
    assert caught.value.status == "canceled"
    assert not (settings.output_dir / doomed.id).exists()
    assert [r.job_id for r in records(settings.timings_log)] == [kept.id]
    assert kept.wait(timeout=5).model == "tiny-sd15"


def test_cancel_a_running_job_stops_it_at_the_next_step_without_retry(
    redis_conn: Redis, slow_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = KilnClient(connection=redis_conn, manifests_dir=slow_settings.manifests)
    job = client.submit({"model": SLOW_MODEL, "prompt": "stop me", "steps": 40, "seed": 2})
    after = client.submit({"model": SLOW_MODEL, "prompt": "next", "steps": 2, "seed": 2})
    seen: list[Progress] = []
    cancelled_at: list[float] = []

    def cancel_when_denoising() -> None:
        def step() -> Progress | None:
            progress = job.progress()
            if progress is not None and (not seen or seen[-1] != progress):
                seen.append(progress)
            return (
                progress
                if progress and progress.phase == "denoise" and progress.step >= 2
                else None
            )

        wait_until(step, 120, "denoising to begin")
        assert job.cancel() == "started"
        cancelled_at.append(time.time())

    hold_here(monkeypatch, lambda step: bool(cancelled_at))  # the job is at step 2 until then
    canceller = threading.Thread(target=cancel_when_denoising)
    canceller.start()
    burst(redis_conn, make_renderer(slow_settings, [SLOW_MODEL]), [SLOW_MODEL])
    canceller.join()

    with pytest.raises(RenderFailed, match="stopped at step") as caught:
        job.wait(timeout=1)
    assert caught.value.status == "stopped"
    # At once, by RQ's stop-job command: not at the worker's next look at the stop key (10 s).
    [stopped] = [r for r in records(slow_settings.timings_log) if r.status == "stopped"]
    late_s = stopped.finished_at.timestamp() - cancelled_at[0]
    assert late_s < 1.0, late_s
    stopped_at = job.progress()
    assert stopped_at is not None and stopped_at.phase == "denoise" and stopped_at.step < 40
    # Stopped means stopped: not back on the queue despite the job's abandoned-retry budget.
    assert redis_conn.llen(f"rq:queue:{keys.queue_name(SLOW_MODEL)}") == 0
    assert redis_conn.hget(f"rq:job:{job.id}", "retries_left") == b"3"
    assert not (slow_settings.output_dir / job.id / "result.json").exists()
    # Progress only ever moved forward, in the worker's {phase, step, steps} shape.
    phases = [p.phase for p in seen]
    assert phases[-1] == "denoise" and all(p.steps == 40 for p in seen)
    steps = [p.step for p in seen if p.phase == "denoise"]
    assert steps == sorted(steps)
    assert [r.status for r in records(slow_settings.timings_log)] == ["stopped", "done"]
    assert after.wait(timeout=1).steps == 2
    # Its event stream ends the same way, with the worker's message.
    [*_, end] = job.events(timeout=5)
    assert end.kind == "stopped" and "stopped at step" in (end.error or "")
