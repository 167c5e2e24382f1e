"""Secrets never printed: Redis passwords and store credentials in doctor, CLI errors and logs."""

from __future__ import annotations

import logging

from api_client.redact import redact
from tests.conftest import kiln
from worker.logs import Redactor

REDIS_PASSWORD = "hunter2-redis-password"
AWS_SECRET = "aws-secret-key-do-not-print-0123"


def test_doctor_and_cli_errors_redact_redis_password_and_store_secret(
    kiln_env: dict[str, str],
) -> None:
    env = {
        **kiln_env,
        "KILN_REDIS_URL": f"redis://kiln:{REDIS_PASSWORD}@127.0.0.1:1/0",
        "KILN_OUTPUT_URL": "s3://studio-renders/kiln",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_ACCESS_KEY_ID": "kiln-access-key",
        "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
    }
    doctor = kiln("doctor", env=env, timeout=180)
    assert "UNREACHABLE at redis://***@127.0.0.1:1/0" in doctor.stdout, doctor.stdout
    assert "s3://studio-renders/kiln at http://127.0.0.1:9000; access key set" in doctor.stdout
    submit = kiln("submit", "a fox", "--model", "tiny-sd15", env=env)
    assert "cannot reach Redis at redis://***@127.0.0.1:1/0" in submit.stderr, submit.stderr
    for done in (doctor, submit):
        for secret in (REDIS_PASSWORD, AWS_SECRET):
            assert secret not in done.stdout + done.stderr


def test_log_records_and_structlog_events_are_redacted() -> None:
    redactor = Redactor([AWS_SECRET])
    record = logging.LogRecord(
        "rq.worker", logging.WARNING, __file__, 1, "connecting to %s with %s", None, None
    )
    record.args = (f"rediss://user:{REDIS_PASSWORD}@h:6380/0", AWS_SECRET)
    assert redactor.filter(record)
    assert record.getMessage() == "connecting to rediss://***@h:6380/0 with ***"
    event = redactor(None, "info", {"event": "x", "error": f"failed with key {AWS_SECRET}"})
    assert event["error"] == "failed with key ***"
    signed = "https://s3/b/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=abcdef&x=1"
    assert redact(signed) == "https://s3/b/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1"


def test_a_worker_refuses_to_start_on_a_bad_store_or_webhooks_naming_it(
    kiln_env: dict[str, str],
) -> None:
    bad_store = kiln("worker", "--burst", env={**kiln_env, "KILN_OUTPUT_URL": "s3://"})
    assert bad_store.returncode == 1
    assert "KILN_OUTPUT_URL 's3://' is not s3://bucket[/prefix]" in bad_store.stdout
    hooks = '{"studio": {"url": "http://h/x", "secret": "short-secret"}}'
    bad_hooks = kiln("worker", "--burst", env={**kiln_env, "KILN_WEBHOOKS": hooks})
    assert bad_hooks.returncode == 1
    assert "KILN_WEBHOOKS target 'studio': secret" in bad_hooks.stdout
    assert "short-secret" not in bad_hooks.stdout + bad_hooks.stderr
