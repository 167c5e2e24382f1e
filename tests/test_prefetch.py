"""Reading the next job's model ahead (#18 item 6): while a job renders, a real worker reads the
model of the next job in its queues into the RAM cache, and that job places it from RAM
(load_source `ram`) on the rung its ladder picks; what the read cannot do costs a log line, not
a job."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis import Redis
from rich.console import Console
from rq import Queue

from api_client import keys
from api_client.schema import WorkerState
from tests.support.images import pixels
from tests.support.inprocess import client_for, make_renderer, serving_worker
from tests.support.records import records
from worker.manifest import load_manifests
from worker.memory.device import probe
from worker.memory.faults import FaultPlan
from worker.ops.top import render, snapshot
from worker.pipelines.loading import load_pipeline
from worker.pipelines.prefetch import read_estimate
from worker.pipelines.resident import host_bytes
from worker.queue.lanes import LaneOrder

A, B = "tiny-sd15", "tiny-flux"
JOB = {"prompt": "a fox", "steps": 2, "seed": 1}


def queued_then_worked(conn: Redis, settings: Any, models: list[str]) -> tuple[Any, list[Any]]:
    """Every job queued first, then one worker's burst: the next job is in its queues while
    each renders. The renderer, and the records in the order the jobs ran (the lanes take the
    models in turn, the first in name order: tiny-flux before tiny-sd15)."""
    worker = serving_worker(conn, settings, sorted(set(models)))
    client = client_for(conn, settings)
    for model in models:
        client.submit({**JOB, "model": model})
    worker.work(burst=True)
    return worker.renderer, records(settings.timings_log)


def image_of(conn: Redis, settings: Any, job_id: str) -> Any:
    return pixels(client_for(conn, settings).job(job_id).wait(timeout=5).images[0].path)


def test_the_next_jobs_model_is_read_into_ram_while_a_job_renders(
    redis_conn: Redis, make_settings: Any
) -> None:
    settings = make_settings(prefetch="on", max_resident=1, ram_cache_gb=1.0)
    renderer, got = queued_then_worked(redis_conn, settings, [A, B])
    assert [(r.model, r.status) for r in got] == [(B, "done"), (A, "done")]
    # A was never loaded in this process: from RAM means it was read ahead, during B.
    assert [r.load_source for r in got] == ["disk", "ram"]
    notes = {n.name: n.reason for n in got[1].settings.applied}
    assert f"while job {got[0].job_id} rendered" in notes["prefetch"]
    assert "prefetch" not in {n.name for n in got[0].settings.applied}
    # On a CPU the read grew the resident set B's peak is taken from: B is not measured, A is.
    assert {name.split("|")[0] for name in renderer.planner.peaks.peaks} == {A}
    read_ahead = image_of(redis_conn, settings, got[1].job_id)

    # The same jobs with nothing read ahead (no RAM cache): A renders the same pixels from disk.
    redis_conn.flushdb()
    out = settings.output_dir / "plain"
    plain = make_settings(
        prefetch="on",
        max_resident=1,
        ram_cache_gb=0,
        output_dir=out,
        timings_log=out / "timings.jsonl",
    )
    _, again = queued_then_worked(redis_conn, plain, [A, B])
    assert [(r.model, r.load_source) for r in again] == [(B, "disk"), (A, "disk")]
    assert np.array_equal(read_ahead, image_of(redis_conn, plain, again[1].job_id))


def test_a_model_read_ahead_takes_the_rung_its_job_is_given(
    redis_conn: Redis, make_settings: Any
) -> None:
    """A read ahead is never placed: its first job's rung decides its offload hooks and VAE
    tiling, as a load from disk would."""
    settings = make_settings(
        prefetch="on", max_resident=1, ram_cache_gb=1.0, memory_mode="group_offload"
    )
    _, got = queued_then_worked(redis_conn, settings, [B, A])
    assert [(r.model, r.status, r.load_source, r.rung) for r in got] == [
        (B, "done", "disk", "group_offload"),
        (A, "done", "ram", "group_offload"),
    ]
    assert "vae_tiling" in {n.name for n in got[1].settings.applied}


def test_nothing_is_read_ahead_for_a_model_already_resident(
    redis_conn: Redis, make_settings: Any
) -> None:
    settings = make_settings(prefetch="on", max_resident=0, ram_cache_gb=1.0)
    renderer, got = queued_then_worked(redis_conn, settings, [A, B, A, B])
    # A was read ahead once, during the first B; after that both stay on the device.
    assert [r.load_source for r in got] == ["disk", "ram", "resident", "resident"]
    assert renderer.prefetcher.started == 1 and renderer.cache.ram.model_ids() == []


def test_a_read_that_would_not_fit_the_ram_cache_is_not_started(
    redis_conn: Redis, make_settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(prefetch="on", max_resident=1, ram_cache_gb=0.000_01)  # 10 kB
    caplog.set_level(logging.INFO, logger="worker.pipelines.prefetch")
    renderer, got = queued_then_worked(redis_conn, settings, [A, B, A, B])
    assert [r.load_source for r in got] == ["disk"] * 4  # nothing fits 10 kB: not even evictions
    assert renderer.prefetcher.started == 0
    assert "over the RAM cache's 0.00 GB (KILN_RAM_CACHE_GB)" in caplog.text
    # Each model's reason is said once, however many jobs ask about it again.
    for model in (A, B):
        assert caplog.text.count(f"not reading {model} ahead: its weights take about") == 1


def broken_copy(tiny_dir: Path, tmp_path: Path, damage: str) -> Path:
    """A models directory whose A has damaged UNet weights: "truncated" keeps the safetensors
    header and loses half the data; "header" overwrites the header's length."""
    models = tmp_path / "models"
    models.mkdir()
    (models / B).symlink_to(tiny_dir / B)
    shutil.copytree(tiny_dir / A, models / A)
    weights = next((models / A / "unet").glob("*.safetensors"))
    data = weights.read_bytes()
    broken = data[: len(data) // 2] if damage == "truncated" else b"\xff" * 8 + data[8:]
    weights.write_bytes(broken)
    return models


@pytest.mark.parametrize(
    ("damage", "logged"),
    [
        ("truncated", f"prefetch: reading {A} failed (its job will load it itself)"),
        ("header", f"prefetch: not reading {A} ahead: cannot size its weights"),
    ],
)
def test_weights_a_read_ahead_cannot_take_cost_a_log_line_and_fail_only_their_job(
    redis_conn: Redis,
    make_settings: Any,
    tiny_dir: Path,
    tmp_path: Path,
    caplog: Any,
    damage: str,
    logged: str,
) -> None:
    """Truncated: the read fails in its thread. A broken header: the estimate cannot size it,
    so no read starts. Either way the worker goes on, and A's job reads the model itself and
    fails, with the error in its own record."""
    models = broken_copy(tiny_dir, tmp_path, damage)
    settings = make_settings(prefetch="on", max_resident=1, ram_cache_gb=1.0, models_dir=models)
    caplog.set_level(logging.INFO, logger="worker.pipelines.prefetch")
    renderer, got = queued_then_worked(redis_conn, settings, [B, A, B])
    assert [(r.model, r.status) for r in got] == [(B, "done"), (A, "failed"), (B, "done")]
    assert logged in caplog.text
    assert got[1].load_source == "disk" and got[1].error
    read = renderer.prefetcher.latest
    assert read.outcome.startswith("failed: ") if damage == "truncated" else read is None, read


@pytest.mark.parametrize(
    ("setting", "why"),
    [
        ("auto", "auto: the device is this host's CPU, where a read takes the render's cores"),
        ("off", "switched off (KILN_PREFETCH=off)"),
    ],
)
def test_on_this_cpu_auto_and_off_never_read_ahead_nor_ask_the_queues(
    redis_conn: Redis, make_settings: Any, setting: str, why: str
) -> None:
    settings = make_settings(prefetch=setting, max_resident=1, ram_cache_gb=1.0)
    renderer = make_renderer(settings, [A, B])
    assert renderer.prefetcher.off == why

    def asked() -> str | None:
        raise AssertionError("a prefetcher that is off asked its queues")

    renderer.prefetcher.upcoming = asked
    assert renderer.prefetcher.after_load(A, "job") is None and renderer.prefetcher.started == 0


def test_the_workers_state_and_kiln_top_show_its_ram_cache_and_read_ahead(
    redis_conn: Redis, make_settings: Any
) -> None:
    """What a worker publishes names the models in its RAM cache and the one it reads ahead;
    `kiln top` shows them beside the resident ones."""
    settings = make_settings(prefetch="on", max_resident=1, ram_cache_gb=1.0)
    worker = serving_worker(redis_conn, settings, [B, A])  # B's lane first: B, then A
    client = client_for(redis_conn, settings)
    for model in (B, A):
        client.submit({**JOB, "model": model})
    worker.work(burst=True)
    worker.publish_state()  # as its Pulse does every 10 s (the burst's end withdrew it)
    state = WorkerState.model_validate_json(redis_conn.get(keys.worker_key(worker.name)) or b"")
    assert (state.resident, state.ram, state.reading) == ([A], [B], None)

    redis_conn.set(
        keys.worker_key(worker.name),
        state.model_copy(update={"reading": "tiny-sdxl"}).model_dump_json(),
    )
    console = Console(record=True, width=200)
    console.print(render(snapshot(redis_conn)))
    line = next(row for row in console.export_text().splitlines() if worker.name in row)
    assert f"{A}@full, {B}@ram, tiny-sdxl@reading" in line, line


def test_the_lane_order_names_the_next_jobs_model(redis_conn: Redis) -> None:
    names = [keys.queue_name(m, lane) for lane in keys.LANES for m in (A, B)]
    queues = {n: Queue(n, connection=redis_conn) for n in names}
    lanes = LaneOrder(list(queues.values()))
    assert lanes.upcoming_model() is None  # every queue empty
    queues[keys.queue_name(B, "batch")].enqueue("builtins.print")
    assert lanes.upcoming_model() == B
    queues[keys.queue_name(A, "interactive")].enqueue("builtins.print")
    assert lanes.upcoming_model() == A  # interactive before batch
    # A worker of one model asks nothing: a connection that cannot connect is never used.
    dead = Redis(port=1)
    one = LaneOrder([Queue(keys.queue_name(A, lane), connection=dead) for lane in keys.LANES])
    assert one.upcoming_model() is None


@pytest.mark.parametrize("model", [A, B, "tiny-sdxl"])
def test_the_read_estimate_is_within_a_tenth_of_what_the_read_holds(
    settings: Any, model: str
) -> None:
    """From the safetensors headers alone, before a read: what its modules hold once read."""
    manifest = load_manifests(settings.manifests, [model])[model]
    info = probe(settings)
    held = host_bytes(load_pipeline(manifest, "full", info, settings, FaultPlan()).pipe)
    estimate = read_estimate(manifest, info, settings)
    assert estimate is not None and abs(estimate - held) <= held * 0.1, (estimate, held)
