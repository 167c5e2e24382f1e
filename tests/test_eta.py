"""ETAs: the workers' least-squares timing fits, and job.eta() counting the jobs ahead: read-only
(no RQ clean-up, nothing a record names imported) and bounded (AHEAD_READ jobs read at most)."""

from __future__ import annotations

import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from api_client import keys
from api_client.eta import AHEAD_READ
from api_client.schema import Attempt, TimingFit, Timings
from tests.support.inprocess import burst, client_for, make_renderer
from worker.manifest import load_manifests, publish_manifests
from worker.render.timings import FitTracker, TimingRecord

MODEL = "tiny-sd15"
QUEUE = keys.queue_name(MODEL)
CANARY = "tests.fixtures.raises_on_import"  # writes KILN_TEST_IMPORT_MARKER, then raises


def _record(steps: int, total: float, rung: str = "full", images: int = 1) -> TimingRecord:
    return TimingRecord(
        job_id=f"j{steps}-{total}",
        model=MODEL,
        status="done",
        steps=steps,
        width=128,
        height=128,
        num_images=images,
        rung=rung,
        attempts=[Attempt(rung=rung, outcome="ok")],
        timings=Timings(denoise=total - 0.1 * images, total=total),
    )


def test_fit_is_least_squares_over_step_counts_and_restarts_on_a_new_rung() -> None:
    tracker = FitTracker()
    for steps in (4, 8, 16, 8):
        key = tracker.add(_record(steps, 0.05 + 0.02 * steps))
    assert key is not None
    fit = tracker.fit(key)
    assert fit.fixed_s == pytest.approx(0.05) and fit.per_step_s == pytest.approx(0.02)
    assert fit.samples == 4 and fit.rung == "full"
    # One step count: no line to fit, so the split comes from the phases (0.1 s outside denoise).
    tracker.add(_record(8, 0.3, rung="model_offload"))
    fit = tracker.fit(key)
    assert fit.samples == 1 and fit.rung == "model_offload"
    assert fit.fixed_s == pytest.approx(0.1) and fit.per_step_s == pytest.approx(0.2 / 8)


def test_a_job_answered_from_the_store_is_counted_once_in_metrics() -> None:
    from prometheus_client import REGISTRY

    from worker.queue.upkeep.metrics import observe

    labels = {"model": MODEL}
    before = REGISTRY.get_sample_value("kiln_jobs_answered_from_store_total", labels) or 0.0
    observe(_record(8, 0.3).model_copy(update={"answered_from": "store"}))
    observe(_record(8, 0.3))
    after = REGISTRY.get_sample_value("kiln_jobs_answered_from_store_total", labels)
    assert after == before + 1


@pytest.mark.slow  # renders to fit, then a queue to count (~20 s): make test-slow, which CI runs
def test_job_eta_counts_the_jobs_ahead_with_their_fits(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    for steps in (2, 2, 6, 4, 6):  # the first is cold and not fitted
        client.submit({"model": MODEL, "prompt": "fit", "steps": steps, "seed": steps})
    renderer = make_renderer(settings, [MODEL])
    burst(redis_conn, renderer, [MODEL])
    [info] = [i for i in client.models() if i.manifest.id == MODEL]
    fit = info.fits[(128, 128)]
    assert fit.samples == 4 and fit.per_step_s > 0

    first = client.submit({"model": MODEL, "prompt": "a", "steps": 4})
    client.submit({"model": MODEL, "prompt": "b", "steps": 8, "num_images": 2})
    third = client.submit({"model": MODEL, "prompt": "c", "steps": 2})
    assert first.eta() == pytest.approx(fit.eta(4))
    assert third.eta() == pytest.approx(fit.eta(4) + fit.eta(8, 2) + fit.eta(2))
    unfitted = client.submit({"model": MODEL, "prompt": "d", "width": 192, "height": 128})
    assert unfitted.eta() is None  # no job of that size has run yet

    burst(redis_conn, renderer, [MODEL])
    assert third.eta() == 0.0


def _publish(conn: Redis, settings: Any) -> TimingFit:
    """The model's manifest and a measured fit at 128x128, as a worker would have published."""
    publish_manifests(conn, load_manifests(settings.manifests, [MODEL]))
    fit = TimingFit(fixed_s=0.2, per_step_s=0.05, samples=4, rung="full")
    conn.hset(keys.FITS_KEY, keys.fit_field(MODEL, 128, 128), fit.model_dump_json())
    return fit


def test_eta_runs_no_rq_clean_up_and_imports_nothing_a_record_names(
    redis_conn: Redis, settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imported"
    monkeypatch.setenv("KILN_TEST_IMPORT_MARKER", str(marker))
    fit = _publish(redis_conn, settings)
    client = client_for(redis_conn, settings)
    abandoned = client.submit({"model": MODEL, "prompt": "a", "steps": 4, "seed": 1})
    waiting = client.submit({"model": MODEL, "prompt": "b", "steps": 4, "seed": 2})
    # `abandoned` as a dead worker leaves a job: taken, started, its heartbeat lapsed a minute
    # ago, retries left (RQ's clean-up would re-queue it), and naming a failure callback.
    redis_conn.lrem(keys.rq_queue_key(QUEUE), 0, abandoned.id)
    redis_conn.hset(
        keys.rq_job_key(abandoned.id),
        mapping={
            "status": "started",
            "started_at": utcformat(datetime.now(timezone.utc) - timedelta(seconds=61)),
            "failure_callback_name": f"{CANARY}.callback",
        },
    )
    started = keys.RQ_STARTED_PREFIX + QUEUE
    entry, lapsed = f"{abandoned.id}:dead-execution", time.time() - 60
    redis_conn.zadd(started, {entry: lapsed})
    # And one a live worker runs, half done.
    running = client.submit({"model": MODEL, "prompt": "c", "steps": 12, "seed": 3})
    redis_conn.lrem(keys.rq_queue_key(QUEUE), 0, running.id)
    half = timedelta(seconds=fit.eta(12) / 2)
    redis_conn.hset(
        keys.rq_job_key(running.id),
        mapping={"status": "started", "started_at": utcformat(datetime.now(timezone.utc) - half)},
    )
    redis_conn.zadd(started, {f"{running.id}:live-execution": time.time() + 10})

    # The lapsed run is not counted; the live one is, by what is left of it. A started job's
    # own ETA is what is left of its fit.
    assert waiting.eta() == pytest.approx(fit.eta(4) + fit.eta(12) / 2, abs=0.1)
    assert abandoned.eta() == 0.0  # started 61 s ago, expected to take 0.4 s
    assert redis_conn.zscore(started, entry) == pytest.approx(lapsed)
    assert redis_conn.lrange(keys.rq_queue_key(QUEUE), 0, -1) == [waiting.id.encode()]
    assert redis_conn.hget(keys.rq_job_key(abandoned.id), "status") == b"started"
    assert not marker.exists() and CANARY not in sys.modules

    # The test can fail: RQ's own reader of that registry runs its clean-up, which imports the
    # failure callback the record names (and would re-queue the job next).
    registry = StartedJobRegistry(QUEUE, connection=redis_conn, serializer=JSONSerializer)
    with pytest.raises(RuntimeError, match="was imported"):
        registry.get_job_ids()
    assert marker.exists()


def test_eta_reads_at_most_ahead_read_jobs_and_extrapolates_the_rest(
    redis_conn: Redis, settings: Any
) -> None:
    fit = _publish(redis_conn, settings)
    client = client_for(redis_conn, settings)
    extra = 50
    # The jobs an ETA reads take 4 steps; those past them 8: read, they would count double.
    for n in range(AHEAD_READ + extra):
        steps = 4 if n < AHEAD_READ else 8
        client.submit({"model": MODEL, "prompt": "p", "steps": steps, "seed": n})
    last = client.submit({"model": MODEL, "prompt": "last", "steps": 2, "seed": 1})

    redis_conn.config_resetstat()
    eta = last.eta()
    stats = redis_conn.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): s["calls"] for name, s in stats.items()}
    assert eta == pytest.approx((AHEAD_READ + extra) * fit.eta(4) + fit.eta(2))
    assert calls["hmget"] == AHEAD_READ + 1  # its own record, then the ones it read ahead
    assert calls["lpos"] == 1 and calls["lrange"] == 2  # the heads of both lanes
    assert "hgetall" not in calls or calls["hgetall"] == 1  # the fits, never a job hash
