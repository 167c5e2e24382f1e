"""The partial rung (#18 item 2): under a KILN_VRAM_BUDGET_GB between group_offload's and full's
needs a job runs at partial, its denoiser split by the blocks' measured bytes, and the record
says how many blocks stayed resident and how many streamed; a pinned partial never descends,
and auto descends from it to model_offload. Real RQ workers in-process, tiny-sd15 on CPU."""

from __future__ import annotations

from typing import Any

import pytest
from redis import Redis

from api_client import RenderFailed
from api_client.schema import RenderResult
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.memory import peaks
from worker.memory.device import probe
from worker.memory.ladder import GB
from worker.memory.partial import MARGIN, denoiser_blocks, module_bytes, plan_split
from worker.render.renderer import Renderer
from worker.render.timings import TimingRecord

MODEL = "tiny-sd15"
JOB = {"model": MODEL, "prompt": "a partial kiln", "steps": 2, "seed": 5}
FULL_NEED_GB = 0.1  # tiny-sd15's min_vram_gb; fp32 on CPU counts as 16-bit (no accelerator)


@pytest.fixture(scope="module")
def block_bytes(tiny_dir: Any) -> list[int]:
    """The tiny UNet's blocks as the worker measures them: parameter and buffer bytes, fp32."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_dir / MODEL / "unet")
    return [module_bytes(block) for block in denoiser_blocks(unet)]


def budget_for(block_bytes: list[int], resident: int) -> float:
    """A budget that keeps exactly `resident` blocks: the non-block need, those blocks with their
    margin, and half of the next block's."""
    others = FULL_NEED_GB - sum(block_bytes) / GB
    kept = sum(block_bytes[:resident]) + block_bytes[resident] / 2
    return others + kept * (1 + MARGIN) / GB


def run(conn: Redis, settings: Any) -> tuple[RenderResult, TimingRecord, Renderer]:
    renderer = make_renderer(settings, [MODEL])
    handle = client_for(conn, settings).submit(JOB)
    burst(conn, renderer, [MODEL])
    result = handle.wait(timeout=60)
    [record] = records(settings.timings_log)
    return result, record, renderer


def streamed_blocks(renderer: Renderer) -> list[bool]:
    """Per block of the resident UNet: whether group offload hooks stream it."""
    loaded = renderer.cache.get(MODEL)
    assert loaded is not None
    return [
        any(getattr(m, "_diffusers_hook", None) is not None for m in block.modules())
        for block in denoiser_blocks(loaded.denoiser)
    ]


@pytest.mark.parametrize("resident", [1, 2, 3])
def test_a_budget_between_group_offload_and_full_runs_partial_and_records_the_split(
    redis_conn: Redis, make_settings: Any, block_bytes: list[int], resident: int
) -> None:
    budget = budget_for(block_bytes, resident)
    assert 0.08 < budget < FULL_NEED_GB  # partial's need (one block) fits; full's does not
    settings = make_settings(vram_budget_gb=budget, vram_reserve_gb=0.0)
    result, record, renderer = run(redis_conn, settings)
    assert result.rung == record.rung == "partial" and len(result.images) == 1
    assert "needs 0.08 GB" in (record.rung_reason or "")
    streamed = len(block_bytes) - resident
    assert record.partial_blocks is not None
    assert (record.partial_blocks.resident, record.partial_blocks.streamed) == (resident, streamed)
    # The placement is what the record says: the first blocks plain, the rest hooked.
    assert streamed_blocks(renderer) == [False] * resident + [True] * streamed
    note = next(n.reason for n in result.settings.applied if n.name == "partial")
    assert note.startswith(f"{resident} of {len(block_bytes)} denoiser blocks resident")
    assert not result.compiled


def test_the_split_plans_with_fulls_measured_need_over_the_manifests(
    redis_conn: Redis, make_settings: Any, block_bytes: list[int]
) -> None:
    """Full measured on this card kind above min_vram_gb: the non-block need is the measured
    full need less the blocks, so fewer blocks stay than the manifest's figure would keep."""
    budget = budget_for(block_bytes, 3)
    blocks_gb = sum(block_bytes) / GB
    measured = FULL_NEED_GB + blocks_gb / 2  # what full's jobs took here
    planned = measured * (1 + peaks.MARGIN)
    expected = plan_split(block_bytes, budget, planned)
    assert expected.resident < plan_split(block_bytes, budget, FULL_NEED_GB).resident == 3
    settings = make_settings(vram_budget_gb=budget, vram_reserve_gb=0.0)
    book = peaks.PeakBook(redis_conn, peaks.card_kind(probe(settings).name, None))
    shape = peaks.Shape(MODEL, 128, 128, "fp32", (), "txt2img")
    size = int(measured * GB)
    book.observe(
        shape,
        "full",
        peaks.Peak(
            resident_bytes=size, working_bytes=0, weights_bytes=size, largest_bytes=size // 2
        ),
    )
    result, record, _ = run(redis_conn, settings)
    assert record.rung == "partial" and record.partial_blocks is not None
    split = (record.partial_blocks.resident, record.partial_blocks.streamed)
    assert split == (expected.resident, expected.streamed)
    note = next(n.reason for n in result.settings.applied if n.name == "partial")
    assert f"{planned - blocks_gb:.3f} GB for everything but the blocks" in note


def test_a_pinned_partial_never_descends(redis_conn: Redis, make_settings: Any) -> None:
    settings = make_settings(memory_mode="partial", faults="oom@denoise:partial*2")
    handle = client_for(redis_conn, settings).submit(JOB)
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    with pytest.raises(RenderFailed) as failed:
        handle.wait(timeout=60)
    assert "rung partial (pinned by KILN_MEMORY_MODE=partial)" in str(failed.value)
    [record] = records(settings.timings_log)
    assert [(a.rung, a.outcome) for a in record.attempts] == [("partial", "oom")] * 2


def test_a_pinned_partial_with_room_for_every_block_still_streams_one(
    redis_conn: Redis, make_settings: Any
) -> None:
    result, record, renderer = run(redis_conn, make_settings(memory_mode="partial"))
    assert record.partial_blocks is not None and record.partial_blocks.streamed == 1
    assert streamed_blocks(renderer)[-1] and result.rung == "partial"


def test_auto_descends_from_partial_to_model_offload(
    redis_conn: Redis, make_settings: Any, block_bytes: list[int]
) -> None:
    budget = budget_for(block_bytes, 2)
    settings = make_settings(
        vram_budget_gb=budget, vram_reserve_gb=0.0, faults="oom@denoise:partial*2"
    )
    result, record, _ = run(redis_conn, settings)
    assert result.rung == "model_offload"
    assert [(a.rung, a.outcome) for a in result.attempts] == [
        ("partial", "oom"),
        ("partial", "oom"),
        ("model_offload", "ok"),
    ]
    assert record.partial_blocks is None  # the denoise that finished ran at model_offload


def test_the_split_arithmetic_and_its_bounds() -> None:
    mb = 1_000_000
    # 10 MB for everything else; 4 blocks of 1 MB each with a 10 % margin: 2.5 MB of room = 2.
    split = plan_split([mb] * 4, usable_gb=0.0125, full_need_gb=0.014)
    assert (split.resident, split.streamed, split.streamed_bytes) == (2, 2, 2 * mb)
    assert "2 of 4 denoiser blocks resident, 2 streamed" in split.reason
    assert plan_split([mb] * 4, 0.0, 0.014).resident == 1  # at least one stays
    assert "(at least one stays)" in plan_split([mb] * 4, 0.0, 0.014).reason
    roomy = plan_split([mb] * 4, 100.0, 0.014)
    assert (roomy.resident, roomy.streamed) == (3, 1) and "(at least one streams)" in roomy.reason
    # Unequal blocks are kept in forward order while they fit, not by size.
    assert plan_split([3 * mb, mb, mb], usable_gb=0.0125, full_need_gb=0.015).resident == 1
    with pytest.raises(ValueError, match="rung partial: the denoiser has no blocks"):
        plan_split([], 1.0, 1.0)
