"""Forged kiln:peaks entries (#28 item 7): a figure no card could hold is ignored, and a worker
waiting for memory reads the book again, so a forged need deleted from Redis stops blocking it.
A real `kiln worker` process, allowed 3 GB, over real Redis."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from redis import Redis

from api_client import KilnClient
from tests.conftest import MANIFESTS
from tests.support.fleet import blocked
from tests.workers import WorkerProcess, wait_until
from worker.memory.peaks import GB, KEY, PLAUSIBLE_GB, Peak, Shape, card_kind

MODEL = "tiny-sd15"
GOOD: dict[str, Any] = {"model": MODEL, "prompt": "ok", "steps": 2, "seed": 1}


def test_forged_peaks_are_ignored_or_read_again_once_deleted(
    redis_conn: Redis, kiln_env: dict[str, str], make_settings: Any, tmp_path: Path
) -> None:
    """A petabyte (no card's figure) is ignored outright. A plausible 5 GB need blocks a worker
    allowed 3 GB; once deleted from Redis, the same worker reads the book again and takes the
    job (it stayed blocked for good before: the book was read once per process)."""
    from worker.memory.device import probe

    card = card_kind(probe(make_settings()).name, None)
    shape = Shape(MODEL, 128, 128, "fp32", (), "txt2img")
    petabyte = Peak(resident_bytes=0, working_bytes=10**15, weights_bytes=GB, largest_bytes=GB)
    plausible = Peak(resident_bytes=0, working_bytes=5 * GB, weights_bytes=GB, largest_bytes=GB)
    forged = f"{card}|{shape.field}|group_offload"
    redis_conn.hset(KEY, f"{card}|{MODEL}|128x192|fp32|none|txt2img|group_offload",
                    petabyte.model_dump_json())  # fmt: skip
    redis_conn.hset(KEY, forged, plausible.model_dump_json())
    assert PLAUSIBLE_GB < 1e6  # a petabyte is 1e6 GB
    client = KilnClient(connection=redis_conn, manifests_dir=MANIFESTS)
    job = client.submit(GOOD)
    worker = WorkerProcess({**kiln_env, "KILN_VRAM_BUDGET_GB": "3"}, tmp_path / "w.log",
                           "--models", MODEL)  # fmt: skip
    try:
        worker.wait_ready(redis_conn)
        why = wait_until(
            lambda: blocked(redis_conn, worker.name), 60, "the worker to say it waits for memory"
        )
        assert f"{MODEL} needs 5.75 GB" in why, why  # the petabyte is not what it waits for
        assert job.status() == "queued"
        redis_conn.hdel(KEY, forged)
        started = time.monotonic()
        assert job.wait(timeout=60).model == MODEL
        print(f"\ntook the job {time.monotonic() - started:.1f} s after the forged peak went")
        assert worker.proc.poll() is None
        assert not blocked(redis_conn, worker.name)
        log = worker.output()
        assert log.count("kiln:peaks field") == 1 and "128x192" in log, log
        assert f"a real card's figures lie in 0..{PLAUSIBLE_GB:.0f} GB" in log
    finally:
        worker.stop()
