"""Faults a worker must survive: a job that outruns KILN_JOB_TIMEOUT_S, and an output directory
that cannot be written (no such directory possible, or a full disk). Each job fails with a clear
message, is not retried, and the worker takes the next job."""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from api_client import KilnClient, RenderFailed
from tests.fixtures.failing_disk import fails_writing
from tests.fixtures.gate import hold_here
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from tests.workers import SLOW_MODEL, slow_manifests
from worker.errors import JobDeadlineExceeded, OutputError, StoreUnavailable
from worker.files import output
from worker.render.context import LocalContext


def test_a_job_past_kiln_job_timeout_s_fails_and_the_next_one_runs(
    redis_conn: Redis, make_settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold_here(monkeypatch, lambda step: False)  # at denoise step 2 until the timeout ends it
    settings = make_settings(manifests=slow_manifests(tmp_path / "manifests"), job_timeout_s=3)
    # The quick job is a 128 px tiny-sd15 one (a 256 px tiny-slow step is ~16x that): under a
    # loaded CI machine one 256 px step came within the 3 s and failed the quick job too.
    models = [SLOW_MODEL, "tiny-sd15"]
    renderer = make_renderer(settings, models)
    # Load before the clock starts, so the timeout lands in the denoise loop, not in the load.
    for model in models:
        renderer.render(
            {"model": model, "prompt": "warm", "steps": 1}, LocalContext(f"warm-{model}")
        )
    client = KilnClient(connection=redis_conn, manifests_dir=settings.manifests)
    slow = client.submit({"model": SLOW_MODEL, "prompt": "too long", "steps": 50})  # asks for 600 s
    quick = client.submit({"model": "tiny-sd15", "prompt": "quick", "steps": 1})
    burst(redis_conn, renderer, models)

    with pytest.raises(RenderFailed, match="ran past its timeout of 3 s") as caught:
        slow.wait(timeout=1)
    assert caught.value.status == "failed"
    progress = slow.progress()
    assert progress is not None and progress.step < 50
    assert redis_conn.llen(f"rq:queue:kiln:{SLOW_MODEL}") == 0  # not retried
    assert quick.wait(timeout=1).steps == 1


def test_unwritable_output_dir_fails_the_job_clearly(
    redis_conn: Redis, make_settings: Any, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the output directory should be")
    settings = make_settings(output_dir=blocker, timings_log=tmp_path / "timings.jsonl")
    client = client_for(redis_conn, settings)
    job = client.submit({"model": "tiny-sd15", "prompt": "nowhere", "steps": 2})
    renderer = make_renderer(settings, ["tiny-sd15"])
    burst(redis_conn, renderer, ["tiny-sd15"])
    with pytest.raises(RenderFailed, match=f"cannot write images for job {job.id} under {blocker}"):
        job.wait(timeout=1)
    # The operator fixes the directory; the same worker process carries on.
    renderer.settings = make_settings(
        output_dir=tmp_path / "out2", timings_log=tmp_path / "timings.jsonl"
    )
    after = client.submit({"model": "tiny-sd15", "prompt": "somewhere", "steps": 2})
    burst(redis_conn, renderer, ["tiny-sd15"])
    assert Path(after.wait(timeout=1).images[0].path).is_file()


def test_full_disk_fails_the_job_clearly_and_leaves_no_partial_files(
    redis_conn: Redis, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0.png is written, 1.png finds the disk full: the job fails at once (a full disk waits for
    an operator, it does not heal in a retry) and none of its files stay, 0.png included."""
    client = client_for(redis_conn, settings)
    job = client.submit({"model": "tiny-sd15", "prompt": "full", "steps": 2, "num_images": 2})
    after = client.submit({"model": "tiny-sd15", "prompt": "after", "steps": 2})
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(output, "_write_atomic", fails_writing(job.id, "1.png", full))
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    with pytest.raises(RenderFailed, match="No space left on device") as caught:
        job.wait(timeout=1)
    assert caught.value.status == "failed"
    assert not (settings.output_dir / job.id).exists()  # no 0.png, no temp file, no directory
    assert after.wait(timeout=1).model == "tiny-sd15"
    assert [r.status for r in records(settings.timings_log)] == ["failed", "done"]
    assert (records(settings.timings_log)[0].error or "").startswith("OutputError: ")


@pytest.mark.parametrize(
    ("failing", "error", "raised"),
    [
        ("1.png", OSError(errno.ETIMEDOUT, "Connection timed out"), StoreUnavailable),
        ("1.png", JobDeadlineExceeded("ran past its timeout"), JobDeadlineExceeded),
        ("result.json", OSError(errno.ESTALE, "Stale file handle"), StoreUnavailable),
        ("result.json", OSError(errno.EACCES, "Permission denied"), OutputError),
    ],
    ids=["mount-timeout", "deadline", "stale-mount", "permission"],
)
def test_a_local_write_failing_mid_job_leaves_no_files(
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    failing: str,
    error: BaseException,
    raised: type[BaseException],
) -> None:
    """A network mount that timed out or went stale heals (StoreUnavailable: the queue puts the
    job back); a permission does not. Either way, and on a deadline, the job directory goes."""
    monkeypatch.setattr(output, "_write_atomic", fails_writing("mid-job", failing, error))
    renderer = make_renderer(settings, ["tiny-sd15"])
    with pytest.raises(raised) as caught:
        renderer.render(
            {"model": "tiny-sd15", "prompt": "mid", "steps": 2, "num_images": 2},
            LocalContext("mid-job"),
        )
    assert isinstance(caught.value, StoreUnavailable) == (raised is StoreUnavailable)
    if isinstance(caught.value, StoreUnavailable):
        assert caught.value.cause == str(error)
    assert not (settings.output_dir / "mid-job").exists()


def test_a_timeout_inside_a_guarded_step_still_ends_the_job(
    redis_conn: Redis, make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Previews (like compile fallbacks) catch Exception so they never fail a job; the job
    timeout must pass through them, or the job would run on unbounded."""
    import worker.render.generate as generate_module

    def stuck_preview(*_args: Any) -> None:
        time.sleep(30)  # the 2 s timeout lands in here

    monkeypatch.setattr(generate_module, "decode_preview", stuck_preview)
    settings = make_settings(job_timeout_s=4)
    renderer = make_renderer(settings, ["tiny-sd15"])
    renderer.render({"model": "tiny-sd15", "prompt": "warm", "steps": 1}, LocalContext("warm-up"))
    client = client_for(redis_conn, settings)
    stuck = client.submit({"model": "tiny-sd15", "prompt": "stuck", "steps": 8, "previews": True})
    quick = client.submit({"model": "tiny-sd15", "prompt": "quick", "steps": 1})
    started = time.monotonic()
    burst(redis_conn, renderer, ["tiny-sd15"])
    assert time.monotonic() - started < 25  # not the 30 s the preview would have slept
    with pytest.raises(RenderFailed, match="ran past its timeout of 4 s"):
        stuck.wait(timeout=1)
    assert quick.wait(timeout=1).steps == 1
    failed = [r for r in records(settings.timings_log) if r.job_id == stuck.id]
    assert [r.status for r in failed] == ["failed"] and "JobDeadlineExceeded" in (
        failed[0].error or ""
    )
