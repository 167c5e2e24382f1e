"""A quiet start: `kiln` commands that import the stack print none of its harmless import-time
notices (torchao's failed C-extension loads, torch's pytree deprecation, transformers'
torchvision fallback, diffusers' torchao serialization notice); what torchao failed to load is
said once, in doctor's torchao line and the worker's start record. And a submit before any
manifest is published says how to publish them."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from redis import Redis

from tests.conftest import kiln

# The notices as this stack prints them (kept apart from worker/quiet.py's own patterns).
NOISE = [
    re.compile(r"Failed to load .*torchao.*\.so"),
    re.compile(r"Detected no triton"),
    re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
    re.compile(r"requires torchvision \(not installed\)"),
    re.compile(r"Unable to import `torchao` Tensor objects"),
]


def noise_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(p.search(line) for p in NOISE)]


@pytest.fixture(scope="module")
def torchao_failures() -> list[str]:
    """What torchao says did not load when imported with no filter at all: the ground truth."""
    probe = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, format='%(name)s|%(message)s')\n"
        "import torchao, torchao.kernel.intmm\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    names = re.findall(r"^torchao\|Failed to load .*?/torchao/(_C\w*?)\.", out, re.M)
    if re.search(r"^torchao\.kernel\.intmm\|.*Detected no triton", out, re.M):
        names.append("triton")
    return names


def test_doctor_prints_no_stack_notices_and_names_what_torchao_did_not_load(
    kiln_env: dict[str, str], torchao_failures: list[str]
) -> None:
    shown = kiln("doctor", env=kiln_env, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert noise_in(shown.stderr) == [], shown.stderr
    (line,) = [line for line in shown.stdout.splitlines() if line.strip().startswith("torchao")]
    for name in torchao_failures:
        assert name in line, line
    assert ("not loaded:" in line) == bool(torchao_failures), line


def test_worker_start_is_quiet_and_its_record_names_what_torchao_did_not_load(
    redis_conn: Redis, kiln_env: dict[str, str], torchao_failures: list[str]
) -> None:
    shown = kiln("worker", "--burst", "--models", "tiny-sd15", env=kiln_env, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert noise_in(shown.stderr) == [], shown.stderr
    assert noise_in(shown.stdout) == [], shown.stdout
    records = [json.loads(line) for line in shown.stdout.splitlines() if line.startswith("{")]
    assert records and records[0]["event"] == "worker_started", shown.stdout
    assert records[0]["torchao_not_loaded"] == torchao_failures


def test_only_the_named_messages_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """Narrow: the same loggers' other records still reach handlers."""
    from worker import quiet

    quiet.install()
    quiet.install()  # twice is once
    assert sum(len(logging.getLogger(n.logger).filters) > 0 for n in quiet.NOTICES) == len(
        quiet.NOTICES
    )
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_fake.abi3.so: nope")
        logging.getLogger("torchao").warning("a real torchao problem")
        logging.getLogger("torch.utils._pytree").warning("another pytree warning")
    assert [r.getMessage() for r in caplog.records] == [
        "a real torchao problem",
        "another pytree warning",
    ]
    assert "_C_fake" in quiet.torchao_missing()


def test_a_submit_before_any_manifest_is_published_refuses_a_model_found_nowhere(
    redis_conn: Redis, kiln_env: dict[str, str], tmp_path: Path
) -> None:
    # Nothing published: the client reads the manifests kiln ships (and KILN_MANIFESTS'), so a
    # shipped model is known without a worker; one found in neither is refused in one line.
    empty = tmp_path / "no-manifests"
    empty.mkdir()
    env = {**kiln_env, "KILN_MANIFESTS": str(empty)}
    shown = kiln("submit", "a fox", "--model", "no-such-model", env=env)
    assert shown.returncode == 2, shown.stderr
    assert "no-such-model" in shown.stderr
    assert "unknown model; known: " in shown.stderr and "tiny-sd15" in shown.stderr
    assert noise_in(shown.stderr) == []
