"""ETAs: the workers' least-squares timing fits, and job.eta() counting the jobs ahead."""

from __future__ import annotations

from typing import Any

import pytest
from redis import Redis

from api_client.schema import Attempt, Timings
from tests.helpers import burst, client_for, make_renderer
from worker.timings import FitTracker, TimingRecord

MODEL = "tiny-sd15"


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

    from worker.metrics import observe

    labels = {"model": MODEL}
    before = REGISTRY.get_sample_value("kiln_jobs_answered_from_store_total", labels) or 0.0
    observe(_record(8, 0.3).model_copy(update={"answered_from": "store"}))
    observe(_record(8, 0.3))
    after = REGISTRY.get_sample_value("kiln_jobs_answered_from_store_total", labels)
    assert after == before + 1


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
