"""The HTTP gateway end to end: a real `kiln api` process, a real Redis and a real worker (a
burst worker in this process). The Python client and the gateway refuse in the same words."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from redis import Redis

from api_client import RequestRejected
from tests.fixtures.gateway import call
from tests.support.inprocess import burst, client_for, make_renderer

REQUEST = {"model": "tiny-sd15", "prompt": "a red fox", "steps": 2, "seed": 7}


def test_a_job_submitted_followed_and_fetched_over_http(
    gateway: Any, redis_conn: Redis, settings: Any
) -> None:
    status, headers, body = call("POST", gateway.url + "/v1/jobs", gateway.token, REQUEST)
    assert status == 201, body
    created = json.loads(body)
    job_id = created["id"]
    assert headers["location"] == f"/v1/jobs/{job_id}"
    assert created["urls"]["events"] == f"/v1/jobs/{job_id}/events"
    status, _, body = call("GET", gateway.url + f"/v1/jobs/{job_id}", gateway.token)
    view = json.loads(body)
    assert (status, view["status"], view["position"]) == (200, "queued", 0), view

    seen: list[str] = []

    def follow() -> None:
        request_headers = {"Authorization": f"Bearer {gateway.token}"}
        import urllib.request

        request = urllib.request.Request(
            gateway.url + f"/v1/jobs/{job_id}/events", headers=request_headers
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response:
                seen.append(line.decode().rstrip("\n"))

    watcher = threading.Thread(target=follow)
    watcher.start()
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    watcher.join(timeout=60)
    assert not watcher.is_alive(), "the event stream did not close after the end event"
    kinds = [line.removeprefix("event: ") for line in seen if line.startswith("event: ")]
    assert kinds[0] == "queued" and kinds[-1] == "done" and "started" in kinds, kinds
    ids = [line.removeprefix("id: ") for line in seen if line.startswith("id: ")]
    assert len(ids) == len(kinds) == len(set(ids))

    status, _, body = call("GET", gateway.url + f"/v1/jobs/{job_id}", gateway.token)
    view = json.loads(body)
    assert view["status"] == "finished" and view["result"]["seed"] == 7, view
    [image] = view["result"]["images"]
    # Absolute, this gateway's; the uri is the opaque name only this token may reuse; no path.
    assert image["url"] == f"{gateway.url}/v1/jobs/{job_id}/images/0"
    assert image["uri"] == f"kiln-output:{job_id}/0" and image["path"] is None
    status, headers, png = call("GET", image["url"], gateway.token)
    assert status == 200 and headers["content-type"] == "image/png"
    import hashlib

    assert hashlib.sha256(png).hexdigest() == image["sha256"]

    # Resuming after the third event gives the rest, nothing repeated.
    status, _, body = call(
        "GET",
        gateway.url + f"/v1/jobs/{job_id}/events",
        gateway.token,
        headers={"Last-Event-ID": ids[2]},
    )
    resumed = [line[4:] for line in body.decode().splitlines() if line.startswith("id: ")]
    assert resumed == ids[3:]


def test_a_refusal_is_problem_json_in_the_python_clients_words(
    gateway: Any, redis_conn: Redis, settings: Any
) -> None:
    bad = {**REQUEST, "steps": 10_000, "width": 333}
    with pytest.raises(RequestRejected) as refused:
        client_for(redis_conn, settings).submit(bad)
    status, headers, body = call("POST", gateway.url + "/v1/jobs", gateway.token, bad)
    assert status == 422 and headers["content-type"] == "application/problem+json"
    problem = json.loads(body)
    assert problem["detail"] == str(refused.value)
    fields = {e["field"] for e in problem["errors"]}
    assert {"steps", "width x height"} <= fields, problem
    assert not redis_conn.keys("rq:queue:*"), "a refused request was enqueued"

    # A schema error (a string for steps) too: the same words as RenderRequest.parse.
    typed = {**REQUEST, "steps": "many"}
    with pytest.raises(RequestRejected) as schema_refused:
        client_for(redis_conn, settings).submit(typed)
    status, _, body = call("POST", gateway.url + "/v1/jobs", gateway.token, typed)
    assert status == 422 and json.loads(body)["detail"] == str(schema_refused.value)


def test_put_and_idempotency_key_never_render_twice(gateway: Any, redis_conn: Redis) -> None:
    url = gateway.url + "/v1/jobs/my-job-1"
    first = call("PUT", url, gateway.token, REQUEST)
    again = call("PUT", url, gateway.token, REQUEST)
    assert (first[0], again[0]) == (201, 200)
    other = call("PUT", url, gateway.token, {**REQUEST, "prompt": "another"})
    assert other[0] == 422 and "job_id" in {e["field"] for e in json.loads(other[2])["errors"]}
    keyed = {"Idempotency-Key": "order-42"}
    one = call("POST", gateway.url + "/v1/jobs", gateway.token, REQUEST, headers=keyed)
    two = call("POST", gateway.url + "/v1/jobs", gateway.token, REQUEST, headers=keyed)
    assert (one[0], two[0]) == (201, 200)
    assert json.loads(one[2])["id"] == json.loads(two[2])["id"]
    assert redis_conn.llen("rq:queue:kiln:tiny-sd15") == 2


def test_compose_runs_the_gateway_beside_the_workers_on_their_redis() -> None:
    import yaml

    from tests.conftest import ROOT

    services = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    api, worker = services["api"], services["worker"]
    assert api["command"] == ["api"] and api["build"]["dockerfile"] == "docker/Dockerfile.api"
    assert api["environment"]["KILN_REDIS_URL"] == worker["environment"]["KILN_REDIS_URL"]
    # The page's images: the gateway reads the workers' local store at the same path.
    assert "KILN_OUTPUT_URL" not in worker["environment"]
    assert "../outputs:/outputs" in [v.split(" ")[0] for v in worker["volumes"]]
    assert api["volumes"] == ["../outputs:/outputs:ro"]
    assert api["ports"] == ["127.0.0.1:8700:8700"] and "readyz" in " ".join(
        api["healthcheck"]["test"]
    )
    dockerfile = (ROOT / "docker" / "Dockerfile.api").read_text()
    runs = [line for line in dockerfile.splitlines() if line.startswith("RUN")]
    assert runs == ["RUN pip install --no-cache-dir '.[api]'"]  # the client and gateway, no torch


def test_an_upload_feeds_img2img_and_the_preview_and_models_are_served(
    gateway: Any, redis_conn: Redis, settings: Any
) -> None:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (128, 128), (200, 40, 40)).save(buffer, format="PNG")
    status, _, body = call(
        "POST",
        gateway.url + "/v1/uploads",
        gateway.token,
        raw=buffer.getvalue(),
        headers={"Content-Type": "image/png"},
    )
    uploaded = json.loads(body)
    assert status == 201 and uploaded["uri"] == f"kiln-input:{uploaded['sha256']}"
    assert (uploaded["width"], uploaded["height"]) == (128, 128)
    wrong_type = call(
        "POST",
        gateway.url + "/v1/uploads",
        gateway.token,
        raw=b"GIF89a",
        headers={"Content-Type": "image/gif"},
    )
    assert wrong_type[0] == 415
    not_an_image = call(
        "POST",
        gateway.url + "/v1/uploads",
        gateway.token,
        raw=b"not a png",
        headers={"Content-Type": "image/png"},
    )
    assert not_an_image[0] == 422 and json.loads(not_an_image[2])["errors"][0]["field"] == "image"

    request = {**REQUEST, "image": uploaded["uri"], "strength": 0.5, "previews": True, "steps": 4}
    status, _, body = call("POST", gateway.url + "/v1/jobs", gateway.token, request)
    assert status == 201, body
    job_id = json.loads(body)["id"]
    assert call("GET", gateway.url + f"/v1/jobs/{job_id}/preview", gateway.token)[0] == 404
    models = json.loads(call("GET", gateway.url + "/v1/models", gateway.token)[2])["models"]
    sd15 = next(m for m in models if m["manifest"]["id"] == "tiny-sd15")
    assert (
        sd15["queued"] == {"interactive": 1, "batch": 0} and sd15["manifest"]["steps"]["max"] == 50
    )
    assert not any(m["manifest"]["benchmark_only"] for m in models)
    queues = json.loads(call("GET", gateway.url + "/v1/queues", gateway.token)[2])["queues"]
    [queue] = [q for q in queues if q["model"] == "tiny-sd15" and q["lane"] == "interactive"]
    assert queue["depth"] == 1

    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    view = json.loads(call("GET", gateway.url + f"/v1/jobs/{job_id}", gateway.token)[2])
    assert view["status"] == "finished" and len(view["result"]["images"]) == 1, view
    status, headers, preview = call(
        "GET", gateway.url + f"/v1/jobs/{job_id}/preview", gateway.token
    )
    assert status == 200 and headers["content-type"] == "image/jpeg" and preview[:2] == b"\xff\xd8"


def test_the_contract_is_generated_from_the_clients_models_and_docs_work_offline(
    gateway: Any,
) -> None:
    from api_client.schema import RenderRequest, RenderResult

    status, _, body = call("GET", gateway.url + "/openapi.json", gateway.token)
    assert status == 200
    schemas = json.loads(body)["components"]["schemas"]
    for model in (RenderRequest, RenderResult):
        own = model.model_json_schema()
        assert set(schemas[model.__name__]["properties"]) == set(own["properties"]), model
        assert schemas[model.__name__].get("required", []) == own.get("required", [])
    status, headers, page = call("GET", gateway.url + "/docs", gateway.token)
    assert status == 200 and b"/docs/assets/swagger-ui-bundle.js" in page
    assert b"cdn" not in page.lower() and b"https://" not in page.split(b"<body>")[-1]
    status, headers, script = call(
        "GET", gateway.url + "/docs/assets/swagger-ui-bundle.js", gateway.token
    )
    assert status == 200 and len(script) > 500_000 and "javascript" in headers["content-type"]


def test_compose_workers_name_their_models_and_pass_the_hub_token() -> None:
    import yaml

    from tests.conftest import ROOT

    worker = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]["worker"]
    env = worker["environment"]
    assert env["KILN_MODELS"] == "${KILN_MODELS:-sdxl-turbo}" and env["HF_TOKEN"] == "${HF_TOKEN:-}"
    assert (ROOT / "manifests" / "sdxl-turbo.yaml").is_file()
    assert "kiln-cache:/cache" in worker["volumes"]  # HF_HOME=/cache/huggingface in the image
    assert "HF_HOME=/cache/huggingface" in (ROOT / "docker" / "Dockerfile.cuda").read_text()
