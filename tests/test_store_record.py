"""One timing record per job, also when a worker dies between finishing a job's files and telling
Redis. Real `kiln worker` processes SIGKILL themselves at two points (one fake each): right after
result.json, before the timing record; and after the record, before Redis heard of the job. A
third worker takes both jobs over and answers them from the store."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis import Redis

from api_client import KilnClient
from tests.conftest import MANIFESTS
from tests.helpers import records
from tests.workers import DIES_AFTER_SAVE, Fake, WorkerProcess, wait_until

# Dies the instant result.json is on disk: the render's timing record was never written.
DIES_AFTER_RESULT = Fake("tests.fixtures.dies_after_result_worker")
# DIES_AFTER_SAVE dies after the job's record was written, before Redis heard it finished.

REQUEST = {"prompt": "a fox", "steps": 2, "seed": 3}


@pytest.mark.slow
def test_a_job_answered_from_the_store_has_exactly_one_record(
    redis_conn: Redis,
    kiln_env: dict[str, str],
    settings,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    client = KilnClient(connection=redis_conn, manifests_dir=MANIFESTS)
    early = WorkerProcess(
        kiln_env, tmp_path / "early.log", "--models", "tiny-sd15", fake=DIES_AFTER_RESULT
    )
    late = WorkerProcess(
        kiln_env, tmp_path / "late.log", "--models", "tiny-sdxl", fake=DIES_AFTER_SAVE
    )
    rescuer = None
    try:
        early.wait_ready(redis_conn)
        late.wait_ready(redis_conn)
        before = client.submit({**REQUEST, "model": "tiny-sd15"})
        after = client.submit({**REQUEST, "model": "tiny-sdxl"})
        for proc in (early, late):
            assert proc.wait(timeout=120) == -9, proc.output()
        out = Path(settings.output_dir)
        assert (out / before.id / "result.json").is_file()
        assert [r.job_id for r in records(settings.timings_log)] == [after.id]
        rescuer = WorkerProcess(
            kiln_env, tmp_path / "rescuer.log", "--models", "tiny-sd15,tiny-sdxl"
        )
        rescuer.wait_ready(redis_conn)
        for job in (before, after):
            assert job.wait(timeout=120).images
        wait_until(lambda: len(records(settings.timings_log)) >= 2, 10, "the rescuer's record")
        by_job = {
            job.id: [r for r in records(settings.timings_log) if r.job_id == job.id]
            for job in (before, after)
        }
        # Killed before its record: the rescuer writes the render's own record, recovered from
        # result.json, saying it was answered from the store; its phases are the render's.
        (recovered,) = by_job[before.id]
        shown = recovered.model_dump_json(include={"worker", "answered_from", "timings"})
        print(f"\nrecovered from result.json: {shown}")
        assert recovered.answered_from == "store" and recovered.status == "done"
        assert recovered.worker == early.name
        assert recovered.timings.denoise > 0 and recovered.timings.total > 0
        assert recovered.timings == before.result().timings  # type: ignore[union-attr]
        # Killed after its record: the rescuer answers from the store and writes no second one.
        (rendered,) = by_job[after.id]
        assert rendered.answered_from == "render" and rendered.worker == late.name
        assert rendered.timings.denoise > 0
    finally:
        for proc in (early, late, rescuer):
            if proc is not None:
                proc.stop()
