"""The fleet's compile cache (worker/pipelines/compile_cache.py): bundles in a real Redis, filled by
a stand-in compile (tests/fixtures/fake_compile.py) in the fast tests, and by real torch.compile
in two `kiln worker` processes with separate empty Inductor caches in the slow one."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis import Redis

from tests.conftest import kiln
from tests.fixtures.fake_compile import compile_or_load, graph_files
from tests.support.images import pixels
from tests.support.inprocess import client_for
from tests.support.records import records
from tests.workers import wait_until
from worker.ops.doctor import fleet_line
from worker.pipelines.compile_cache import (
    INDEX_KEY,
    PREFIX,
    SIZES_KEY,
    CompileCache,
    CompileKey,
    CompileRun,
)

MB = 2**20


def key(shape: str = "128x128 x1 cfg=on txt2img plain", device: str = "cpu: test") -> CompileKey:
    return CompileKey(
        "2.13.0+abc",
        device,
        "tiny-sd15 x@- variant=- q=",
        "fp32",
        "full",
        "regional dynamic=None",
        shape,
    )


def cache(conn: Redis | None, root: Path, limit: int = 64 * MB, ttl: int = 3600) -> CompileCache:
    root.mkdir(parents=True, exist_ok=True)
    return CompileCache(conn, limit, ttl, root=root)


def job(fleet: CompileCache, k: CompileKey | None, *graphs: str) -> CompileRun:
    """One try of a job as the renderer runs it: start, the graphs (each compiled or loaded from
    the local cache), finish."""
    run = fleet.start(k)
    for graph in graphs or ("1",):
        compile_or_load(fleet.directory, graph)
    fleet.finish(run)
    return run


def test_a_fresh_worker_loads_what_another_compiled_and_says_fleet(
    redis_conn: Redis, tmp_path: Path
) -> None:
    first = job(cache(redis_conn, tmp_path / "a"), key())
    assert (first.source, first.seconds, first.fetched) == ("cold", 2.0, False)
    assert redis_conn.zcard(INDEX_KEY) == 1
    fresh = cache(redis_conn, tmp_path / "b")
    second = job(fresh, key())
    assert (second.source, second.seconds, second.fetched) == ("fleet", 0.2, True)
    for name in graph_files("1")[:3]:  # every file but the lock, byte for byte
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes()
    assert not (tmp_path / "b" / "locks").exists()
    # The compiling worker restarted on its own disk: local, nothing fetched.
    again = job(cache(redis_conn, tmp_path / "a"), key())
    assert (again.source, again.fetched) == ("local", False)


def test_another_key_finds_nothing_and_compiles_cold(redis_conn: Redis, tmp_path: Path) -> None:
    job(cache(redis_conn, tmp_path / "a"), key())
    for other in (key(shape="192x128 x1 cfg=on txt2img plain"), key(device="cuda: H100")):
        run = job(cache(redis_conn, tmp_path / other.digest), other, "2")
        assert (run.source, run.fetched) == ("cold", False)
    assert redis_conn.zcard(INDEX_KEY) == 3


def test_a_job_that_compiles_nothing_has_no_source(redis_conn: Redis, tmp_path: Path) -> None:
    fleet = cache(redis_conn, tmp_path / "a")
    run = fleet.start(key())
    fleet.finish(run)
    assert (run.source, run.seconds) == (None, 0.0)
    eager = job(fleet, None)  # an uncompiled pipeline: never looked up, never shared
    assert eager.source is None and redis_conn.zcard(INDEX_KEY) == 0


def test_a_later_graph_of_the_same_key_joins_its_bundle(redis_conn: Redis, tmp_path: Path) -> None:
    """A worker whose fleet bundle lacked a graph compiles it and shares the union."""
    job(cache(redis_conn, tmp_path / "a"), key(), "1")
    run = job(cache(redis_conn, tmp_path / "b"), key(), "1", "2")
    assert run.source == "cold" and run.fetched
    meta = json.loads(redis_conn.hget(PREFIX + key().digest, "meta") or b"")
    assert set(meta["files"]) == {n for n in graph_files("1") + graph_files("2") if "lock" not in n}
    both = job(cache(redis_conn, tmp_path / "c"), key())
    assert both.source == "fleet" and (tmp_path / "c" / "zv/czv2.so").exists()


def _forge(conn: Redis, k: CompileKey, meta: dict[str, object], files: dict[str, bytes]) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    blob = buffer.getvalue()
    header = {
        "format": 1,
        "key": k.__dict__,
        "files": list(files),
        "sha256": hashlib.sha256(blob).hexdigest(),
        **meta,
    }
    conn.hset(PREFIX + k.digest, mapping={"meta": json.dumps(header), "tar": blob})


@pytest.mark.parametrize(
    ("meta", "files"),
    [
        ({"key": {"torch": "another build"}}, {"zv/czv1.so": b"x"}),  # header of another key
        ({"sha256": "0" * 64}, {"zv/czv1.so": b"x"}),  # bytes not the header's
        ({"format": 99}, {"zv/czv1.so": b"x"}),
        ({}, {"../escaped.so": b"x"}),  # a file outside the cache directory
        ({}, {"/tmp/absolute.so": b"x"}),
    ],
    ids=["key", "sha256", "format", "dotdot", "absolute"],
)
def test_a_bundle_this_worker_must_not_trust_is_never_unpacked(
    redis_conn: Redis, tmp_path: Path, meta: dict[str, object], files: dict[str, bytes]
) -> None:
    _forge(redis_conn, key(), meta, files)
    root = tmp_path / "cache" / "inductor"
    run = job(cache(redis_conn, root), key())
    assert (run.source, run.fetched) == ("cold", False)
    assert not (tmp_path / "cache" / "escaped.so").exists()
    assert not Path("/tmp/absolute.so").exists()
    assert (root / "zv/czv1.so").read_bytes() != b"x"


def test_bundles_are_bounded_in_bytes_least_recently_used_out(
    redis_conn: Redis, tmp_path: Path
) -> None:
    probe = cache(redis_conn, tmp_path / "probe")
    job(probe, key(shape="probe"))
    size = int(redis_conn.hget(SIZES_KEY, key(shape="probe").digest) or 0)
    assert size > 0
    redis_conn.delete(PREFIX + key(shape="probe").digest)  # expired: pruned at the next trim
    shapes = ["s1", "s2", "s3"]
    fleet = cache(redis_conn, tmp_path / "a", limit=int(size * 2.5))
    for n, shape in enumerate(shapes):
        job(fleet, key(shape=shape), str(n + 3))
    kept = {k.decode() for k in redis_conn.zrange(INDEX_KEY, 0, -1)}
    assert kept == {key(shape="s2").digest, key(shape="s3").digest}
    assert not redis_conn.exists(PREFIX + key(shape="s1").digest)
    stored = sum(int(redis_conn.hget(SIZES_KEY, key(shape=s).digest) or 0) for s in ("s2", "s3"))
    assert fleet.stats() == {"entries": 2, "bytes": stored} and stored <= size * 2.5
    assert 0 < redis_conn.ttl(PREFIX + key(shape="s3").digest) <= 3600


def test_a_bundle_over_the_whole_limit_is_not_shared(redis_conn: Redis, tmp_path: Path) -> None:
    run = job(cache(redis_conn, tmp_path / "a", limit=100), key())
    assert run.source == "cold"
    assert redis_conn.zcard(INDEX_KEY) == 0 and not redis_conn.keys(f"{PREFIX}*")


@pytest.mark.parametrize("conn", [None, "limit 0"])
def test_sharing_off_still_says_cold_or_local(
    redis_conn: Redis, tmp_path: Path, conn: str | None
) -> None:
    connection, limit = (None, MB) if conn is None else (redis_conn, 0)
    fleet = CompileCache(connection, limit, 3600, root=tmp_path)
    assert job(fleet, key()).source == "cold"
    assert job(CompileCache(connection, limit, 3600, root=tmp_path), key()).source == "local"
    assert redis_conn.dbsize() == 0


@pytest.mark.slow
def test_two_workers_with_empty_caches_compile_once_per_fleet(
    redis_conn: Redis, kiln_env: dict[str, str], settings: Any, tmp_path: Path
) -> None:
    """Worker a compiles cold and shares; worker b, its own empty Inductor cache on the same
    Redis, loads a's bundle (fleet: every graph it compiles hits a cache, so nothing is built)
    to the same pixels; a again, on its own disk, is local. Each is a fresh `kiln worker
    --burst` process. How much less b spends is the benchmarks' to say (bench/coldstart.py,
    bench/RESULTS.md: 5.8x on a quiet machine); here, beside the other slow tests, only that it
    spent less."""
    env = {k: v for k, v in kiln_env.items() if not k.startswith("TORCHINDUCTOR")}
    client = client_for(redis_conn, settings)
    request = {"model": "tiny-sd15", "prompt": "fleet", "steps": 2, "seed": 5}
    results = []
    for cache_dir in ("a", "b", "a"):
        job = client.submit(request)
        run_env = {
            **env,
            "KILN_COMPILE": "on",
            "KILN_INDUCTOR_CACHE_DIR": str(tmp_path / cache_dir),
        }
        done = kiln("worker", "--burst", "--models", "tiny-sd15", env=run_env, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        results.append(job.wait(timeout=10))
    cold, fleet, local = wait_until(
        lambda: (
            [r for r in records(settings.timings_log) if r.status == "done"][-3:]
            if len(records(settings.timings_log)) >= 3
            else None
        ),
        30,
        "three timing records",
    )
    assert [r.compile_source for r in (cold, fleet, local)] == ["cold", "fleet", "local"]
    assert all(r.compiled for r in (cold, fleet, local))
    assert 0 < fleet.compile_s < cold.compile_s, (cold.compile_s, fleet.compile_s)
    first, *others = [pixels(r.images[0].path or "") for r in results]
    assert all(np.array_equal(first, other) for other in others)
    assert CompileCache(redis_conn, MB, 60).stats()["entries"] == 1


def test_doctor_shows_the_shared_cache(
    redis_conn: Redis, kiln_env: dict[str, str], tmp_path: Path, settings: Any
) -> None:
    job(cache(redis_conn, tmp_path / "a"), key())
    size = int(redis_conn.hget(SIZES_KEY, key().digest) or 0)
    done = kiln("doctor", "--json", env=kiln_env)
    stats = json.loads(done.stdout)["fleet_compile"]
    assert stats == {"entries": 1, "bytes": size}
    text = fleet_line(stats, settings.model_copy(update={"compile_cache_ttl_s": 86400}))
    assert text == (
        f"1 compile bundle(s), {size / MB:.1f} MiB of 1024 MiB (KILN_COMPILE_CACHE_MB),"
        " each kept 1 day(s) from its last use"
    )
    off = fleet_line(stats, settings.model_copy(update={"compile_cache_mb": 0}))
    assert off == "off (KILN_COMPILE_CACHE_MB=0); 1 bundle(s) left in Redis"


def test_only_a_keys_first_job_in_a_process_is_looked_up_and_shared(
    redis_conn: Redis, tmp_path: Path
) -> None:
    """Later jobs of a key cost no directory walk: a graph a guard makes them build is this
    worker's alone (the key already covers size, batch, guidance, mode and adapters)."""
    fleet = cache(redis_conn, tmp_path / "a")
    assert job(fleet, key(), "1").source == "cold"
    later = job(fleet, key(), "2")
    assert later.source == "cold" and later.files_before == set()
    meta = json.loads(redis_conn.hget(PREFIX + key().digest, "meta") or b"")
    assert not any("2" in name.split("/")[-1] for name in meta["files"])


@pytest.mark.parametrize("header", [b"{not json", b"[1, 2]", b'{"files": "zv/czv1.so"}'])
def test_a_header_that_is_not_kilns_costs_a_compile_not_the_job(
    redis_conn: Redis, tmp_path: Path, header: bytes
) -> None:
    redis_conn.hset(PREFIX + key().digest, mapping={"meta": header, "tar": b"x"})
    run = job(cache(redis_conn, tmp_path / "a"), key())
    assert (run.source, run.fetched) == ("cold", False)


def test_a_redis_that_refuses_the_bundle_costs_a_compile_not_the_job(
    redis_conn: Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The index retyped under the worker (a hostile or mistaken write): the share fails with
    WRONGTYPE, is logged, and the job's accounting stands."""
    redis_conn.set(INDEX_KEY, "not a sorted set")
    run = job(cache(redis_conn, tmp_path / "a"), key())
    assert run.source == "cold"
    assert "compile bundle of tiny-sd15" in caplog.text and "WRONGTYPE" in caplog.text


def test_compile_seconds_are_counted_by_source_for_prometheus() -> None:
    from prometheus_client import REGISTRY

    from worker.queue.upkeep.metrics import observe
    from worker.render.timings import TimingRecord

    labels = {"model": "tiny-compile-metric", "source": "fleet"}

    def value() -> float:
        return REGISTRY.get_sample_value("kiln_compile_seconds_total", labels) or 0.0

    before = value()
    observe(
        TimingRecord(
            job_id="j1", model=labels["model"], status="done", compile_s=2.5, compile_source="fleet"
        )
    )
    observe(TimingRecord(job_id="j2", model=labels["model"], status="done"))  # compiled nothing
    assert value() - before == 2.5
