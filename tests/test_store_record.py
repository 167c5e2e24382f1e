"""One timing record per job, also when a worker dies between finishing a job's files and
committing the job's end in Redis. Real `kiln worker` processes SIGKILL themselves at two points
(one fake each): the instant result.json is written, and as the job's end is committed
(LeaseKeeper.finish). A done job's record is published only after that commit, so neither dead
worker wrote one; a third worker takes both jobs over, answers them from the store and writes one
record each, with the phases of the render that wrote result.json."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis import Redis

from api_client import KilnClient
from tests.conftest import MANIFESTS
from tests.support.records import records
from tests.workers import DIES_AFTER_RESULT, DIES_AFTER_SAVE, WorkerProcess, wait_until

# Dies the instant result.json is on disk, before the job's end is committed.
# DIES_AFTER_SAVE dies as it commits the job's end (LeaseKeeper.finish).

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
        kiln_env, tmp_path / "early.log", "--models", "tiny-sd15", options=DIES_AFTER_RESULT
    )
    late = WorkerProcess(
        kiln_env, tmp_path / "late.log", "--models", "tiny-sdxl", options=DIES_AFTER_SAVE
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
        for job in (before, after):
            assert (out / job.id / "result.json").is_file()
        assert records(settings.timings_log) == []  # neither committed, so neither published
        rescuer = WorkerProcess(
            kiln_env, tmp_path / "rescuer.log", "--models", "tiny-sd15,tiny-sdxl"
        )
        rescuer.wait_ready(redis_conn)
        for job in (before, after):
            assert job.wait(timeout=120).images
        wait_until(lambda: len(records(settings.timings_log)) >= 2, 10, "the rescuer's records")
        # Each job's one record: the rescuer's, saying it was answered from the store and who
        # rendered it; its phases are the render's, recovered from result.json.
        for job, renderer in ((before, early), (after, late)):
            (recovered,) = [r for r in records(settings.timings_log) if r.job_id == job.id]
            shown = recovered.model_dump_json(include={"worker", "rendered_by", "answered_from"})
            print(f"\nrecovered from result.json: {shown}")
            assert recovered.answered_from == "store" and recovered.status == "done"
            assert recovered.worker == rescuer.name and recovered.rendered_by == renderer.name
            assert recovered.timings.denoise > 0 and recovered.timings.total > 0
            assert recovered.timings == job.result().timings  # type: ignore[union-attr]
    finally:
        for proc in (early, late, rescuer):
            if proc is not None:
                proc.stop()
