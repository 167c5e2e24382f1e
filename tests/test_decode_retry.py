"""Out of memory in decode keeps the latents (#18 item 3): the decode alone is retried tiled,
then one rung lower, and the text encode and the denoise run once. Drilled with KILN_FAULTS
through real workers: an in-process RQ worker, and a `kiln worker --burst` process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from redis import Redis

from api_client import RenderFailed
from api_client.schema import RenderResult
from tests.conftest import kiln
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.render.timings import TimingRecord

MODEL = "tiny-sd15"
STEPS = 6
JOB = {"model": MODEL, "prompt": "a kiln at dusk", "steps": STEPS, "seed": 11}
KEPT = "latents kept, text encode and denoise not run again"
# Denoiser calls one denoise makes: the tiny sd15's PNDM scheduler runs one more timestep than
# steps (its warm-up step); the flow-matching families run exactly steps.
ONE_DENOISE = {MODEL: STEPS + 1, "tiny-flux": STEPS, "tiny-qwenimage": STEPS}


def drill(conn: Redis, settings: Any, model: str = MODEL) -> tuple[RenderResult, TimingRecord]:
    """One job through an in-process RQ worker: its result and its timing record."""
    handle = client_for(conn, settings).submit({**JOB, "model": model})
    burst(conn, make_renderer(settings, [model]), [model])
    result = handle.wait(timeout=60)
    [record] = records(settings.timings_log)
    return result, record


def failed_drill(conn: Redis, settings: Any) -> tuple[str, TimingRecord]:
    handle = client_for(conn, settings).submit(JOB)
    burst(conn, make_renderer(settings, [MODEL]), [MODEL])
    with pytest.raises(RenderFailed) as failure:
        handle.wait(timeout=60)
    [record] = records(settings.timings_log)
    return str(failure.value), record


def tried(attempts: Any) -> list[tuple[str, str, str | None]]:
    return [(a.rung, a.outcome, a.phase) for a in attempts]


def test_decode_oom_once_retries_the_decode_tiled_and_denoises_once(
    redis_conn: Redis, make_settings: Any
) -> None:
    result, record = drill(redis_conn, make_settings(faults="oom@decode:full"))
    assert result.rung == "full" and len(result.images) == 1
    assert tried(result.attempts) == [("full", "oom", "decode"), ("full", "ok", "decode")]
    assert result.attempts[0].detail == (
        "decode: KILN_FAULTS drill: injected out of memory in decode at rung full"
    )
    assert result.attempts[1].detail == f"decode retried tiled and sliced; {KEPT}"
    assert record.steps_denoised == ONE_DENOISE[MODEL]  # the denoise ran once
    assert result.timings.load > 0 and record.load_source == "disk"  # the one load, no reload


@pytest.mark.parametrize(
    "model", [MODEL, "tiny-flux", pytest.param("tiny-qwenimage", marks=pytest.mark.slow)]
)
def test_decode_oom_twice_decodes_one_rung_lower_without_denoising_again(
    redis_conn: Redis, make_settings: Any, model: str
) -> None:
    result, record = drill(redis_conn, make_settings(faults="oom@decode:full*2"), model)
    assert result.rung == "partial" and len(result.images) == 1
    assert tried(result.attempts) == [
        ("full", "oom", "decode"),
        ("full", "oom", "decode"),
        ("partial", "ok", "decode"),
    ]
    assert (result.attempts[1].detail or "").startswith("tiled decode: KILN_FAULTS drill")
    assert result.attempts[2].detail == (
        f"decode retried tiled and sliced one rung lower, at partial; {KEPT}"
    )
    assert record.steps_denoised == ONE_DENOISE[model] and record.rung == "partial"
    # The record names the pipeline that decoded, as the result (built from it) does: partial's
    # settings (its VAE tiling and the block split), not full's that the denoise ran on.
    assert (record.dtype, record.compiled, record.quantized) == (
        result.dtype,
        result.compiled,
        result.quantized,
    )
    assert record.settings == result.settings
    assert any(note.name == "partial" for note in result.settings.applied), result.settings


def test_decode_oom_at_both_rungs_fails_naming_model_and_rung(
    redis_conn: Redis, make_settings: Any
) -> None:
    settings = make_settings(faults="oom@decode:full*2,oom@decode:partial")
    message, record = failed_drill(redis_conn, settings)
    assert "tiny-sd15 ran out of memory while decoding at rung partial" in message
    assert tried(record.attempts) == [
        ("full", "oom", "decode"),
        ("full", "oom", "decode"),
        ("partial", "oom", "decode"),
    ]
    assert record.steps_denoised == ONE_DENOISE[MODEL]


def test_a_pinned_rung_retries_the_decode_tiled_and_never_descends(
    redis_conn: Redis, make_settings: Any
) -> None:
    first = make_settings(memory_mode="full", faults="oom@decode:full")
    once, _ = drill(redis_conn, first)
    assert tried(once.attempts) == [("full", "oom", "decode"), ("full", "ok", "decode")]
    second_log = first.timings_log.with_name("second.jsonl")
    settings = make_settings(memory_mode="full", faults="oom@decode:full*2", timings_log=second_log)
    message, record = failed_drill(redis_conn, settings)
    assert "rung full (pinned by KILN_MEMORY_MODE=full)" in message
    assert tried(record.attempts) == [("full", "oom", "decode"), ("full", "oom", "decode")]
    assert record.steps_denoised == ONE_DENOISE[MODEL]


def test_the_count_sees_a_denoise_run_twice(
    redis_conn: Redis, make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counter the tests above hold to STEPS: an OOM at the last denoise step re-runs the
    whole try (the generating rule), and the record counts both runs' steps."""
    from worker.queue.job import RQJobContext

    progress = RQJobContext.progress
    fired: list[int] = []

    def oom_at_the_last_step(self: Any, phase: str, step: int, steps: int, *rest: Any) -> None:
        progress(self, phase, step, steps, *rest)
        if phase == "denoise" and step == steps and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("out of memory at the last step (test)")

    monkeypatch.setattr(RQJobContext, "progress", oom_at_the_last_step)
    result, record = drill(redis_conn, make_settings())
    assert tried(result.attempts) == [("full", "oom", "denoise"), ("full", "ok", None)]
    # The first run stopped at its STEPS-th denoiser call; the retry ran all of its own.
    assert record.steps_denoised == STEPS + ONE_DENOISE[MODEL]


def test_kiln_worker_drills_a_decode_oom_end_to_end(
    redis_conn: Redis, settings: Any, kiln_env: dict[str, str]
) -> None:
    """The operator's drill: `KILN_FAULTS=oom@decode:full*2 kiln worker --burst`."""
    handle = client_for(redis_conn, settings).submit(JOB)
    env = {**kiln_env, "KILN_FAULTS": "oom@decode:full*2"}
    done = kiln("worker", "--burst", "--models", MODEL, env=env, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = handle.wait(timeout=5)
    assert [a.outcome for a in result.attempts] == ["oom", "oom", "ok"]
    assert result.rung == "partial"
    [record] = records(settings.timings_log)
    assert record.status == "done" and record.steps_denoised == ONE_DENOISE[MODEL]
