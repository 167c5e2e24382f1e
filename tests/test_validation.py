"""Validation on both sides: the client refuses before enqueueing; the worker refuses a raw
payload that skipped the client. Every refusal names field, value and limit; nothing is clamped."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from redis import Redis

from api_client import RenderFailed, RenderRequest, RequestRejected
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import enqueue_raw, records

BASE: dict[str, Any] = {"model": "tiny-sd15", "prompt": "a red fox", "steps": 2, "seed": 1}

# (label, overrides, field named, words of the rule)
REJECTIONS = [
    ("steps over max", {"steps": 51}, "steps", "50"),
    ("steps zero", {"steps": 0}, "steps", "between 1 and 50"),
    ("guidance over cap", {"guidance": 15.5}, "guidance", "15.0"),
    ("guidance negative", {"guidance": -1.0}, "guidance", "between 0"),
    ("size not in manifest", {"width": 512, "height": 512}, "width x height", "128x128"),
    ("unknown model", {"model": "nope"}, "model", "unknown model"),
    ("empty prompt", {"prompt": "   "}, "prompt", "must not be empty"),
    ("oversized prompt", {"prompt": "x" * 4001}, "prompt", "4000"),
    ("seed negative", {"seed": -1}, "seed", "4294967295"),
    ("seed too big", {"seed": 2**32}, "seed", "4294967295"),
    ("too many images", {"num_images": 5}, "num_images", "between 1 and 4"),
    ("no images", {"num_images": 0}, "num_images", "between 1 and 4"),
    ("wrong type", {"steps": "8"}, "steps", "valid integer"),
    ("bool as int", {"steps": True}, "steps", "valid integer"),
    ("extra field", {"scheduler": "euler"}, "scheduler", "Extra inputs"),
    ("bad format", {"output_format": "gif"}, "output_format", "png"),
]


@pytest.mark.parametrize(
    ("label", "overrides", "field", "rule"), REJECTIONS, ids=[r[0] for r in REJECTIONS]
)
def test_client_rejects_before_enqueueing(
    redis_conn: Redis, settings: Any, label: str, overrides: dict[str, Any], field: str, rule: str
) -> None:
    client = client_for(redis_conn, settings)
    with pytest.raises(RequestRejected) as caught:
        client.submit({**BASE, **overrides})
    message = str(caught.value)
    assert field in message and rule in message, message
    assert any(p.field == field for p in caught.value.problems)
    assert redis_conn.keys("rq:job:*") == []  # nothing was enqueued


def test_defaults_come_from_the_manifest_and_nothing_is_clamped(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    resolved = client.validate({"model": "tiny-sdxl", "prompt": "p"})
    assert (resolved.steps, resolved.guidance, resolved.width, resolved.height) == (
        8,
        6.0,
        128,
        128,
    )
    assert resolved.seed is not None and 0 <= resolved.seed < 2**32
    limit = client.validate({"model": "tiny-sdxl", "prompt": "p", "steps": 50, "guidance": 12.0})
    assert (limit.steps, limit.guidance) == (50, 12.0)


def test_benchmark_only_models_are_refused_for_jobs(redis_conn: Redis, settings: Any) -> None:
    from worker.manifest import load_manifests, publish_manifests

    manifests = load_manifests(settings.manifests, ["tiny-sd15"])
    publish_manifests(
        redis_conn,
        {"tiny-sd15": manifests["tiny-sd15"].model_copy(update={"benchmark_only": True})},
    )
    with pytest.raises(RequestRejected, match="benchmark_only"):
        client_for(redis_conn, settings).submit(BASE)


def test_client_validates_against_published_manifests(redis_conn: Redis, settings: Any) -> None:
    """What workers publish wins over the local directory: a tighter cap there is enforced."""
    from worker.manifest import load_manifests, publish_manifests

    tiny = load_manifests(settings.manifests, ["tiny-sd15"])["tiny-sd15"]
    tighter = tiny.model_copy(update={"steps": tiny.steps.model_copy(update={"max": 10})})
    publish_manifests(redis_conn, {"tiny-sd15": tighter})
    with pytest.raises(RequestRejected, match="between 1 and 10"):
        client_for(redis_conn, settings).submit({**BASE, "steps": 11})


WORKER_REJECTIONS = [
    ("steps over max", {**BASE, "steps": 500}, "steps=500"),
    ("unknown model", {**BASE, "model": "nope"}, "unknown model"),
    ("wrong type", {**BASE, "width": "wide"}, "width"),
    ("not an object", ["a", "list"], "must be a JSON object"),
]


@pytest.mark.parametrize(
    ("label", "payload", "words"), WORKER_REJECTIONS, ids=[r[0] for r in WORKER_REJECTIONS]
)
def test_worker_revalidates_raw_payloads_and_takes_the_next_job(
    redis_conn: Redis, settings: Any, label: str, payload: Any, words: str
) -> None:
    bad = enqueue_raw(redis_conn, "tiny-sd15", {"request": payload})
    good = client_for(redis_conn, settings).submit(BASE)
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    with pytest.raises(RenderFailed) as caught:
        client_for(redis_conn, settings).job(bad).wait(timeout=5)
    assert words in caught.value.message
    assert good.wait(timeout=5).images  # the worker carried on
    log = records(settings.timings_log)
    assert [r.status for r in log] == ["failed", "done"]  # one record per job, failed ones too
    assert words in (log[0].error or "")


def test_request_model_is_strict_and_frozen() -> None:
    request = RenderRequest(model="m", prompt="p")
    with pytest.raises(ValidationError):
        request.steps = 3  # type: ignore[misc]


# The families' guidance rules (issue 16): what each refuses names field, value and rule.
FAMILY_REJECTIONS = [
    (
        "negative prompt without true CFG on flux",
        {"model": "tiny-flux", "negative_prompt": "blurry"},
        "negative_prompt",
        "true_cfg is 1; the negative prompt needs true_cfg above 1 on tiny-flux",
    ),
    (
        "true_cfg on a model without it",
        {"model": "tiny-zimage", "true_cfg": 3.0},
        "true_cfg",
        "model tiny-zimage has no true CFG",
    ),
    (
        "true_cfg over its cap",
        {"model": "tiny-flux", "true_cfg": 9.0},
        "true_cfg",
        "between 1 (off) and 8.0",
    ),
    (
        "guidance on a true-CFG model",
        {"model": "tiny-qwenimage", "guidance": 4.0},
        "guidance",
        "its CFG is true_cfg",
    ),
    (
        "negative prompt on a CFG-free turbo",
        {"model": "tiny-zimage", "negative_prompt": "blurry"},
        "negative_prompt",
        "guidance is 0; the negative prompt needs guidance above 0",
    ),
    (
        "negative prompt with CFG off on sd15",
        {"model": "tiny-sd15", "guidance": 1.0, "negative_prompt": "blurry"},
        "negative_prompt",
        "needs guidance above 1",
    ),
    (
        "size off the flux grid",
        {"model": "tiny-flux", "width": 136, "height": 128},
        "width x height",
        "must be one of 128x128",
    ),
]


@pytest.mark.parametrize(
    ("label", "overrides", "field", "rule"),
    FAMILY_REJECTIONS,
    ids=[r[0] for r in FAMILY_REJECTIONS],
)
def test_family_rules_refuse_at_submit(
    redis_conn: Redis, settings: Any, label: str, overrides: dict[str, Any], field: str, rule: str
) -> None:
    with pytest.raises(RequestRejected) as caught:
        client_for(redis_conn, settings).submit({**BASE, **overrides})
    assert [p.field for p in caught.value.problems] == [field]
    assert rule in str(caught.value), str(caught.value)
    assert redis_conn.keys("rq:job:*") == []


def test_family_defaults_and_what_they_allow(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    qwen = client.validate({"model": "tiny-qwenimage", "prompt": "p", "negative_prompt": "blur"})
    assert (qwen.guidance, qwen.true_cfg) == (0.0, 4.0)  # true CFG on by default, as the card's
    flux = client.validate({"model": "tiny-flux", "prompt": "p"})
    assert (flux.guidance, flux.true_cfg) == (3.5, 1.0)  # embedded guidance; true CFG off
    steered = client.validate(
        {"model": "tiny-flux", "prompt": "p", "negative_prompt": "blur", "true_cfg": 3.0}
    )
    assert steered.true_cfg == 3.0
    assert client.validate({"model": "tiny-sd15", "prompt": "p"}).true_cfg is None
