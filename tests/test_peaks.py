"""Placement from measured peaks (#18 item 1): every job's memory is measured per card kind and
shape and shared through Redis (kiln:peaks); once measured, it replaces the manifest's figures.
On this CPU, device memory is the process's resident set (its peak from VmHWM)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.conftest import MANIFESTS
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.memory.peaks import GB, KEY, MARGIN, Peak, PeakBook, Shape, needs_from

MODEL = "tiny-sd15"


def manifests_with(tmp_path: Path, **figures: str) -> Path:
    """The shipped tiny-sd15 manifest with its memory figures replaced."""
    directory = tmp_path / "manifests"
    directory.mkdir()
    lines = []
    for line in (MANIFESTS / f"{MODEL}.yaml").read_text(encoding="utf-8").splitlines():
        key = line.split(":", 1)[0]
        lines.append(f"{key}: {figures[key]}" if key in figures else line)
    (directory / f"{MODEL}.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory


def one_job(conn: Redis, settings: Any, renderer: Any, **request: Any) -> Any:
    client = client_for(conn, settings)
    job = client.submit({"model": MODEL, "prompt": "a fox", "steps": 2, "seed": 1, **request})
    burst(conn, renderer, [MODEL])
    return next(r for r in records(settings.timings_log) if r.job_id == job.id)


def test_needs_are_derived_from_what_one_rung_measured() -> None:
    mb = 1024**2
    group = Peak(resident_bytes=3 * mb, working_bytes=40 * mb, weights_bytes=300 * mb,
                 largest_bytes=200 * mb)  # fmt: skip
    needs = needs_from({"group_offload": group})
    assert needs["group_offload"] == pytest.approx(43 * mb * (1 + MARGIN) / GB)
    assert needs["full"] == pytest.approx(340 * mb * (1 + MARGIN) / GB)  # all weights + working
    assert needs["model_offload"] == pytest.approx(240 * mb * (1 + MARGIN) / GB)  # the largest
    assert "partial" not in needs  # no rule of its own: the manifest's figures
    # An out-of-memory floor keeps a rung above what it failed with, whatever was derived.
    floor = Peak(resident_bytes=0, working_bytes=0, weights_bytes=0, largest_bytes=0, jobs=0,
                 oom_above_gb=2.0)  # fmt: skip
    assert needs_from({"group_offload": group, "full": floor})["full"] == 2.0 * (1 + MARGIN)
    assert needs_from({}) == {}


def test_a_model_declared_too_big_goes_full_once_measured(
    redis_conn: Redis, make_settings: Any, tmp_path: Path
) -> None:
    directory = manifests_with(
        tmp_path, min_vram_gb="50", rung_vram_gb="{model_offload: 30, group_offload: 20}"
    )
    settings = make_settings(manifests=directory, vram_budget_gb=2.0)
    renderer = make_renderer(settings, [MODEL])
    first = one_job(redis_conn, settings, renderer)
    assert (first.rung, first.planned_from) == ("group_offload", "declared")
    assert first.peak_memory_bytes and first.peak_memory_bytes > 0
    second = one_job(redis_conn, settings, renderer, seed=2)
    assert (second.rung, second.planned_from) == ("full", "measured"), second.rung_reason
    # Shared: a new worker on this card kind plans from it at its first job.
    fields = [f.decode() for f in redis_conn.hkeys(KEY)]
    assert any(f.endswith(f"|{MODEL}|128x128|fp32|none|txt2img|group_offload") for f in fields)
    fresh = make_renderer(settings, [MODEL])
    assert one_job(redis_conn, settings, fresh, seed=3).rung == "full"


def test_a_model_declared_too_small_descends_once_then_is_placed_right(
    redis_conn: Redis, make_settings: Any, tmp_path: Path
) -> None:
    directory = manifests_with(tmp_path, min_vram_gb="0.01")
    settings = make_settings(manifests=directory, vram_budget_gb=2.0, faults="oom@denoise:full*2")
    first = one_job(redis_conn, settings, make_renderer(settings, [MODEL]))
    assert [a.outcome for a in first.attempts] == ["oom", "oom", "ok"]
    assert first.rung != "full" and first.planned_from == "declared"
    # A new worker (nothing remembered in its process, no fault left to drill) reads that full
    # ran out of memory with about 2 GB usable, and places the model right away.
    calm = make_settings(manifests=directory, vram_budget_gb=2.0)
    second = one_job(redis_conn, calm, make_renderer(calm, [MODEL]), seed=2)
    assert [a.outcome for a in second.attempts] == ["ok"]
    assert second.rung == first.rung
    [floor] = [v for f, v in redis_conn.hgetall(KEY).items() if f.endswith(b"|full")]
    assert Peak.model_validate_json(floor).oom_above_gb == pytest.approx(2.0, abs=0.5)


def test_a_profile_drill_is_kept_apart_from_the_real_card(redis_conn: Redis) -> None:
    from worker.memory.peaks import card_kind

    assert card_kind("NVIDIA H200", None) == "NVIDIA H200"
    assert card_kind("AMD EPYC 7B13", "h200") == "AMD EPYC 7B13 as h200"
    book = PeakBook(redis_conn, "cpu as h200")
    shape = Shape(MODEL, 128, 128, "fp32", (), "txt2img")
    peak = Peak(resident_bytes=1, working_bytes=2, weights_bytes=3, largest_bytes=1)
    book.observe(shape, "full", peak)
    real = PeakBook(redis_conn, "NVIDIA H200")
    real.read()
    assert real.peaks == {}
    again = PeakBook(redis_conn, "cpu as h200")
    again.read()
    assert again.peaks[f"{shape.field}|full"] == peak


def test_doctor_shows_measured_against_declared_and_flags_a_wrong_manifest(
    redis_conn: Redis, make_settings: Any, tmp_path: Path
) -> None:
    from worker.ops.doctor import collect, format_report

    directory = manifests_with(tmp_path, min_vram_gb="0.001")  # far too small
    settings = make_settings(manifests=directory)
    one_job(redis_conn, settings, make_renderer(settings, [MODEL]))
    report = collect(settings)
    [row] = [c for c in report.measured if c.shape.startswith(f"{MODEL}|128x128")]
    assert row.rung == "full" and row.jobs == 1 and row.declared_gb == 0.001
    assert 0.001 < row.measured_gb < 5 and row.wrong and row.off < -0.2
    text = format_report(report, settings)
    assert f"{MODEL}|128x128|fp32|none|txt2img full: measured" in text
    assert "declared 0.00 GB" in text and "off by more than 20%" in text


def test_a_worker_whose_memory_fits_no_served_model_takes_no_job(
    redis_conn: Redis, kiln_env: dict[str, str], make_settings: Any, tmp_path: Path
) -> None:
    """#18 item 5: measured, tiny-sd15 needs 5 GB at its lowest rung; a worker with 1 GB waits,
    saying why in its state, in `kiln models` and in a metric, instead of taking the job."""
    import json
    import time
    import urllib.request

    from tests.conftest import kiln
    from tests.support.fleet import blocked
    from tests.workers import WorkerProcess, free_port, wait_until
    from worker.memory.device import probe
    from worker.memory.peaks import card_kind

    settings = make_settings()
    card = card_kind(probe(settings).name, None)
    need = Peak(resident_bytes=0, working_bytes=5 * GB, weights_bytes=GB, largest_bytes=GB)
    shape = Shape(MODEL, 128, 128, "fp32", (), "txt2img")
    redis_conn.hset(KEY, f"{card}|{shape.field}|group_offload", need.model_dump_json())
    job = client_for(redis_conn, settings).submit({"model": MODEL, "prompt": "a fox", "steps": 2})
    port = free_port()
    env = {**kiln_env, "KILN_VRAM_BUDGET_GB": "1"}
    worker = WorkerProcess(env, tmp_path / "w.log", "--models", MODEL, "--metrics-port", str(port))
    try:
        worker.wait_ready(redis_conn)
        why = wait_until(
            lambda: blocked(redis_conn, worker.name), 60, "the worker to say it waits for memory"
        )
        assert why.startswith("waiting for memory:") and f"{MODEL} needs 5.75 GB" in why
        time.sleep(2)
        assert job.status() == "queued"  # not taken: it could only fail
        models = kiln("models", "--json", env=env)
        [row] = [m for m in json.loads(models.stdout) if m["id"] == MODEL]
        assert row["blocked"][worker.name].startswith("waiting for memory:")
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b"kiln_waiting_for_memory 1.0" in scraped
    finally:
        worker.stop()
    # With the memory there (a worker allowed 10 GB), the same job runs.
    roomy = make_settings(vram_budget_gb=10.0)
    burst(redis_conn, make_renderer(roomy, [MODEL]), [MODEL])
    assert job.wait(timeout=30).model == MODEL
