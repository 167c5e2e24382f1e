"""Tenants on one gateway (issue 36): two `jobs` tokens on a real `kiln api` over a real Redis,
with a real worker (a burst worker in this process) rendering their jobs. Each test is one
attack from the security review, made by the second token, and asserts what it cannot reach;
the first token (or the admin) shows that the thing it was refused is there to be had.

The gateway's event loop under load and its refusals of unreadable bodies are
tests/test_api_loop.py's."""

from __future__ import annotations

import base64
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from api_client import keys
from api_client.http import tenancy
from api_client.http.sessions import SESSION_PREFIX
from api_client.http.tokens import Tokens
from api_client.schema import WorkerState
from tests.conftest import kiln
from tests.fixtures.gateway import call
from tests.support.fleet import live_worker
from tests.support.images import encoded
from tests.support.inprocess import burst, client_for, make_renderer, make_worker
from worker.queue.upkeep.publisher import Snapshot

REQUEST = {"model": "tiny-sd15", "prompt": "a red fox", "steps": 2, "seed": 7}


def png(side: int = 128, noise: bool = False) -> bytes:
    """A PNG of the job's size; noise makes it incompressible (about 3 bytes a pixel)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    image = Image.fromarray(pixels) if noise else Image.new("RGB", (side, side), (200, 40, 40))
    return encoded(image)


def submit(gateway: Any, token: str, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, body = call("POST", gateway.url + "/v1/jobs", token, request)
    return status, json.loads(body)


def upload(gateway: Any, token: str, data: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, headers, body = call(
        "POST", gateway.url + "/v1/uploads", token, raw=data, headers={"Content-Type": "image/png"}
    )
    return status, headers, json.loads(body)


def queued_request(conn: Redis, job_id: str) -> str:
    """The request a job carries on the queue, as JSON."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    return json.dumps(job.kwargs["request"])


def refusal(body: dict[str, Any]) -> dict[str, str]:
    """A 422's errors as field -> rule."""
    return {error["field"]: error["rule"] for error in body["errors"]}


@pytest.fixture
def finished(gateway: Any, redis_conn: Redis, settings: Any) -> dict[str, Any]:
    """Alice's finished job, rendered by a real worker: {alice, bob, job, view}."""
    tokens = Tokens(redis_conn)
    alice, bob = tokens.create("alice"), tokens.create("bob")
    status, created = submit(gateway, alice, REQUEST)
    assert status == 201, created
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    _, _, body = call("GET", gateway.url + f"/v1/jobs/{created['id']}", alice)
    view = json.loads(body)
    assert view["status"] == "finished", view
    return {"alice": alice, "bob": bob, "job": created["id"], "view": view, "body": body}


def test_a_tenant_reuses_its_own_outputs_and_never_anothers(
    gateway: Any, redis_conn: Redis, settings: Any, finished: dict[str, Any]
) -> None:
    alice, bob, job = finished["alice"], finished["bob"], finished["job"]
    # Alice's view names no store: no path, no directory, only the gateway's URL and the
    # opaque uri.
    [image] = finished["view"]["result"]["images"]
    assert image["uri"] == f"kiln-output:{job}/0" and image["path"] is None
    assert str(settings.output_dir).encode() not in finished["body"]
    stored = client_for(redis_conn, settings).job(job).result()
    assert stored is not None and (stored.images[0].uri or "").startswith("file://")
    real_path = (stored.images[0].uri or "").removeprefix("file://")

    # Bob names Alice's image every way the review tried, and a twin that does not exist: one
    # refusal, in the same words, for each.
    img2img = {**REQUEST, "strength": 0.5, "steps": 4}
    tries = [
        f"kiln-output:{job}/0",
        f"kiln-output:{job}/3",
        "kiln-output:no-such-job/0",
        f"file://{real_path}",
        f"file://{settings.output_dir}/{job}/9.png",
        real_path,
    ]
    rules = set()
    for value in tries:
        status, body = submit(gateway, bob, {**img2img, "image": value})
        assert status == 422, (value, body)
        rules.add(refusal(body)["image"])
        assert str(settings.output_dir) not in json.dumps(body) or value.endswith(".png")
    file_rules = {r for r in rules if "bare path" not in r}
    assert file_rules == {tenancy.NOT_YOURS}, rules
    for field in ("mask", "reference"):
        value = f"kiln-output:{job}/0"
        request = {**img2img, "image": value}
        if field == "mask":
            request["mask"] = value
        else:
            request = {**REQUEST, "reference": {"image": value}}
        status, body = submit(gateway, bob, request)
        assert status == 422 and tenancy.NOT_YOURS in refusal(body).values(), body

    # Alice reuses her own image as img2img's input: the worker reads it from the store.
    status, created = submit(gateway, alice, {**img2img, "image": f"kiln-output:{job}/0"})
    assert status == 201, created
    queued = queued_request(redis_conn, created["id"])
    assert f"kiln-output:{job}/0" in queued and str(settings.output_dir) not in queued
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    view = json.loads(call("GET", gateway.url + f"/v1/jobs/{created['id']}", alice)[2])
    assert view["status"] == "finished", view
    assert view["request"]["image"] == f"kiln-output:{job}/0"


def test_uploads_are_their_makers_alone(gateway: Any, redis_conn: Redis) -> None:
    tokens = Tokens(redis_conn)
    alice, bob = tokens.create("alice"), tokens.create("bob")
    status, _, uploaded = upload(gateway, alice, png())
    assert status == 201
    img2img = {**REQUEST, "strength": 0.5}
    status, body = submit(gateway, bob, {**img2img, "image": uploaded["uri"]})
    never = "kiln-input:" + "0" * 64
    status_never, body_never = submit(gateway, bob, {**img2img, "image": never})
    # Alice's upload and one that never existed: the same refusal.
    assert (status, status_never) == (422, 422)
    assert refusal(body)["image"] == refusal(body_never)["image"] == tenancy.NOT_YOUR_UPLOAD
    assert submit(gateway, alice, {**img2img, "image": uploaded["uri"]})[0] == 201
    # Bob uploading the same bytes makes them his too.
    assert upload(gateway, bob, png())[0] == 201
    assert submit(gateway, bob, {**img2img, "image": uploaded["uri"]})[0] == 201


def test_workers_name_running_jobs_to_admin_only(gateway: Any, redis_conn: Redis) -> None:
    alice = Tokens(redis_conn).create("alice")
    live_worker(redis_conn, ["tiny-sd15"], running="someone-elses-job")
    status, _, body = call("GET", gateway.url + "/v1/workers", alice)
    [shown] = json.loads(body)["workers"]
    assert status == 200 and shown["state"]["running"] is None and b"someone-elses" not in body
    admin = json.loads(call("GET", gateway.url + "/v1/workers", gateway.token)[2])
    assert admin["workers"][0]["state"]["running"] == "someone-elses-job"


def test_a_tenants_jobs_are_capped_and_others_go_on(gateway: Any, redis_conn: Redis) -> None:
    tokens = Tokens(redis_conn)
    greedy, other = tokens.create("greedy", max_queued=2), tokens.create("other")
    ids = []
    for seed in (1, 2):
        status, created = submit(gateway, greedy, {**REQUEST, "seed": seed})
        assert status == 201, created
        ids.append(created["id"])
    status, headers, body = call("POST", gateway.url + "/v1/jobs", greedy, {**REQUEST, "seed": 3})
    problem = json.loads(body)
    assert status == 429 and headers["content-type"] == "application/problem+json"
    assert int(headers["retry-after"]) >= 1 and problem["errors"][0]["field"] == "max_queued"
    assert "2 jobs queued or running" in problem["detail"]
    assert submit(gateway, other, REQUEST)[0] == 201  # another tenant is untouched
    # A job that ends gives its place back.
    assert call("POST", gateway.url + f"/v1/jobs/{ids[0]}/cancel", greedy)[0] == 202
    assert submit(gateway, greedy, {**REQUEST, "seed": 3})[0] == 201
    # Nothing refused was queued.
    queued = redis_conn.llen(keys.rq_queue_key(keys.queue_name("tiny-sd15", "interactive")))
    assert queued == 3


def test_a_tenants_upload_bytes_are_capped_inline_images_included(
    gateway: Any, redis_conn: Redis
) -> None:
    tokens = Tokens(redis_conn)
    greedy, other = tokens.create("greedy", upload_mb=1), tokens.create("other")
    first, second, third = (png(side, noise=True) for side in (448, 432, 416))
    assert len(first) + len(third) > 1024 * 1024 > len(first) > len(second) > len(third)
    assert upload(gateway, greedy, first)[0] == 201
    assert upload(gateway, greedy, first)[0] == 201  # the same bytes again cost nothing more
    status, headers, problem = upload(gateway, greedy, second)
    assert status == 429 and problem["errors"][0]["field"] == "upload_mb", problem
    assert 1 <= int(headers["retry-after"]) <= 86400
    assert upload(gateway, other, second)[0] == 201  # another tenant is untouched
    # An inline image is an upload too: charged, and kept out of the queued job.
    inline = "data:image/png;base64," + base64.b64encode(third).decode()
    request = {**REQUEST, "image": inline, "width": 416, "height": 416, "strength": 0.5}
    status, body = submit(gateway, greedy, request)
    assert status == 429 and body["errors"][0]["field"] == "upload_mb", body
    small = "data:image/png;base64," + base64.b64encode(png()).decode()
    status, created = submit(gateway, other, {**REQUEST, "image": small, "strength": 0.5})
    assert status == 201, created
    queued = queued_request(redis_conn, created["id"])
    assert "data:image" not in queued and "kiln-input:" in queued and len(queued) < 4000


def test_the_session_cookie_is_not_the_token_and_ends_with_it(
    gateway: Any, redis_conn: Redis
) -> None:
    tokens = Tokens(redis_conn)
    token = tokens.create("browser", expires_days=1)
    status, headers, _ = call("GET", gateway.url + f"/?token={token}")
    assert status == 303 and headers["location"] == "/"
    assert headers["cache-control"] == "no-store" and headers["referrer-policy"] == "same-origin"
    session = headers["set-cookie"].split(";")[0]
    assert session.startswith("kiln_session=") and token not in session
    max_age = int(headers["set-cookie"].lower().split("max-age=")[1].split(";")[0])
    assert 0 < max_age <= 86400  # the token's expiry, not 30 days
    assert redis_conn.keys(SESSION_PREFIX + "*") and session.split("=")[1].encode() not in b"".join(
        redis_conn.keys("*")
    )
    assert call("GET", gateway.url + "/v1/models", headers={"Cookie": session})[0] == 200
    tokens.revoke("browser")
    status, _, body = call("GET", gateway.url + "/v1/models", headers={"Cookie": session})
    assert status == 401 and b"session is over" in body
    # A token made again under the name is a new tenant: the old session stays over.
    tokens.create("browser")
    assert call("GET", gateway.url + "/v1/models", headers={"Cookie": session})[0] == 401


def test_a_cross_site_link_logs_nobody_in(gateway: Any, redis_conn: Redis) -> None:
    attacker = Tokens(redis_conn).create("attacker")
    status, headers, body = call(
        "GET", gateway.url + f"/?token={attacker}", headers={"Sec-Fetch-Site": "cross-site"}
    )
    assert status == 200 and b'name="token"' in body and "set-cookie" not in headers
    # The form's own script drops the token from the address, and the CSP admits just it.
    assert tenancy_script_allowed(headers["content-security-policy"], body)
    same = call("GET", gateway.url + f"/?token={attacker}", headers={"Sec-Fetch-Site": "none"})
    assert same[0] == 303 and "set-cookie" in same[1]  # typed or bookmarked: logs in


def tenancy_script_allowed(csp: str, body: bytes) -> bool:
    import hashlib

    from api_client.http.app import LOGIN_SCRIPT

    digest = base64.b64encode(hashlib.sha256(LOGIN_SCRIPT.encode()).digest()).decode()
    return f"'sha256-{digest}'" in csp and f"<script>{LOGIN_SCRIPT}</script>".encode() in body


def test_tokens_expire(gateway: Any, redis_conn: Redis) -> None:
    token = Tokens(redis_conn).create("brief", expires_days=2 / 86400)
    assert call("GET", gateway.url + "/v1/models", token)[0] == 200
    time.sleep(2.1)
    status, _, body = call("GET", gateway.url + "/v1/models", token)
    assert status == 401 and b"expired" in body


def test_a_name_made_again_is_a_new_tenant(gateway: Any, redis_conn: Redis) -> None:
    tokens = Tokens(redis_conn)
    old = tokens.create("alice")
    status, created = submit(gateway, old, REQUEST)
    assert status == 201
    tokens.revoke("alice")
    new = tokens.create("alice")
    assert json.loads(call("GET", gateway.url + "/v1/jobs", new)[2])["jobs"] == []
    assert call("GET", gateway.url + f"/v1/jobs/{created['id']}", new)[0] == 404
    # The idempotency key is the tenant's too: the new alice's key makes a new job.
    key = {"Idempotency-Key": "order-1"}
    first = call("POST", gateway.url + "/v1/jobs", old, REQUEST, headers=key)
    assert first[0] == 401
    made = json.loads(call("POST", gateway.url + "/v1/jobs", new, REQUEST, headers=key)[2])
    bob = tokens.create("bob")
    other = json.loads(call("POST", gateway.url + "/v1/jobs", bob, REQUEST, headers=key)[2])
    assert made["id"] != other["id"]


def test_pins_are_the_operators(gateway: Any, redis_conn: Redis, settings: Any) -> None:
    tenant = Tokens(redis_conn).create("tenant")
    for field, value in (("rung", "group_offload"), ("compile", True), ("compile", False)):
        status, body = submit(gateway, tenant, {**REQUEST, field: value})
        assert status == 422 and refusal(body)[field] == tenancy.PIN_RULE, body
        assert submit(gateway, gateway.token, {**REQUEST, field: value})[0] != 422 or (
            field == "compile"  # the manifest may still refuse a compile pin, in its own words
        )
    # A worker that switched its step cache off publishes so; a tenant's step_cache: true for
    # the model it serves is refused at submit (the admin's goes to the worker, which says why).
    flux = "tiny-flux"
    off = settings.model_copy(update={"step_cache": "off"})
    worker = make_worker(redis_conn, make_renderer(off, [flux]), [flux])
    beat = Snapshot("idle", None, 0, 0.0, None, datetime.now(timezone.utc))
    worker.publisher.publish(beat)
    state = WorkerState.model_validate_json(redis_conn.get(keys.worker_key(worker.name)) or b"")
    assert state.step_cache_off == [flux]
    request = {"model": flux, "prompt": "a fox", "step_cache": True, "steps": 4}
    status, body = submit(gateway, tenant, request)
    assert status == 422 and "is off on every worker" in refusal(body)["step_cache"], body
    assert submit(gateway, tenant, {**request, "step_cache": False})[0] == 201
    assert submit(gateway, gateway.token, request)[0] == 201


def test_put_on_another_tenants_id_is_409_as_for_any_id_it_cannot_take(
    gateway: Any, redis_conn: Redis, settings: Any
) -> None:
    tokens = Tokens(redis_conn)
    alice, bob = tokens.create("alice"), tokens.create("bob")
    assert call("PUT", gateway.url + "/v1/jobs/alices-order", alice, REQUEST)[0] == 201
    client_for(redis_conn, settings).submit(REQUEST, job_id="backend-order")  # not a gateway's
    answers = []
    for job_id in ("alices-order", "backend-order"):
        status, _, body = call("PUT", gateway.url + f"/v1/jobs/{job_id}", bob, REQUEST)
        answers.append((status, json.loads(body)["detail"].replace(job_id, "ID")))
    assert answers[0] == answers[1] and answers[0][0] == 409, answers
    assert b"alice" not in body
    assert json.loads(call("GET", gateway.url + "/v1/jobs", bob)[2])["jobs"] == []
    queued = redis_conn.llen(keys.rq_queue_key(keys.queue_name("tiny-sd15", "interactive")))
    assert queued == 2


def test_job_views_are_not_cached_and_images_stay_private(
    gateway: Any, finished: dict[str, Any]
) -> None:
    alice, job = finished["alice"], finished["job"]
    for method, path in (
        ("GET", f"/v1/jobs/{job}"),
        ("GET", "/v1/jobs"),
        ("GET", "/v1/models"),
    ):
        status, headers, _ = call(method, gateway.url + path, alice)
        assert status == 200 and headers["cache-control"] == "no-store", path
        assert headers["x-content-type-options"] == "nosniff"
    status, headers, _ = call("POST", gateway.url + "/v1/jobs", alice, REQUEST)
    assert status == 201 and headers["cache-control"] == "no-store"
    status, headers, _ = call("GET", finished["view"]["result"]["images"][0]["url"], alice)
    assert status == 200 and headers["cache-control"].startswith("private")
    status, headers, _ = call("GET", gateway.url + "/")
    assert headers["cache-control"] == "no-store"


def test_an_output_changed_in_the_store_is_refused_by_the_worker_without_its_path(
    gateway: Any, redis_conn: Redis, settings: Any, finished: dict[str, Any]
) -> None:
    alice, job = finished["alice"], finished["job"]
    stored = client_for(redis_conn, settings).job(job).result()
    assert stored is not None
    Path((stored.images[0].uri or "").removeprefix("file://")).write_bytes(png())
    request = {**REQUEST, "image": f"kiln-output:{job}/0", "strength": 0.5, "steps": 4}
    status, created = submit(gateway, alice, request)
    assert status == 201, created
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    status, _, body = call("GET", gateway.url + f"/v1/jobs/{created['id']}", alice)
    view = json.loads(body)
    assert view["status"] == "failed" and "changed in the store" in view["error"], view
    assert f"kiln-output:{job}/0" in view["error"] and str(settings.output_dir).encode() not in body


def test_token_create_takes_limits_and_an_expiry(kiln_env: dict[str, str]) -> None:
    made = kiln(
        "api", "token", "create", "shop", "--max-queued", "3", "--upload-mb", "5",
        "--expires", "2", env=kiln_env,
    )  # fmt: skip
    assert made.returncode == 0 and made.stdout.startswith("kiln_"), made.stderr
    [line] = [
        x for x in kiln("api", "token", "list", env=kiln_env).stdout.splitlines() if "shop" in x
    ]
    assert "max-queued 3" in line and "upload 5 MB" in line and "expires never" not in line
    for flag, value, word in (("--max-queued", "0", "1-100000"), ("--expires", "-1", "days")):
        refused = kiln("api", "token", "create", "bad", flag, value, env=kiln_env)
        assert refused.returncode == 1 and word in refused.stderr and not refused.stdout


def test_a_job_for_a_model_no_worker_serves_says_so_at_once(
    gateway: Any, redis_conn: Redis
) -> None:
    tenant = Tokens(redis_conn).create("tenant")
    status, created = submit(gateway, tenant, REQUEST)
    assert status == 201 and created["served"] is False, created
    assert created["warnings"] == [
        "no live worker serves tiny-sd15 now: the job waits in its queue until one starts"
        " (kiln worker --models tiny-sd15)"
    ]
    live_worker(redis_conn, ["tiny-sd15"])
    status, created = submit(gateway, tenant, {**REQUEST, "seed": 8})
    assert status == 201 and created["served"] is True and created["warnings"] == []


def test_admin_lists_every_job_whatever_submitted_it(
    gateway: Any, redis_conn: Redis, settings: Any
) -> None:
    tenant = Tokens(redis_conn).create("tenant")
    made = client_for(redis_conn, settings).submit(REQUEST)  # the Python client, no gateway
    status, created = submit(gateway, tenant, {**REQUEST, "seed": 9})
    assert status == 201
    admin = json.loads(call("GET", gateway.url + "/v1/jobs", gateway.token)[2])["jobs"]
    assert [job["id"] for job in admin] == [created["id"], made.id]
    assert admin[1]["request"]["prompt"] == REQUEST["prompt"]
    mine = json.loads(call("GET", gateway.url + "/v1/jobs", tenant)[2])["jobs"]
    assert [job["id"] for job in mine] == [created["id"]]
