"""`kiln replay IMAGE` renders an image again through the queue from the details it carries,
pinned to its rung and compile state, and reproduces it pixel for pixel on CPU; the request's
`rung` and `compile` pins are honoured by the worker or the job fails naming why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from redis import Redis

from api_client import RenderFailed, RequestRejected
from api_client.schema import RenderResult
from tests.conftest import kiln
from tests.support.images import pixels
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from tests.workers import WorkerProcess
from worker.files.details import read_details

MODEL = "tiny-sd15"
JOB = {"model": MODEL, "prompt": "a replayed fox", "steps": 2, "seed": 31}
# FLUX.1: guidance is its embedded guidance, true_cfg the second pass on the negative prompt;
# both away from the manifest's defaults, so a replay that dropped either would not match.
FLUX_JOB = {
    "model": "tiny-flux",
    "prompt": "a replayed fox",
    "negative_prompt": "blur",
    "steps": 2,
    "seed": 32,
    "guidance": 2.5,
    "true_cfg": 3.0,
}


def test_replay_reproduces_images_pixel_for_pixel_through_a_real_worker(
    kiln_env: dict[str, str], redis_conn: Redis, settings: Any, tmp_path: Path
) -> None:
    worker = WorkerProcess(kiln_env, tmp_path / "worker.log", "--models", f"{MODEL},tiny-flux")
    try:
        client = client_for(redis_conn, settings)
        for job in (JOB, {**FLUX_JOB, "num_images": 2}):
            original = client.submit(job).wait(timeout=240)
            last = original.images[-1]  # of a batch: the replay renders the batch again
            done = kiln("replay", last.path or "", "--wait", "--json", env=kiln_env, timeout=240)
            assert done.returncode == 0, done.stderr
            replayed = RenderResult.model_validate_json(done.stdout)
            assert replayed.job_id != original.job_id
            assert (replayed.rung, replayed.compiled, replayed.dtype) == (
                original.rung,
                original.compiled,
                original.dtype,
            )
            assert (replayed.guidance, replayed.true_cfg) == (original.guidance, original.true_cfg)
            assert (original.guidance, original.true_cfg) == (
                job.get("guidance", 7.0),
                job.get("true_cfg"),
            )
            for before, after in zip(original.images, replayed.images, strict=True):
                assert np.array_equal(pixels(before.path or ""), pixels(after.path or ""))
                # The details hold nothing job-specific: the same bytes, not only pixels.
                assert after.sha256 == before.sha256
            assert read_details(Path(last.path or "")).index == len(original.images) - 1
    finally:
        code, out = worker.terminate(timeout=60)
    assert code == 0, out[-3000:]


def test_replay_without_wait_queues_a_pinned_job(
    kiln_env: dict[str, str], redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    job = client.submit(JOB)
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    image = job.wait(timeout=30).images[0]
    done = kiln("replay", f"file://{image.path}", "--json", env=kiln_env)
    assert done.returncode == 0, done.stderr
    replay = client.job(json.loads(done.stdout)["job_id"])
    from rq.job import Job
    from rq.serializers import JSONSerializer

    queued = Job.fetch(replay.id, connection=redis_conn, serializer=JSONSerializer)
    assert (queued.kwargs["request"]["rung"], queued.kwargs["request"]["compile"]) == (
        "full",
        False,
    )
    human = kiln("replay", image.path or "", env=kiln_env)
    assert human.returncode == 0 and human.stdout.startswith("queued "), human.stderr


def test_replay_of_an_image_without_details_exits_2_naming_the_file(
    kiln_env: dict[str, str], redis_conn: Redis, tmp_path: Path
) -> None:
    plain = tmp_path / "someone-elses.png"
    Image.new("RGB", (128, 128)).save(plain)
    done = kiln("replay", str(plain), env=kiln_env)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"kiln replay: {plain}: carries no kiln details (no 'kiln' PNG chunk)"
    )
    missing = kiln("replay", str(tmp_path / "nowhere.png"), env=kiln_env)
    assert missing.returncode == 2 and "nowhere.png: not an image kiln can read" in missing.stderr
    remote = kiln("replay", "s3://bucket/job/0.png", env=kiln_env)
    assert remote.returncode == 2 and "reads a local file" in remote.stderr
    for run in (done, missing, remote):
        assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert redis_conn.keys("rq:job:*") == []


def test_replay_of_tampered_details_exits_2_naming_what_is_wrong(
    kiln_env: dict[str, str], redis_conn: Redis, settings: Any, tmp_path: Path
) -> None:
    client = client_for(redis_conn, settings)
    job = client.submit(JOB)
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    original = Path(job.wait(timeout=30).images[0].path or "")
    details = read_details(original).model_dump(mode="json")
    broken = {
        "steps": {**details, "steps": "two"},
        "limit": {**details, "steps": 999},
        "json": None,
    }
    expected = {
        "steps": "its kiln details are invalid: steps='two': Input should be a valid integer",
        "limit": "steps=999: must be between 1 and 50 (manifest max)",
        "json": "its kiln details are not valid JSON",
    }
    for name, data in broken.items():
        path = tmp_path / f"{name}.png"
        info = PngInfo()
        info.add_itxt("kiln", "{truncated" if data is None else json.dumps(data))
        with Image.open(original) as image:
            image.save(path, pnginfo=info)
        done = kiln("replay", str(path), env=kiln_env)
        assert done.returncode == 2, done.stdout
        line = done.stderr.strip()
        assert line.startswith(f"kiln replay: {path}: ") and expected[name] in line, line
        assert len(line.splitlines()) == 1
    assert redis_conn.keys("rq:job:*") == [f"rq:job:{job.id}".encode()]  # the original alone


# -- the request's pins, in the worker ------------------------------------------------------


def render(conn: Redis, settings: Any, **job: Any) -> RenderResult:
    handle = client_for(conn, settings).submit({**JOB, **job})
    burst(conn, make_renderer(settings, [MODEL]), [MODEL])
    return handle.wait(timeout=30)


def test_a_pinned_rung_renders_at_that_rung(redis_conn: Redis, settings: Any) -> None:
    result = render(redis_conn, settings, rung="model_offload")
    assert result.rung == "model_offload"
    [record] = records(settings.timings_log)
    assert record.rung == "model_offload"
    assert record.rung_reason == "pinned by the request (rung=model_offload)"


def test_pins_the_schema_or_manifest_rule_out_are_refused_at_submit(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    refusals = {
        "rung='bogus'": {"rung": "bogus"},
        "compile=True: compile runs only at rung full": {"rung": "group_offload", "compile": True},
        "compile='yes'": {"compile": "yes"},
    }
    for named, pins in refusals.items():
        with pytest.raises(RequestRejected, match=named) as refused:
            client.submit({**JOB, **pins})
        assert refused.value.problems[0].field in ("rung", "compile")
    assert redis_conn.keys("rq:job:*") == []


def test_out_of_memory_at_a_pinned_rung_fails_naming_rung_and_model(
    redis_conn: Redis, make_settings: Any
) -> None:
    settings = make_settings(faults="oom@load:full*2")
    with pytest.raises(RenderFailed) as failure:
        render(redis_conn, settings, rung="full")
    message = failure.value.message
    assert "model tiny-sd15 ran out of memory at rung full, which the request pins" in message
    [record] = records(settings.timings_log)
    assert [(a.rung, a.outcome) for a in record.attempts] == [("full", "oom"), ("full", "oom")]


@pytest.mark.parametrize(
    ("overrides", "pins", "why"),
    [
        (
            {"compile": "off"},
            {"compile": True},
            "the request pins compile on, but this worker's compile switch is off",
        ),
        (
            {"memory_mode": "model_offload"},
            {"rung": "full"},
            "the request pins rung full, but this worker is pinned to model_offload",
        ),
        (
            {"memory_mode": "group_offload"},
            {"compile": True},
            "the request pins compile on, but it runs at rung group_offload here",
        ),
    ],
)
def test_a_pin_this_worker_cannot_honour_fails_naming_why(
    redis_conn: Redis,
    make_settings: Any,
    overrides: dict[str, str],
    pins: dict[str, Any],
    why: str,
) -> None:
    settings = make_settings(**overrides)
    with pytest.raises(RenderFailed, match=f"model tiny-sd15: {why}"):
        render(redis_conn, settings, **pins)
    [record] = records(settings.timings_log)
    assert record.status == "failed" and record.attempts == []  # refused before loading


def test_a_compile_pin_unlike_the_resident_pipeline_reloads_it(
    redis_conn: Redis, make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake compile (Inductor on CPU takes minutes): the worker compiles by its policy, a job
    pinned eager reloads eager, the next unpinned job goes back to compiled, and a job pinned
    compiled takes the resident compiled pipeline as it is."""
    monkeypatch.setattr(
        "worker.pipelines.compile.compile_denoiser", lambda *_args, **_kw: "fake compile"
    )
    settings = make_settings(compile="on")
    client = client_for(redis_conn, settings)
    jobs = [
        client.submit({**JOB, "seed": seed, **pins})
        for seed, pins in [(1, {}), (2, {"compile": False}), (3, {}), (4, {"compile": True})]
    ]
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    assert [job.wait(timeout=30).compiled for job in jobs] == [True, False, True, True]
    assert [record.cold for record in records(settings.timings_log)] == [True, True, True, False]


def test_a_compile_pin_like_the_resident_pipeline_keeps_it(
    redis_conn: Redis, settings: Any
) -> None:
    """On CPU the worker loads eager anyway: compile=false and no pin share one pipeline."""
    client = client_for(redis_conn, settings)
    jobs = [client.submit({**JOB, "seed": s, **p}) for s, p in [(1, {}), (2, {"compile": False})]]
    jobs.append(client.submit({**JOB, "seed": 3}))
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    assert [job.wait(timeout=30).compiled for job in jobs] == [False, False, False]
    assert [record.cold for record in records(settings.timings_log)] == [True, False, False]
