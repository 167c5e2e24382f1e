"""`kiln doctor` through the real command line: device, memory, dtypes, attention, compile,
torchao and Redis, plus the switch report of an actual load; failures exit 1."""

from __future__ import annotations

from tests.conftest import kiln


def test_doctor_reports_the_machine_and_a_models_switches(kiln_env: dict[str, str]) -> None:
    done = kiln("doctor", "--model", "tiny-sd3", env=kiln_env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for expected in (
        "backend       cpu (cpu)",
        "GB free",
        "bf16 no, fp16 no",
        "sdpa kernels: math yes",
        "KILN_COMPILE=auto -> off (auto: CPU)",
        "int8: ok",
        "float8: skipped (float8 needs a CUDA or ROCm device",
        "redis         reachable at",
        "model tiny-sd3",
        "rung          full",
        "applied       quantize:text_encoder_3: torchao int8 on",
        "applied       taesd_preview:",
        "skipped       compile: auto: off on CPU",
    ):
        assert expected in out, f"{expected!r} missing from:\n{out}"


def test_doctor_load_descends_on_a_drilled_oom(kiln_env: dict[str, str]) -> None:
    env = {**kiln_env, "KILN_FAULTS": "oom@load:full"}
    done = kiln("doctor", "--model", "tiny-sd15", env=env)
    assert done.returncode == 0, done.stderr
    assert "attempts      full: out of memory (KILN_FAULTS drill" in done.stdout
    assert "rung          partial" in done.stdout  # one rung down from full


def test_doctor_exits_1_when_redis_is_unreachable(kiln_env: dict[str, str]) -> None:
    env = {**kiln_env, "KILN_REDIS_URL": "redis://127.0.0.1:1/0"}
    done = kiln("doctor", env=env)
    assert done.returncode == 1
    assert "UNREACHABLE at redis://127.0.0.1:1/0" in done.stdout
    # Without a model it still shows how every switch is set.
    assert "switches      sdpa=auto, channels_last=auto" in done.stdout


def test_doctor_shows_configured_switches(kiln_env: dict[str, str]) -> None:
    done = kiln("doctor", env={**kiln_env, "KILN_VAE_TILING": "on"})
    assert done.returncode == 0, done.stderr
    assert "vae_tiling=on" in done.stdout and "kiln doctor --model ID" in done.stdout
    # The warm-switch settings, and why this CPU reads nothing ahead (KILN_PREFETCH=auto).
    assert (
        "model cache   RAM 8 GB, on the device no limit but memory; read ahead off (auto: the"
        " device is this host's CPU, where a read takes the render's cores)" in done.stdout
    )
