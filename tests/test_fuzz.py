"""Bad input, generated: hypothesis throws wrong types, huge numbers, odd unicode, missing and
extra fields, zero and negative sizes at submit() and at the raw queue. Every case is refused with
an error naming a field, or renders; a real worker stays up and takes the next job."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis import Redis

from api_client import KilnClient, RenderFailed, RenderRequest, RequestRejected
from tests.conftest import MANIFESTS
from tests.support.inprocess import burst, make_renderer
from tests.support.records import enqueue_raw
from worker.render.renderer import Renderer
from worker.settings import Settings

MODEL = "tiny-sd15"
FIELDS = list(RenderRequest.model_fields)
# 3000-5000 characters (either side of the 4000 limit) made of a short random unit: drawing each
# character would exceed Hypothesis's entropy budget (its data_too_large health check).
long_text = st.builds(
    lambda unit, size: (unit * size)[:size],
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=8),
    st.integers(min_value=3000, max_value=5000),
)
weird_text = st.one_of(
    st.text(max_size=40),
    long_text,
    st.sampled_from(
        [
            "",
            " ",
            "\x00",
            "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
            "🦊" * 1000,
            "\u202e\u0301" * 50,
            "a\nb\tc",
        ]
    ),
)
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    weird_text,
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
IMAGE_REFS = [
    None,
    "kiln-input:" + "0" * 64,
    "kiln-input:xyz",
    "https://attacker.example/a.png",
    "/etc/passwd",
    "file:///etc/passwd",
    "data:image/png;base64,AAAA",
    "data:text/html,hi",
]
plausible = {
    "model": st.sampled_from([MODEL, "tiny-sdxl", "tiny-flux", "nope", ""]),
    "prompt": weird_text,
    "negative_prompt": weird_text,
    "steps": st.integers(min_value=-5, max_value=60),
    "guidance": st.floats(min_value=-2, max_value=20),
    "true_cfg": st.one_of(st.none(), st.floats(min_value=-1, max_value=12)),
    "mode": st.sampled_from(
        [None, "txt2img", "img2img", "inpaint", "edit", "outpaint", "txt2video", "img2video"]
    ),
    "image": st.sampled_from(IMAGE_REFS),
    "mask": st.sampled_from([None, "kiln-input:" + "1" * 64, "s3://other/bucket/m.png", ""]),
    "strength": st.one_of(st.none(), st.floats(min_value=-1, max_value=2)),
    "loras": st.one_of(
        st.none(),
        st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["detail", "style", "nope", ""])},
                optional={"weight": st.floats(min_value=-6, max_value=6)},
            ),
            max_size=5,
        ),
    ),
    "width": st.sampled_from([0, -128, 128, 192, 4096, 10**12]),
    "height": st.sampled_from([0, -128, 128, 192, 4096]),
    "seed": st.integers(min_value=-10, max_value=2**33),
    "num_images": st.integers(min_value=-1, max_value=6),
    "output_format": st.sampled_from(["png", "webp", "jpeg", "gif", "", "mp4", "webm"]),
    # A video model's; the image models served here refuse them, naming the field.
    "frames": st.one_of(st.none(), st.integers(min_value=-1, max_value=40)),
    "fps": st.one_of(st.none(), st.integers(min_value=-1, max_value=70)),
    "previews": st.sampled_from([False, True, 0, "yes"]),
    "webhook": st.sampled_from([None, "nope", "https://attacker.example/hook", "", "a" * 65]),
    "rung": st.sampled_from([None, "full", "model_offload", "group_offload", "partial", "", "x"]),
    "compile": st.sampled_from([None, True, False, "on", 1]),
    "priority": st.sampled_from([None, "interactive", "batch", "urgent", ""]),
    "step_cache": st.sampled_from([None, True, False, "on", 1]),
    "controls": st.one_of(
        st.none(),
        st.lists(
            st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["canny", "depth", "nope", ""]),
                    "image": st.sampled_from(IMAGE_REFS),
                },
                optional={
                    "strength": st.floats(min_value=-1, max_value=3),
                    "start": st.floats(min_value=-0.5, max_value=1.5),
                    "end": st.floats(min_value=-0.5, max_value=1.5),
                    "preprocess": st.sampled_from(["none", "canny", "depth", ""]),
                },
            ),
            max_size=3,
        ),
    ),
    "reference": st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {"image": st.sampled_from(IMAGE_REFS)},
            optional={"strength": st.floats(min_value=-1, max_value=3)},
        ),
    ),
    "hires": st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {"scale": st.sampled_from([0.5, 1, 1.5, 2, 2.1, 4, 5])},
            optional={
                "strength": st.floats(min_value=-0.5, max_value=1.5),
                "steps": st.integers(min_value=-1, max_value=60),
                "upscaler": st.sampled_from(["latent", "tiny-upscaler", "tiny-sd15", "nope", ""]),
            },
        ),
    ),
    "sampler": st.sampled_from([None, "euler", "euler_ancestral", "dpmpp_2m", "Euler a", "", 3]),
    "sigmas": st.sampled_from([None, "normal", "karras", "beta", "simple", ""]),
}


@st.composite
def requests(draw: st.DrawFn) -> Any:
    """A request dict: each field plausible, garbage, or missing; sometimes extra fields; rarely
    not a dict at all."""
    if draw(st.integers(0, 19)) == 0:
        return draw(anything)
    request: dict[str, Any] = {}
    for name in FIELDS:
        choice = draw(st.integers(0, 9))
        if choice < 6:
            request[name] = draw(plausible[name])
        elif choice < 8:
            request[name] = draw(anything)
    if draw(st.booleans()):
        request.update(draw(st.dictionaries(st.text(min_size=1, max_size=8), anything, max_size=2)))
    return request


def clear(message: str) -> bool:
    """A refusal a user can act on: it says what was wrong and with which field."""
    return message.startswith("request rejected") and ("=" in message or ":" in message)


# No health check is suppressed: each example opens its own connection on a flushed database
# (fresh_redis), and the fixtures the tests take are module- and session-scoped, so nothing is
# shared between examples but the renderer, which is meant to be (pipelines stay resident).
RUN = settings(max_examples=40, deadline=None)


@contextmanager
def fresh_redis(redis_url: str) -> Iterator[tuple[Redis, KilnClient]]:
    """One example's connection and client, on a database flushed before and after it."""
    conn = Redis.from_url(redis_url)
    conn.flushdb()
    try:
        yield conn, KilnClient(connection=conn, manifests_dir=MANIFESTS)
    finally:
        conn.flushdb()
        conn.close()


@pytest.mark.slow  # 35 s of renders: make test keeps under 12 minutes; CI runs it
@RUN
@given(batch=st.lists(requests(), min_size=1, max_size=6))
def test_submit_refuses_clearly_or_the_job_renders(
    redis_url: str, renderer_for_fuzz: Renderer, batch: list[Any]
) -> None:
    with fresh_redis(redis_url) as (conn, client):
        accepted = []
        for request in batch:
            try:
                accepted.append(client.submit(request))
            except RequestRejected as exc:
                assert clear(str(exc)) and exc.problems, str(exc)
        last = client.submit({"model": MODEL, "prompt": "still up", "steps": 1})
        burst(conn, renderer_for_fuzz, [MODEL, "tiny-sdxl"])
        for job in accepted:
            assert job.wait(timeout=1).images  # the client let it through: it must render
        assert last.wait(timeout=1).steps == 1


@pytest.mark.slow  # 33 s of renders: make test keeps under 12 minutes; CI runs it
@RUN
@given(
    batch=st.lists(
        st.tuples(requests(), st.sampled_from(["request", "req", "extra", "none"])),
        min_size=1,
        max_size=6,
    )
)
def test_raw_payloads_are_refused_clearly_or_render(
    redis_url: str, renderer_for_fuzz: Renderer, batch: list[tuple[Any, str]]
) -> None:
    with fresh_redis(redis_url) as (conn, client):
        ids = []
        for request, shape in batch:
            kwargs = {"request": request, "extra": 1} if shape == "extra" else {shape: request}
            ids.append(enqueue_raw(conn, MODEL, {} if shape == "none" else kwargs))
        last = client.submit({"model": MODEL, "prompt": "still up", "steps": 1})
        burst(conn, renderer_for_fuzz, [MODEL])
        for job_id in ids:
            try:
                assert client.job(job_id).wait(timeout=1).images
            except RenderFailed as exc:
                assert exc.status == "failed"
                assert clear(exc.message) or exc.message.startswith("refused job"), exc.message
        assert last.wait(timeout=1).steps == 1


# Hypothesis runs many examples per test: one renderer for them all keeps pipelines resident.


@pytest.fixture(scope="module")
def renderer_for_fuzz(
    tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path, redis_url: str
) -> Iterator[Renderer]:
    # A request may pin compile on, which the client lets through: Inductor on this CPU would
    # take minutes a draw, so the fuzz's worker compiles with a fake that changes nothing.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            "worker.pipelines.compile.compile_denoiser", lambda *_args, **_kw: "fake compile (fuzz)"
        )
        yield _fuzz_renderer(tmp_path_factory, tiny_dir, redis_url)


def _fuzz_renderer(
    tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path, redis_url: str
) -> Renderer:
    out = tmp_path_factory.mktemp("fuzz-out")
    settings_ = Settings(  # type: ignore[call-arg]
        redis_url=redis_url,
        manifests=MANIFESTS,
        models_dir=tiny_dir,
        output_dir=out,
        timings_log=out / "timings.jsonl",
        inductor_cache_dir=out / "inductor",
    )
    return make_renderer(settings_, [MODEL, "tiny-sdxl"])
