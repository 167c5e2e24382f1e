"""The walking skeleton end to end: client -> Redis -> resident worker -> files, result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from redis import Redis

from api_client import RenderFailed
from api_client.schema import PHASES
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import enqueue_raw, records

TINY_MODELS = [
    "tiny-sd15",
    "tiny-sdxl",
    "tiny-sd3",
    "tiny-flux",
    "tiny-flux2",
    "tiny-qwenimage",
    "tiny-zimage",
]


@pytest.mark.parametrize("model", TINY_MODELS)
def test_submit_render_result(redis_conn: Redis, settings: Any, model: str) -> None:
    client = client_for(redis_conn, settings)
    job = client.submit(
        {"model": model, "prompt": "a red fox", "steps": 3, "seed": 7, "num_images": 2}
    )
    assert job.status() == "queued"
    burst(redis_conn, make_renderer(settings, [model]), [model])
    result = job.wait(timeout=10)

    assert (result.model, result.seed, result.steps, result.width, result.height) == (
        model,
        7,
        3,
        128,
        128,
    )
    assert (result.rung, result.device, result.dtype) == ("full", "cpu", "fp32")
    assert [a.outcome for a in result.attempts] == ["ok"]
    assert len(result.images) == 2 and result.images[0].sha256 != result.images[1].sha256
    for image in result.images:
        path = Path(image.path)
        assert path.parent == settings.output_dir / job.id
        with Image.open(path) as opened:
            assert opened.size == (128, 128) and opened.format == "PNG"
    assert (settings.output_dir / job.id / "result.json").is_file()

    t = result.timings
    assert all(getattr(t, phase) >= 0 for phase in PHASES)
    assert (
        t.load > 0 and t.text_encode > 0 and t.denoise > 0 and t.decode > 0 and t.image_encode > 0
    )
    after_wait = sum(getattr(t, p) for p in PHASES if p not in ("queue_wait", "total"))
    # Within 5 %, or 15 ms on a job this short: the lease checks between phases are Redis round
    # trips, which a loaded 2-core machine stretches (13 ms of a 0.24 s job once, in make test).
    assert after_wait == pytest.approx(t.total, rel=0.05, abs=0.015)
    assert t.queue_wait > 0
    assert any(note.name == "sdpa" for note in result.settings.applied)

    [record] = records(settings.timings_log)
    assert record.status == "done" and record.job_id == job.id and record.cold
    assert record.timings == result.timings or record.timings.total >= result.timings.total
    assert record.per_step_s and record.per_step_s > 0
    assert record.finished_at >= result.finished_at >= result.started_at


def test_same_request_gives_the_same_bytes_and_another_seed_does_not(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    request = {"model": "tiny-sd15", "prompt": "determinism", "steps": 3, "seed": 1234}
    first, second = client.submit(request), client.submit(request)
    other = client.submit({**request, "seed": 1235})
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    digest = lambda job: job.wait(timeout=10).images[0].sha256  # noqa: E731
    assert digest(first) == digest(second)
    assert digest(other) != digest(first)


def test_unknown_model_job_fails_clearly_and_the_worker_goes_on(
    redis_conn: Redis, settings: Any
) -> None:
    """A job for a model this worker has no manifest for, on a queue it listens to."""
    bad = enqueue_raw(redis_conn, "tiny-sd15", {"request": {"model": "sd9-ultra", "prompt": "x"}})
    good = client_for(redis_conn, settings).submit(
        {"model": "tiny-sd15", "prompt": "ok", "steps": 2}
    )
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    with pytest.raises(RenderFailed, match=r"sd9-ultra.*unknown model"):
        client_for(redis_conn, settings).job(bad).wait(timeout=5)
    assert good.wait(timeout=5).model == "tiny-sd15"


def test_two_models_alternate_without_reloading(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    order = ["tiny-sd15", "tiny-sdxl", "tiny-sd15", "tiny-sdxl"]
    jobs = [
        client.submit({"model": m, "prompt": "alternate", "steps": 2, "seed": i})
        for i, m in enumerate(order)
    ]
    renderer = make_renderer(settings, ["tiny-sd15", "tiny-sdxl"])
    worker = burst(redis_conn, renderer, ["tiny-sd15", "tiny-sdxl"])
    loads = [job.wait(timeout=10).timings.load for job in jobs]
    assert loads[0] > 0 and loads[1] > 0
    assert loads[2] == 0 and loads[3] == 0
    assert set(renderer.cache.model_ids()) == {"tiny-sd15", "tiny-sdxl"}
    cold = [r.cold for r in records(settings.timings_log)]
    assert cold == [True, True, False, False]
    assert worker.name


def test_worker_publishes_manifests_fits_and_state(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    for seed in range(3):
        client.submit({"model": "tiny-sd15", "prompt": "fit", "steps": 4, "seed": seed})
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    [info] = [i for i in client.models() if i.manifest.id == "tiny-sd15"]
    fit = info.fits[(128, 128)]
    assert fit.samples == 2  # the cold first job is not averaged in
    assert fit.per_step_s > 0 and fit.fixed_s > 0
    assert info.default_eta_s == pytest.approx(fit.fixed_s + 8 * fit.per_step_s)
    # a burst worker has exited and withdrawn its state
    assert client.workers() == []


def test_prewarm_pays_load_and_each_size_before_the_first_job(
    redis_conn: Redis, settings: Any
) -> None:
    from worker.serve import warm

    renderer = make_renderer(settings, ["tiny-sd15"])
    warm(renderer, ["tiny-sd15"], "w1")
    warmups = records(settings.timings_log)
    assert [(r.width, r.height) for r in warmups] == [(128, 128), (192, 128), (128, 192)]
    assert all(r.status == "done" and r.cold and r.job_id.startswith("prewarm-") for r in warmups)
    job = client_for(redis_conn, settings).submit(
        {"model": "tiny-sd15", "prompt": "p", "width": 192, "height": 128}
    )
    burst(redis_conn, renderer, ["tiny-sd15"])
    assert job.wait(timeout=10).timings.load == 0
    assert records(settings.timings_log)[-1].cold is False
