"""Attacks on the gateway's doors: every route without credentials, a foreign Host (DNS
rebinding), a foreign or null Origin (a website POSTing to localhost), oversized bodies, another
caller's job, revoked tokens, and tokens in Redis or in logs. The real `kiln api` where a door
is the process's (the guard, the cookie, the first token); the app in-process to walk its whole
route table."""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from starlette.testclient import TestClient

from api_client.http.app import create_app
from api_client.http.settings import ApiSettings
from api_client.http.tokens import Tokens
from tests.conftest import kiln
from tests.fixtures.gateway import Gateway, call
from tests.support.inprocess import client_for, make_renderer, make_worker
from tests.workers import free_port, wait_until

REQUEST = {"model": "tiny-sd15", "prompt": "a door", "steps": 2, "seed": 3}
# The routes a caller reaches without a token: health, and the login page (its form and the
# page's logout, which only clears the cookie).
PUBLIC = {"/healthz", "/readyz", "/", "/login", "/logout"}
SAMPLE = {"job_id": "some-job", "n": "0", "name": "app.js"}


def routes_of(routes: list[Any]) -> list[tuple[str, str]]:
    """(method, path) of every route, through included routers (FastAPI 0.165 keeps an included
    router whole, as one entry holding its original_router)."""
    found: list[tuple[str, str]] = []
    for route in routes:
        if hasattr(route, "original_router"):
            found += routes_of(route.original_router.routes)
        elif hasattr(route, "methods"):
            found += [(m, route.path) for m in sorted(route.methods or ()) if m != "HEAD"]
        else:
            raise AssertionError(f"a route the walk cannot judge: {route!r}")
    return found


def test_every_route_but_health_and_login_answers_401_without_credentials(
    redis_url: str, redis_conn: Redis
) -> None:
    app = create_app(ApiSettings(redis_url=redis_url))
    walked = routes_of(app.routes)
    paths = {path for _, path in walked}
    assert {"/v1/jobs", "/v1/jobs/{job_id}/events", "/docs", "/openapi.json"} <= paths
    with TestClient(app, base_url="http://127.0.0.1:8700") as web:
        for method, route in walked:
            path = route.format(**SAMPLE)
            response = web.request(method, path)
            if route in PUBLIC:
                assert response.status_code != 401, (method, path)
                continue
            assert response.status_code == 401, (method, path, response.status_code)
            body = response.json()
            challenge = response.headers["www-authenticate"]
            if path.startswith("/sdapi/"):  # A1111's error shape; its clients send HTTP Basic
                assert challenge == 'Basic realm="kiln", Bearer'
                assert set(body) == {"error", "detail", "body", "errors"}
                assert "token" in body["detail"]
            elif path.startswith("/openai/"):  # OpenAI's error shape, which its SDK reads
                assert challenge == "Bearer"
                error = body["error"]
                assert error["type"] == "authentication_error" and "token" in error["message"]
            else:
                assert challenge == "Bearer"
                assert body["status"] == 401 and "token" in body["detail"]
            # A token that is not one fails the same way.
            wrong = web.request(method, path, headers={"Authorization": "Bearer kiln_nope"})
            assert wrong.status_code == 401, (method, path)
    assert len(walked) >= 20, walked


def test_a_foreign_host_is_refused_even_with_a_token(gateway: Any) -> None:
    # DNS rebinding: evil.example resolves to 127.0.0.1, the browser sends Host: evil.example.
    for host in ("evil.example", f"evil.example:{gateway.port}", "127.0.0.1.evil.example"):
        status, headers, body = call(
            "GET", gateway.url + "/v1/models", gateway.token, headers={"Host": host}
        )
        assert status == 421 and headers["content-type"] == "application/problem+json", host
        assert "KILN_API_HOSTS" in json.loads(body)["detail"]
    for host in (f"localhost:{gateway.port}", f"127.0.0.1:{gateway.port}"):
        assert (
            call("GET", gateway.url + "/v1/models", gateway.token, headers={"Host": host})[0] == 200
        )


def test_state_changes_from_another_origin_are_refused(gateway: Any, redis_conn: Redis) -> None:
    url = gateway.url + "/v1/jobs"
    for headers in (
        {"Origin": "https://evil.example"},
        {"Origin": "null"},
        {"Origin": f"http://127.0.0.1:{gateway.port}.evil.example"},
        {"Sec-Fetch-Site": "cross-site"},
    ):
        status, _, body = call("POST", url, gateway.token, REQUEST, headers=headers)
        assert status == 403, (headers, body)
    assert not redis_conn.keys("rq:job:*"), "a refused cross-origin request was enqueued"
    # The login form too: a foreign page cannot log a browser in with the attacker's token.
    status, _, _ = call(
        "POST",
        gateway.url + "/login",
        raw=f"token={gateway.token}".encode(),
        headers={
            "Origin": "https://evil.example",
            "Content-Type": "application/x-www-form-urlencoded",
        },
    )
    assert status == 403
    # The page's own origin, and a reading request from anywhere, pass.
    own = {"Origin": f"http://127.0.0.1:{gateway.port}", "Sec-Fetch-Site": "same-origin"}
    assert call("POST", url, gateway.token, REQUEST, headers=own)[0] == 201
    foreign_read = {"Origin": "https://evil.example"}
    assert call("GET", gateway.url + "/v1/models", gateway.token, headers=foreign_read)[0] == 200


def test_an_origin_named_in_kiln_api_origins_may_post(
    kiln_env: dict[str, str], redis_conn: Redis, tmp_path: Path
) -> None:
    token = Tokens(redis_conn).create("studio", "jobs")
    port = free_port()
    env = {**kiln_env, "KILN_API_ORIGINS": "https://studio.example"}
    gateway = Gateway(env, tmp_path / "api.log", port)
    try:
        gateway.wait_ready()
        url = gateway.url + "/v1/jobs"
        allowed = {"Origin": "https://studio.example"}
        assert call("POST", url, token, REQUEST, headers=allowed)[0] == 201
        other = {"Origin": "https://other.example"}
        assert call("POST", url, token, REQUEST, headers=other)[0] == 403
    finally:
        gateway.stop()


def test_bodies_over_the_cap_are_refused_by_length_and_by_what_arrives(
    kiln_env: dict[str, str], redis_conn: Redis, tmp_path: Path
) -> None:
    token = Tokens(redis_conn).create("big", "jobs")
    gateway = Gateway(
        {**kiln_env, "KILN_API_MAX_BODY_MB": "0.01"}, tmp_path / "api.log", free_port()
    )
    try:
        gateway.wait_ready()
        big = b"\x89PNG" + b"\0" * 20_000
        status, _, body = call(
            "POST",
            gateway.url + "/v1/uploads",
            token,
            raw=big,
            headers={"Content-Type": "image/png"},
        )
        assert status == 413 and "KILN_API_MAX_BODY_MB" in json.loads(body)["detail"]
        # Chunked, with no Content-Length: counted as it arrives.
        assert chunked_post(gateway.port, "/v1/uploads", token, big).startswith(b"HTTP/1.1 413")
        assert not redis_conn.keys("kiln:input:*")
    finally:
        gateway.stop()


def chunked_post(port: int, path: str, token: str, body: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: image/png\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        sock.sendall(head.encode())
        for start in range(0, len(body), 4096):
            chunk = body[start : start + 4096]
            try:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"0\r\n\r\n")
        return sock.recv(4096)


def test_a_jobs_token_sees_and_cancels_only_its_own_jobs(gateway: Any, redis_conn: Redis) -> None:
    tokens = Tokens(redis_conn)
    alice, bob = tokens.create("alice"), tokens.create("bob")
    status, _, body = call("POST", gateway.url + "/v1/jobs", alice, REQUEST)
    assert status == 201
    job = json.loads(body)["id"]
    for method, path in (
        ("GET", f"/v1/jobs/{job}"),
        ("GET", f"/v1/jobs/{job}/events"),
        ("GET", f"/v1/jobs/{job}/images/0"),
        ("GET", f"/v1/jobs/{job}/preview"),
        ("POST", f"/v1/jobs/{job}/cancel"),
    ):
        assert call(method, gateway.url + path, bob)[0] == 404, (method, path)
    # Claiming alice's id with the same request is not a way in either.
    assert call("PUT", gateway.url + f"/v1/jobs/{job}", bob, REQUEST)[0] == 409
    assert json.loads(call("GET", gateway.url + "/v1/jobs", bob)[2])["jobs"] == []
    assert [
        j["id"] for j in json.loads(call("GET", gateway.url + "/v1/jobs", alice)[2])["jobs"]
    ] == [job]
    assert call("GET", gateway.url + f"/v1/jobs/{job}", gateway.token)[0] == 200  # admin
    assert redis_conn.hget(f"rq:job:{job}", "status") == b"queued"  # bob's cancel did nothing
    status, _, body = call("POST", gateway.url + f"/v1/jobs/{job}/cancel", alice)
    assert (status, json.loads(body)["status"]) == (202, "canceled")  # what the cancel did
    assert (
        json.loads(call("GET", gateway.url + f"/v1/jobs/{job}", alice)[2])["status"] == "canceled"
    )


def test_token_verbs_keep_only_a_hash_and_revoke_everywhere(
    gateway: Any, kiln_env: dict[str, str], redis_conn: Redis
) -> None:
    made = kiln("api", "token", "create", "ci-bot", "--scope", "jobs", env=kiln_env)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("kiln_") and made.stdout == token + "\n"  # alone on stdout
    listed = kiln("api", "token", "list", env=kiln_env)
    assert "ci-bot\tjobs" in listed.stdout and token not in listed.stdout
    assert call("GET", gateway.url + "/v1/models", token)[0] == 200
    # Redis holds no token in the clear, under any key.
    for key in redis_conn.scan_iter("*"):
        kind = redis_conn.type(key)
        dumped = redis_conn.dump(key) or b""
        assert token.encode() not in dumped, (key, kind)
    assert kiln("api", "token", "create", "ci-bot", env=kiln_env).returncode == 1  # name taken
    assert kiln("api", "token", "revoke", "ci-bot", env=kiln_env).returncode == 0
    assert call("GET", gateway.url + "/v1/models", token)[0] == 401
    assert kiln("api", "token", "revoke", "ci-bot", env=kiln_env).returncode == 1
    # No token reached the gateway's log, though every request carried one.
    assert token not in gateway.output() and gateway.token not in gateway.output()


def test_the_page_logs_in_into_an_httponly_strict_cookie(gateway: Any) -> None:
    status, headers, _ = call("GET", gateway.url + f"/?token={gateway.token}")
    assert status == 303 and headers["location"] == "/"  # the token leaves the address bar
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    session = cookie.split(";")[0]
    page = call("GET", gateway.url + "/", headers={"Cookie": session})
    assert page[0] == 200 and b'id="submit"' in page[2]
    assert "script-src 'self'" in page[1]["content-security-policy"]
    assert call("GET", gateway.url + "/v1/models", headers={"Cookie": session})[0] == 200
    login = call("GET", gateway.url + "/")
    assert login[0] == 200 and b'name="token"' in login[2] and b'id="submit"' not in login[2]
    wrong = call("GET", gateway.url + "/?token=kiln_wrong")
    assert wrong[0] == 401 and "set-cookie" not in wrong[1]


def test_first_start_makes_an_admin_token_and_prints_the_page_address(
    kiln_env: dict[str, str], redis_conn: Redis, tmp_path: Path
) -> None:
    port = free_port()
    first = Gateway(kiln_env, tmp_path / "first.log", port)
    try:
        first.wait_ready()
        wait_until(lambda: "?token=" in first.output(), 10, "the first token line")
        line = next(x for x in first.output().splitlines() if "?token=" in x).strip()
        assert line.startswith(f"http://127.0.0.1:{port}/?token=kiln_")
        token = line.split("?token=")[1]
        assert call("GET", first.url + "/v1/models", token)[0] == 200
        assert [t.scope for t in Tokens(redis_conn).listed()] == ["admin"]
    finally:
        first.stop()
    second = Gateway(kiln_env, tmp_path / "second.log", port)
    try:
        second.wait_ready()
        assert "?token=" not in second.output() and len(Tokens(redis_conn).listed()) == 1
        # A restart says how to get in: tokens are shown only when made.
        wait_until(lambda: "token create" in second.output(), 10, "the start line")
        assert "kiln api token create NAME --scope admin" in second.output()
    finally:
        second.stop()


def test_an_input_outside_every_store_is_refused_at_submit(
    gateway: Any, redis_conn: Redis, settings: Any
) -> None:
    make_worker(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])  # publishes
    stores = client_for(redis_conn, settings).stores()
    assert stores == [str(Path(settings.output_dir).resolve())]
    outside = {**REQUEST, "mode": "img2img", "image": "file:///etc/passwd"}
    from api_client import RequestRejected

    with pytest.raises(RequestRejected) as refused:
        client_for(redis_conn, settings).submit(outside)
    assert (
        refused.value.problems[0].field == "image" and "outside" in refused.value.problems[0].rule
    )
    status, _, body = call("POST", gateway.url + "/v1/jobs", gateway.token, outside)
    assert status == 422 and json.loads(body)["detail"] == str(refused.value)
    assert not redis_conn.keys("rq:job:*")
