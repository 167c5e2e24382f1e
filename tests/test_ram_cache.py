"""Warm model switches (#18 item 6): pipelines evicted from the device wait in a host-RAM cache
bounded by KILN_RAM_CACHE_GB, KILN_MAX_RESIDENT caps the pipelines on the device, and the record's
load_source says where each job's weights came from (resident, ram or disk)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from redis import Redis

from tests.support.images import pixels
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.manifest import load_manifests
from worker.memory.device import probe
from worker.memory.faults import FaultPlan
from worker.pipelines.loading import load_pipeline
from worker.pipelines.resident import RamCache, host_bytes

A, B, C = "tiny-sd15", "tiny-flux", "tiny-sdxl"


def alternate(conn: Redis, settings: Any, models: list[str]) -> tuple[list[Any], list[Any]]:
    """One job per model in this order, each worked before the next is submitted, all by one
    renderer (one worker process): the records and the jobs."""
    renderer = make_renderer(settings, sorted(set(models)))
    client = client_for(conn, settings)
    jobs = []
    for model in models:
        jobs.append(client.submit({"model": model, "prompt": "a fox", "steps": 2, "seed": 1}))
        burst(conn, renderer, sorted(set(models)))
    by_id = {r.job_id: r for r in records(settings.timings_log)}
    return [by_id[job.id] for job in jobs], jobs


def test_with_one_resident_an_alternating_queue_loads_from_ram_from_the_third_job(
    redis_conn: Redis, make_settings: Any
) -> None:
    settings = make_settings(max_resident=1, ram_cache_gb=1.0)
    got, jobs = alternate(redis_conn, settings, [A, B, A, B, A])
    assert [r.status for r in got] == ["done"] * 5
    assert [r.load_source for r in got] == ["disk", "disk", "ram", "ram", "ram"]
    # From RAM, a switch is a placement: faster than the read from disk it replaces.
    assert max(r.timings.load for r in got[2:]) < min(r.timings.load for r in got[:2])
    # The pipeline that came back from RAM renders what it rendered before, pixel for pixel.
    first, again = (pixels(jobs[i].wait(timeout=5).images[0].path) for i in (0, 2))
    assert np.array_equal(first, again)


def test_without_a_ram_cache_every_switch_reads_from_disk(
    redis_conn: Redis, make_settings: Any
) -> None:
    settings = make_settings(max_resident=1, ram_cache_gb=0)
    got, _ = alternate(redis_conn, settings, [A, B, A, B])
    assert [r.load_source for r in got] == ["disk"] * 4


def test_without_a_limit_both_models_stay_resident(redis_conn: Redis, make_settings: Any) -> None:
    settings = make_settings(max_resident=0, ram_cache_gb=1.0)
    got, _ = alternate(redis_conn, settings, [A, B, A, B])
    assert [r.load_source for r in got] == ["disk", "disk", "resident", "resident"]


def test_a_replay_pinned_to_another_rung_does_not_take_the_ram_copy(
    redis_conn: Redis, make_settings: Any
) -> None:
    """The RAM copy keeps its rung; a job asking for another rung loads from disk and the copy
    is freed, not kept twice."""
    settings = make_settings(max_resident=1, ram_cache_gb=1.0)
    renderer = make_renderer(settings, [A, B])
    client = client_for(redis_conn, settings)
    for request in (
        {"model": A},
        {"model": B},
        {"model": A, "rung": "model_offload", "compile": False},
    ):
        client.submit({**request, "prompt": "a fox", "steps": 2, "seed": 1})
        burst(redis_conn, renderer, [A, B])
    got = records(settings.timings_log)
    assert [(r.load_source, r.rung) for r in got] == [
        ("disk", "full"),
        ("disk", "full"),
        ("disk", "model_offload"),
    ]
    assert renderer.cache.ram.model_ids() == [B]


def _loaded(settings: Any, model: str) -> Any:
    manifest = load_manifests(settings.manifests, [model])[model]
    return load_pipeline(manifest, "full", probe(settings), settings, FaultPlan())


def test_the_ram_cache_drops_its_oldest_beyond_its_bound(settings: Any) -> None:
    pipes = {m: _loaded(settings, m) for m in (A, B, C)}
    sizes = {m: host_bytes(p.pipe) for m, p in pipes.items()}
    # Room for the two smaller ones, not for all three.
    bound = sum(sizes.values()) - min(sizes.values()) // 2
    cache = RamCache(bound)
    order = sorted(pipes, key=lambda m: sizes[m])
    for model in order:
        assert cache.keep(pipes[model], sizes[model])
    assert cache.model_ids() == order[1:] and cache.held_bytes() <= bound
    assert pipes[order[0]].pipe is None, "the dropped pipeline's weights are released"
    assert cache.take(order[1]) is pipes[order[1]] and cache.take(order[1]) is None
    assert not RamCache(sizes[order[0]] - 1).keep(_loaded(settings, order[0]), sizes[order[0]])


@pytest.mark.parametrize(("field", "value"), [("max_resident", -1), ("ram_cache_gb", -0.5)])
def test_settings_refuse_negative_bounds(make_settings: Any, field: str, value: Any) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        make_settings(**{field: value})


def test_every_kiln_setting_is_in_the_workers_settings() -> None:
    from tests.conftest import ROOT
    from worker.settings import Settings

    documented = (ROOT / "docs" / "workers.md").read_text(encoding="utf-8")
    # The AWS_* ones are boto3's own variables, read under their usual names.
    names = [f"KILN_{f.upper()}" for f in Settings.model_fields if not f.startswith("aws_")]
    assert [n for n in names if n not in documented] == []
