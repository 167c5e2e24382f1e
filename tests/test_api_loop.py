"""One tenant cannot stall or break the gateway (issue 36): every body it cannot read is a bounded
400 or 422 problem+json, never a 5xx; /healthz answers within a second while one client sends a
400,000-key body and three upload 15 MB images; every answer says nosniff; OPTIONS names every
method of a path. The real `kiln api` throughout, but for one handler test on the app itself."""

from __future__ import annotations

import http.client
import json
from typing import Any

from fastapi import Request
from redis import Redis
from starlette.testclient import TestClient

from api_client.errors import Problem, RequestRejected
from api_client.http.app import create_app
from api_client.http.settings import ApiSettings
from tests.fixtures.gateway import call
from tests.fixtures.stall import Load, poll, wide_body

REQUEST = {"model": "tiny-sd15", "prompt": "a loop", "steps": 2, "seed": 3}
MAX_REFUSAL_BYTES = 20_000
HEALTHZ_LIMIT_S = 1.0  # docs/contract.md, Tenants: /healthz answers within 1 s under this load
POLLS = 20


# (what, raw body, the field the refusal names). JSON has no NaN or Infinity; Python's json
# module reads them, and 1e400 as inf, and "\ud800" as a lone surrogate no encoder takes.
UNREADABLE: list[tuple[str, bytes, str]] = [
    ("NaN", b'{"model": "tiny-sd15", "prompt": "a", "guidance": NaN}', "guidance"),
    ("Infinity", b'{"model": "tiny-sd15", "prompt": "a", "guidance": Infinity}', "guidance"),
    ("-Infinity", b'{"model": "tiny-sd15", "prompt": "a", "strength": -Infinity}', "strength"),
    ("1e400", b'{"model": "tiny-sd15", "prompt": "a", "guidance": 1e400}', "guidance"),
    ("surrogate in prompt", b'{"model": "tiny-sd15", "prompt": "a \\ud800"}', "prompt"),
    ("surrogate in model", b'{"model": "\\ud800", "prompt": "a"}', "model"),
    ("surrogate in a key", b'{"model": "tiny-sd15", "prompt": "a", "\\udfff": 1}', "\\udfff"),
    ("400,000 unknown keys", wide_body(), "body"),
    ("300 unknown keys", wide_body(300), "body"),
    ("nested 40 deep", b'{"model": "m", "loras": ' + b"[" * 40 + b"]" * 40 + b"}", "loras"),
    ("nested 5,000 deep", b"[" * 5_000 + b"]" * 5_000, "body"),
    ("nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000, "body"),
    (
        "a 5,000-digit seed",
        b'{"model": "m", "prompt": "a", "seed": ' + b"9" * 5000 + b"}",
        "seed",
    ),
    ("invalid UTF-8", b'{"model": "tiny-sd15", "prompt": "\xff\xfe"}', "body"),
    ("an encoded surrogate", b'{"model": "tiny-sd15", "prompt": "\xed\xa0\x80"}', "body"),
    ("UTF-16", '{"model": "tiny-sd15"}'.encode("utf-16"), "body"),
    ("not JSON", b'{"model": "tiny-sd15", "prompt": ', "body"),
]


def assert_bounded_problem(status: int, headers: dict[str, str], body: bytes, what: str) -> Any:
    assert status in (400, 422), (what, status, body[:300])
    assert headers["content-type"] == "application/problem+json", what
    assert len(body) < MAX_REFUSAL_BYTES, (what, len(body))
    problem = json.loads(body)
    assert problem["status"] == status and problem["title"] and problem["detail"], what
    assert 1 <= len(problem["errors"]) <= 20, (what, len(problem["errors"]))
    assert {"field", "value", "rule"} <= set(problem["errors"][0]), what
    body.decode("utf-8")  # sent as UTF-8: an echoed lone surrogate went out escaped
    return problem


def test_a_body_the_gateway_cannot_read_is_a_bounded_problem_on_post_and_put(
    gateway: Any, redis_conn: Redis
) -> None:
    headers = {"Content-Type": "application/json"}
    for what, raw, field in UNREADABLE:
        for method, path in (("POST", "/v1/jobs"), ("PUT", "/v1/jobs/loop-job")):
            status, got, body = call(
                method, gateway.url + path, gateway.token, raw=raw, headers=headers
            )
            problem = assert_bounded_problem(status, got, body, f"{what}, {method}")
            assert problem["errors"][0]["field"].startswith(field), (what, problem)
    # A body of unknown keys under the layer's bound is refused by the route: 20 listed, the
    # rest counted in detail.
    raw = wide_body(200)
    status, got, body = call(
        "POST", gateway.url + "/v1/jobs", gateway.token, raw=raw, headers=headers
    )
    problem = assert_bounded_problem(status, got, body, "200 unknown keys")
    assert len(problem["errors"]) == 20 and "first 20 of 200 problems" in problem["detail"]
    assert not redis_conn.keys("rq:job:*"), "a refused body was enqueued"
    # The same request, readable, is taken: the layer replays the exact bytes.
    status, _, body = call("PUT", gateway.url + "/v1/jobs/loop-job", gateway.token, REQUEST)
    assert status == 201, body


def test_unreadable_uploads_and_logins_are_problems_never_5xx(gateway: Any) -> None:
    url, token = gateway.url, gateway.token
    status, got, body = call(
        "POST", url + "/v1/uploads", token, raw=b"not a png", headers={"Content-Type": "image/png"}
    )
    assert_bounded_problem(status, got, body, "an upload that is no image")
    status, got, body = call(
        "POST", url + "/v1/uploads", token, raw=b"{", headers={"Content-Type": "application/json"}
    )
    assert_bounded_problem(status, got, body, "an upload of broken JSON")
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    many = b"&".join(b"k%d=1" % n for n in range(400_000))
    long = b"token=" + b"a" * 300
    for what, raw in (("400,000 fields", many), ("a 300-character token", long)):
        status, got, body = call("POST", url + "/login", raw=raw, headers=form)
        assert status in (400, 422), (what, status, body[:300])
        assert got["content-type"] == "application/problem+json", what
        assert len(body) < MAX_REFUSAL_BYTES, what
    for raw in (b"token=%ED%A0%80", b"token=\xff\xfe"):
        status, _, _ = call("POST", url + "/login", raw=raw, headers=form)
        assert status < 500, raw


def test_a_refusal_echoing_nan_or_a_lone_surrogate_is_sent_not_a_500(redis_url: str) -> None:
    """The route-side refusals (RequestRejected from the client, FastAPI's validation) echo what
    they were given; a JSONResponse fails on NaN and on a lone surrogate, so they are made fit."""
    app = create_app(ApiSettings(redis_url=redis_url))
    values: list[Any] = [float("nan"), float("inf"), "\ud800", {"k": "\udfff"}]
    # Past the 8 RequestRejected's own message formats: str() of 5000 digits raises.
    extra = [Problem(f"extra{n}", 10**5000 if n == 5 else n, "unknown") for n in range(41)]

    @app.get("/refuse-for-test")
    def refuse_for_test(request: Request) -> None:
        raise RequestRejected([Problem("\ud800", v, "bad \ud800") for v in values] + extra)

    with TestClient(app, base_url="http://127.0.0.1:8700") as web:
        response = web.get("/refuse-for-test")
    problem = assert_bounded_problem(
        response.status_code, dict(response.headers), response.content, "echoed values"
    )
    assert [e["value"] for e in problem["errors"][:3]] == ["nan", "inf", "\\ud800"]
    assert problem["errors"][0]["field"] == "\\ud800"
    assert problem["errors"][9]["value"].startswith("<an integer of")
    assert "first 20 of 45 problems" in problem["detail"]


def test_healthz_answers_within_a_second_under_a_wide_body_and_three_big_uploads(
    gateway: Any,
) -> None:
    idle = poll(gateway.url, 5, 0.05)
    with Load(gateway.url, gateway.token) as load:
        busy = poll(gateway.url, POLLS, 0.1)
    statuses = {what: {s for w, s, _ in load.answers if w == what} for what in ("wide", "upload")}
    assert statuses == {"wide": {422}, "upload": {201}}, load.answers
    assert max(busy) < HEALTHZ_LIMIT_S, (
        f"/healthz took up to {max(busy):.2f} s under load (idle {max(idle):.3f} s): {busy}"
    )


def test_every_answer_says_nosniff(gateway: Any) -> None:
    url, token = gateway.url, gateway.token
    answers = {
        200: call("GET", url + "/healthz"),
        401: call("GET", url + "/v1/models"),
        404: call("GET", url + "/v1/jobs/no-such-job", token),
        421: call("GET", url + "/v1/models", token, headers={"Host": "evil.example"}),
        422: call(
            "POST",
            url + "/v1/jobs",
            token,
            raw=b"[" * 10_000,
            headers={"Content-Type": "application/json"},
        ),
    }
    for status, (got, headers, _) in answers.items():
        assert got == status
        assert headers.get("x-content-type-options") == "nosniff", status
    # A streamed answer too: an event stream's headers, before its first event.
    status, _, body = call("POST", url + "/v1/jobs", token, REQUEST)
    assert status == 201, body
    job = json.loads(body)["id"]
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    try:
        connection.request(
            "GET", f"/v1/jobs/{job}/events", headers={"Authorization": f"Bearer {token}"}
        )
        response = connection.getresponse()
        assert response.status == 200
        assert response.getheader("content-type", "").startswith("text/event-stream")
        assert response.getheader("x-content-type-options") == "nosniff"
    finally:
        connection.close()


def test_options_names_every_method_a_path_takes(gateway: Any) -> None:
    # No credentials: the list is what a 405's Allow header tells anyone.
    status, headers, _ = call("OPTIONS", gateway.url + "/v1/jobs/some-job")
    assert status == 204
    assert {m.strip() for m in headers["allow"].split(",")} >= {"GET", "PUT", "OPTIONS"}
    status, headers, _ = call("OPTIONS", gateway.url + "/v1/jobs")
    assert status == 204 and {"GET", "POST"} <= {m.strip() for m in headers["allow"].split(",")}
    status, headers, body = call("OPTIONS", gateway.url + "/no/such/path")
    assert status == 404 and headers["content-type"] == "application/problem+json", body
    status, _, body = call("GET", gateway.url + "/openapi.json", gateway.token)
    assert status == 200
    for path, operations in json.loads(body)["paths"].items():
        assert "options" not in operations, path
