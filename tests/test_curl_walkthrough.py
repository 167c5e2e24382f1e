"""docs/curl.md, run: its ```sh id=walkthrough block is taken from the markdown and run by bash
with the real curl and openssl, against a real `kiln api` (the gateway fixture), a real worker
(a burst worker in this process, started once the script is following a queued job) and a live
webhook receiver that saves each delivery to files, which the script verifies with openssl. The
doc cannot drift from what the gateway does: if the walkthrough breaks, this test fails."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from api_client import keys
from api_client.http.tokens import Tokens
from tests.conftest import ROOT
from tests.fixtures.gateway import call
from tests.support.inprocess import burst, make_renderer
from tests.support.receivers import SECRET, SavingReceiver, targets

DOC = ROOT / "docs" / "curl.md"
BLOCK = re.compile(r"^```sh id=walkthrough\n(.*?)^```$", re.S | re.M)
MODEL = "tiny-sd15"
SCRIPT_TIMEOUT_S = 240.0


def walkthrough() -> str:
    """The script in docs/curl.md: its one ```sh id=walkthrough block."""
    found = BLOCK.findall(DOC.read_text(encoding="utf-8"))
    assert len(found) == 1, f"{DOC} has {len(found)} walkthrough blocks, not one"
    return str(found[0])


def test_the_curl_walkthrough_runs_as_written(
    gateway: Any, redis_conn: Redis, make_settings: Any, kiln_env: dict[str, str], tmp_path: Path
) -> None:
    for tool in ("curl", "openssl", "bash"):
        if shutil.which(tool) is None:
            pytest.skip(f"docs/curl.md needs {tool}, which is not on PATH")
    script = walkthrough()
    hooks_dir = tmp_path / "hooks"
    hooks_dir.mkdir()
    receiver = SavingReceiver(hooks_dir)
    receiver.start()
    settings = make_settings(webhooks=targets(receiver.url))
    renderer = make_renderer(settings, [MODEL])
    # An idle pass publishes what a serving worker publishes (its manifests, store and webhook
    # target names): the gateway validates the script's requests against them.
    burst(redis_conn, renderer, [MODEL])

    work = tmp_path / "walkthrough"
    work.mkdir()
    log = tmp_path / "walkthrough.log"
    env = {
        **kiln_env,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "KILN_URL": gateway.url,
        "MODEL": MODEL,
        "WEBHOOK": "studio",
        "WEBHOOK_SECRET": SECRET,
        "HOOK_DIR": str(hooks_dir),
    }
    queue = keys.rq_queue_key(keys.queue_name(MODEL))
    rendered = 0
    started = time.monotonic()
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", script], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT
            )
            try:
                while proc.poll() is None:
                    assert time.monotonic() - started < SCRIPT_TIMEOUT_S, "the walkthrough hung"
                    # Render a job once it is queued and the script is following it with curl -N,
                    # so the events arrive on an open stream, not only as a replay.
                    following = log.read_text(errors="replace").count("\nfollowing ")
                    if redis_conn.llen(queue) and following > rendered:
                        # Not a gate: a stream opened late replays from its start, so the
                        # walkthrough passes either way; this lets curl see it live.
                        time.sleep(0.3)
                        burst(redis_conn, renderer, [MODEL])
                        rendered += 1
                    else:
                        time.sleep(0.05)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=30)
    finally:
        receiver.stop()
    output = log.read_text(errors="replace")
    assert proc.returncode == 0, f"the walkthrough failed ({proc.returncode}):\n{output}"
    assert rendered == 2, output

    # What it said it did, checked from outside: the job, its events, its image, the webhook.
    job_id = re.search(r"^following (\S+)$", output, re.M)
    assert job_id, output
    status, _, body = call("GET", f"{gateway.url}/v1/jobs/{job_id[1]}", gateway.token)
    view = json.loads(body)
    assert status == 200 and view["status"] == "finished", view
    [image] = view["result"]["images"]
    assert hashlib.sha256((work / "fox.png").read_bytes()).hexdigest() == image["sha256"]
    assert (work / "fox-at-dusk.png").stat().st_size > 0
    kinds = re.findall(r"^event: (\w+)$", (work / "events.txt").read_text(), re.M)
    assert kinds[0] == "queued" and kinds[-1] == "done" and "started" in kinds, kinds
    assert f"webhook {_delivery_id(job_id[1])}: signature ok" in output, output
    assert receiver.count >= 1
    [token] = [t for t in Tokens(redis_conn).listed() if t.name.startswith("curl-")]
    assert token.scope == "jobs"


def _delivery_id(job_id: str) -> str:
    from api_client.schema import JobEvent
    from worker.queue.upkeep.webhooks import delivery_id

    return delivery_id(JobEvent(kind="done", job_id=job_id, model=MODEL, at=0.0))


def test_the_walkthrough_refuses_a_forged_webhook(tmp_path: Path) -> None:
    """The script's signature check is a check: the same shell lines, fed a delivery whose body
    was changed after signing, exit non-zero before they say the signature is fine."""
    if shutil.which("openssl") is None or shutil.which("bash") is None:
        pytest.skip("the webhook check needs openssl and bash")
    from api_client.webhooks import webhook_headers

    script = walkthrough()
    check = script[script.index('echo "== 8.') :]
    body = b'{"kind":"done","job_id":"job-1","model":"tiny-sd15","at":1.0}'
    hooks_dir = tmp_path / "hooks"
    hooks_dir.mkdir()
    env = {**os.environ, "WEBHOOK_SECRET": SECRET, "HOOK_DIR": str(hooks_dir), "JOB": "job-1"}
    prelude = "set -euo pipefail\n"

    def run(delivered: bytes) -> subprocess.CompletedProcess[str]:
        headers = webhook_headers(SECRET, "msg-1", "done", body)
        (hooks_dir / "msg-1.body").write_bytes(delivered)
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        (hooks_dir / "msg-1.headers").write_text(lines)
        return subprocess.run(
            ["bash", "-c", prelude + check.replace('echo "walkthrough done: $JOB, $EDIT"', "")],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )

    good = run(body)
    assert good.returncode == 0 and "signature ok" in good.stdout, good.stdout + good.stderr
    forged = run(body.replace(b"job-1", b"job-2"))
    assert forged.returncode != 0 and "no signature matches" in forged.stderr, forged
