"""The command line and the client's import surface, as a user meets them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.conftest import ROOT, kiln
from tests.support.inprocess import client_for
from tests.support.records import records
from tests.workers import WorkerProcess, wait_until
from worker.pipelines.tiny import TINY_FAMILIES

NEW_FAMILIES = ["tiny-flux", "tiny-flux2", "tiny-qwenimage", "tiny-zimage"]

NO_TORCH = """import sys
try:
    {code}
except SystemExit:
    pass
print([m for m in {modules!r} if m in sys.modules])
"""
HEAVY = ("torch", "diffusers", "transformers", "yaml")
WEB = ("fastapi", "starlette", "uvicorn")


@pytest.mark.parametrize(
    "code",
    [
        "import api_client",
        "from worker.cli import main; main(['--help'])",
        "from worker.cli import main; main(['api', '--help'])",
        "import worker.settings",
        "from api_client.http.tokens import Tokens",
    ],
    ids=["import api_client", "kiln --help", "kiln api --help", "settings", "kiln api token"],
)
def test_light_paths_never_import_torch_or_the_web_framework(code: str) -> None:
    assert loaded_by(code) == "[]"


def loaded_by(code: str) -> str:
    """Which of HEAVY and WEB a fresh interpreter has loaded after running code."""
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH.format(code=code, modules=HEAVY + WEB)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_gateway_loads_its_web_framework_and_never_torch() -> None:
    """The probe above sees the framework once the gateway is built: it is not vacuous."""
    code = (
        "from api_client.http.app import create_app\n    "
        "from api_client.http.settings import ApiSettings\n    "
        "create_app(ApiSettings())"
    )
    assert loaded_by(code) == str(["fastapi", "starlette"])


def test_submit_rejects_with_a_message_naming_field_value_and_limit(
    kiln_env: dict[str, str], redis_conn: Redis
) -> None:
    done = kiln("submit", "a fox", "--model", "tiny-sd15", "--steps", "99", env=kiln_env)
    assert done.returncode == 2
    assert "steps=99" in done.stderr and "50" in done.stderr
    assert redis_conn.keys("rq:job:*") == []


def test_submit_takes_true_cfg_and_refuses_a_negative_prompt_it_would_ignore(
    kiln_env: dict[str, str], redis_conn: Redis
) -> None:
    base = ("submit", "a fox", "--model", "tiny-flux", "--negative-prompt", "blur")
    refused = kiln(*base, env=kiln_env)
    assert refused.returncode == 2
    assert "negative_prompt" in refused.stderr and "needs true_cfg above 1" in refused.stderr
    assert redis_conn.keys("rq:job:*") == []
    queued = kiln(*base, "--true-cfg", "3", "--json", env=kiln_env)
    assert queued.returncode == 0, queued.stderr
    job_id = json.loads(queued.stdout)["job_id"]
    from rq.job import Job
    from rq.serializers import JSONSerializer

    stored = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
    assert stored.kwargs["request"]["true_cfg"] == 3.0


def test_submit_wait_json_through_a_real_worker_process(
    kiln_env: dict[str, str], redis_conn: Redis, settings: Any, tmp_path: Path
) -> None:
    worker = WorkerProcess(kiln_env, tmp_path / "worker.log", "--models", "tiny-sd15")
    try:
        # --wait refuses to wait on a model no live worker serves: this one is up first.
        wait_until(lambda: client_for(redis_conn, settings).workers(), 120, "the worker to start")
        submit = ("submit", "a red fox", "--model", "tiny-sd15", "--steps", "3", "--seed", "5")
        waiting = ("--wait", "--timeout", "120")
        done = kiln(*submit, *waiting, "--json", env=kiln_env, timeout=180)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["model"] == "tiny-sd15" and result["seed"] == 5 and result["steps"] == 3
        assert Path(result["images"][0]["path"]).is_file()
        human = kiln(*submit, *waiting, env=kiln_env, timeout=180)
        assert human.returncode == 0, human.stderr
        assert "done" in human.stdout and result["images"][0]["sha256"][:16] in human.stdout
        models = kiln("models", "--json", env=kiln_env)
        [tiny] = [m for m in json.loads(models.stdout) if m["id"] == "tiny-sd15"]
        assert tiny["workers"] and tiny["resident_on"] == tiny["workers"]
    finally:
        code, out = worker.terminate(timeout=60)
    assert code == 0, out
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    timing = [line for line in lines if line.get("event") == "job_timing"]
    assert len(timing) == 2 and all(line["status"] == "done" for line in timing)


def test_the_new_families_render_through_kiln_worker_burst(
    kiln_env: dict[str, str], redis_conn: Redis, settings: Any
) -> None:
    """FLUX.1, FLUX.2 klein, Qwen-Image and Z-Image through `kiln worker --burst`: one full
    record each, with every phase, the rung, the dtype and why, and the quantization picked."""
    client = client_for(redis_conn, settings)
    jobs = {
        model: client.submit({"model": model, "prompt": "a red fox", "seed": 3})
        for model in NEW_FAMILIES
    }
    steered = client.submit(
        {"model": "tiny-flux", "prompt": "a fox", "negative_prompt": "blur", "true_cfg": 3.0}
    )
    done = kiln("worker", "--burst", "--models", ",".join(NEW_FAMILIES), env=kiln_env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    by_job = {record.job_id: record for record in records(settings.timings_log)}
    for model, job in [*jobs.items(), ("tiny-flux", steered)]:
        record = by_job[job.id]
        assert (record.status, record.model, record.rung, record.dtype) == (
            "done",
            model,
            "full",
            "fp32",
        )
        t = record.timings
        assert min(t.text_encode, t.denoise, t.decode, t.image_encode) > 0, model
        result = job.wait(timeout=5)
        assert [(i.width, i.height) for i in result.images] == [(128, 128)]
        assert any(
            n.name == "precision" and "fp32 on CPU" in n.reason for n in result.settings.applied
        )
    # transformer: [float8, int8]: no fp8 math on a CPU, so int8, for real.
    for model in ("tiny-flux", "tiny-qwenimage"):
        assert by_job[jobs[model].id].quantized == {"transformer": "int8"}
    assert (steered.wait(timeout=5).true_cfg, jobs["tiny-flux"].wait(timeout=5).true_cfg) == (
        3.0,
        1.0,
    )


def test_manifests_publish_then_client_validates_against_redis(
    kiln_env: dict[str, str], redis_conn: Redis
) -> None:
    done = kiln("manifests", "publish", env=kiln_env)
    assert done.returncode == 0, done.stderr
    assert redis_conn.hexists("kiln:manifests", "tiny-sd3")


@pytest.mark.slow  # every tiny model again in a subprocess (~17 s); the suite's own build is tested
def test_tiny_models_verb_builds_into_a_directory(tmp_path: Path, kiln_env: dict[str, str]) -> None:
    started = time.perf_counter()
    done = kiln("tiny-models", str(tmp_path / "m"), env=kiln_env)
    assert done.returncode == 0, done.stderr
    for family in TINY_FAMILIES:
        assert (tmp_path / "m" / f"tiny-{family}" / "model_index.json").is_file()
    assert (tmp_path / "m" / "tiny-upscaler" / "tiny-upscaler-x2.safetensors").is_file()
    assert time.perf_counter() - started < 120  # generous: a cold interpreter imports diffusers


def test_unreachable_redis_is_one_clear_line_without_the_password(kiln_env: dict[str, str]) -> None:
    env = {**kiln_env, "KILN_REDIS_URL": "redis://kiln:s3cret@127.0.0.1:1/0"}
    for verb in (("models",), ("submit", "a fox", "--model", "tiny-sd15")):
        done = kiln(*verb, env=env)
        assert done.returncode == 1, done.stderr
        assert f"kiln {verb[0]}: cannot reach Redis at redis://***@127.0.0.1:1/0" in done.stderr
        assert "s3cret" not in done.stderr and "Traceback" not in done.stderr
