"""ControlNet per job (#30 item 1): a manifest's controlnets, a request's controls (up to two,
each with its image, strength, share of steps and preprocess), loaded beside the resident
pipeline and placed by its rung, through a real worker on every tiny family that has one (sd15,
sdxl's union, sd3, flux, qwenimage, zimage). strength 0 renders the same pixels as no control;
refusals name field, value and rule; the control's image travels with the image's details so a
replay finds it."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError
from redis import Redis

from api_client import RenderFailed, RequestRejected
from api_client.controls import (
    ControlNetSpec,
    check_control_names,
    parse_control_flag,
    resolve_controls,
)
from api_client.errors import Problem
from api_client.manifest import Manifest
from api_client.schema import ControlChoice, RenderRequest
from tests.conftest import kiln
from tests.support.images import mask_png, pixels, png, square_png
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import enqueue_raw, records
from worker.files.details import read_details
from worker.pipelines.control import canny

BASE: dict[str, Any] = {"model": "tiny-sd15", "prompt": "a fox", "steps": 3, "seed": 7}


def test_a_control_steers_the_render_and_strength_0_is_no_control(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    edges, other = client.upload(square_png()), client.upload(png(seed=3))
    plain = client.submit(BASE)
    off = client.submit({**BASE, "controls": [{"name": "canny", "image": edges, "strength": 0.0}]})
    on = client.submit({**BASE, "controls": [{"name": "canny", "image": edges}]})
    half = client.submit({**BASE, "controls": [{"name": "canny", "image": edges, "end": 0.5}]})
    found = client.submit(
        {**BASE, "controls": [{"name": "canny", "image": other, "preprocess": "canny"}]}
    )
    given = client.submit({**BASE, "controls": [{"name": "canny", "image": other}]})
    both = client.submit(
        {
            **BASE,
            "controls": [
                {"name": "canny", "image": edges},
                {"name": "depth", "image": other, "strength": 0.5},
            ],
        }
    )
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    jobs = (plain, off, on, half, found, given, both)
    shown = [pixels(job.wait(timeout=5).images[0].path) for job in jobs]
    assert np.array_equal(shown[0], shown[1]), "strength 0 must render what no control renders"
    for index in range(2, len(jobs)):
        assert not np.array_equal(shown[0], shown[index]), f"job {index} ignored its control"
    assert not np.array_equal(shown[2], shown[3]), "end 0.5 must differ from the whole schedule"
    assert not np.array_equal(shown[4], shown[5]), "canny preprocess must change what it reads"
    by_id = {r.job_id: r for r in records(settings.timings_log)}
    record = by_id[both.id]
    assert record.status == "done"
    assert [(c.name, c.strength, c.start, c.end) for c in record.controls] == [
        ("canny", 1.0, 0.0, 1.0),
        ("depth", 0.5, 0.0, 1.0),
    ]
    assert by_id[found.id].controls[0].preprocess == "canny"
    assert both.wait(timeout=5).controls == record.controls
    # The ControlNets were read once, by the first job that named each: the load phase.
    assert by_id[on.id].timings.load < by_id[off.id].timings.load + 5


def test_flux_controls_in_txt2img_and_strength_0_is_no_control(
    redis_conn: Redis, settings: Any
) -> None:
    """FLUX.1's control pipeline VAE-samples its control image from the job's generators: kiln
    draws the starting noise first, so the noise is the same with or without a control."""
    client = client_for(redis_conn, settings)
    edges = client.upload(square_png())
    base = {"model": "tiny-flux", "prompt": "a fox", "steps": 3, "seed": 2, "num_images": 2}
    plain = client.submit(base)
    off = client.submit({**base, "controls": [{"name": "canny", "image": edges, "strength": 0}]})
    on = client.submit({**base, "controls": [{"name": "canny", "image": edges}]})
    burst(redis_conn, make_renderer(settings, ["tiny-flux"]), ["tiny-flux"])
    results = [job.wait(timeout=5) for job in (plain, off, on)]
    for index in range(2):
        shown = [pixels(result.images[index].path) for result in results]
        assert np.array_equal(shown[0], shown[1])
        assert not np.array_equal(shown[0], shown[2])


@pytest.mark.slow  # ten SDXL renders (18 s): make test keeps under 12 minutes; CI runs it
def test_sdxl_union_controls_in_every_mode_and_strength_0_is_no_control(
    redis_conn: Redis, settings: Any
) -> None:
    """SDXL's union pipelines in txt2img, img2img and inpaint, the mode index from the entry;
    two entries on one union checkpoint stack."""
    client = client_for(redis_conn, settings)
    edges, source, mask = (
        client.upload(square_png()),
        client.upload(png()),
        client.upload(mask_png()),
    )
    base = {"model": "tiny-sdxl", "prompt": "a fox", "steps": 3, "seed": 4}
    modes: list[dict[str, Any]] = [
        {},
        {"image": source, "strength": 0.7},
        {"image": source, "mask": mask},
    ]
    jobs = []
    for extra in modes:
        for controls in (
            None,
            [{"name": "canny", "image": edges, "strength": 0.0}],
            [{"name": "canny", "image": edges}],
        ):
            jobs.append(client.submit({**base, **extra, "controls": controls}))
    depth = {"name": "depth", "image": client.upload(png(seed=5)), "strength": 0.5}
    both = client.submit({**base, "controls": [{"name": "canny", "image": edges}, depth]})
    burst(redis_conn, make_renderer(settings, ["tiny-sdxl"]), ["tiny-sdxl"])
    shown = [pixels(job.wait(timeout=5).images[0].path) for job in (*jobs, both)]
    for mode, first in zip(("txt2img", "img2img", "inpaint"), range(0, 9, 3), strict=True):
        plain, off, on = shown[first : first + 3]
        assert np.array_equal(plain, off), f"{mode}: strength 0 must render what no control renders"
        assert not np.array_equal(plain, on), f"{mode}: the control was ignored"
    assert not np.array_equal(shown[2], shown[9]), "the second control was ignored"
    by_id = {r.job_id: r for r in records(settings.timings_log)}
    assert [c.name for c in by_id[both.id].controls] == ["canny", "depth"]
    assert [by_id[job.id].mode for job in jobs[::3]] == ["txt2img", "img2img", "inpaint"]


@pytest.mark.parametrize(
    ("model", "extra"),
    [
        ("tiny-sd3", {}),
        # Qwen-Image's control pipeline draws from the job's generators before the noise: kiln
        # draws each image's noise first (two images: one generator each).
        ("tiny-qwenimage", {"num_images": 2}),
        ("tiny-zimage", {}),
    ],
)
def test_a_transformer_family_steers_with_a_control_and_repeats_it(
    redis_conn: Redis, settings: Any, model: str, extra: dict[str, Any]
) -> None:
    """strength 0 renders what no control renders, strength 1 differs, and the same controlled
    job renders the same pixels again: SD3's pipeline VAE-samples its control image from torch's
    global RNG, which kiln seeds from the job's seed for the call (control.seeded_call)."""
    client = client_for(redis_conn, settings)
    edges = client.upload(square_png())
    base = {"model": model, "prompt": "a fox", "steps": 2, "seed": 5, **extra}
    control = {"name": "canny", "image": edges}
    jobs = [
        client.submit(base),
        client.submit({**base, "controls": [{**control, "strength": 0.0}]}),
        client.submit({**base, "controls": [control]}),
        client.submit({**base, "controls": [control]}),
    ]
    burst(redis_conn, make_renderer(settings, [model]), [model])
    results = [job.wait(timeout=5) for job in jobs]
    for index in range(len(results[0].images)):
        plain, off, on, again = (pixels(result.images[index].path) for result in results)
        assert np.array_equal(plain, off), "strength 0 must render what no control renders"
        assert not np.array_equal(plain, on), "the control was ignored"
        assert np.array_equal(on, again), "the same controlled job must render the same pixels"


def test_a_control_in_img2img_and_inpaint_and_at_an_offload_rung(
    redis_conn: Redis, settings: Any
) -> None:
    """sd15's control pipelines for img2img and inpaint; at model_offload the ControlNet is on
    the device for the denoise only, and renders what it renders at full."""
    client = client_for(redis_conn, settings)
    source, mask, edges = (
        client.upload(png()),
        client.upload(mask_png()),
        client.upload(square_png()),
    )
    control = [{"name": "canny", "image": edges}]
    jobs = [
        client.submit({**BASE, "image": source, "strength": 0.6}),
        client.submit({**BASE, "image": source, "strength": 0.6, "controls": control}),
        client.submit({**BASE, "image": source, "mask": mask, "controls": control}),
        client.submit({**BASE, "controls": control, "rung": "full"}),
        client.submit({**BASE, "controls": control, "rung": "model_offload"}),
    ]
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    shown = [pixels(job.wait(timeout=5).images[0].path) for job in jobs]
    assert not np.array_equal(shown[0], shown[1])
    by_id = {r.job_id: r for r in records(settings.timings_log)}
    assert by_id[jobs[2].id].mode == "inpaint" and by_id[jobs[2].id].controls
    assert by_id[jobs[4].id].rung == "model_offload"
    assert np.abs(shown[3] - shown[4]).max() <= 1  # offload hooks change no math, on a CPU


def test_controls_are_refused_naming_field_value_and_rule(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    edges, small = client.upload(square_png()), client.upload(png((64, 64)))
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"controls": [{"name": "pose", "image": edges}]}, "controls.0.name", "canny, depth"),
        (
            {"controls": [{"name": "canny", "image": edges}, {"name": "canny", "image": edges}]},
            "controls.1.name",
            "named twice",
        ),
        ({"controls": [{"name": "canny", "image": edges, "strength": 2.5}]}, "strength", "0 and 2"),
        (
            {"controls": [{"name": "canny", "image": edges, "start": 0.6, "end": 0.4}]},
            "start",
            "below end",
        ),
        (
            {"controls": [{"name": "canny", "image": edges, "end": 1.5}]},
            "controls.0.end",
            "0 and 1",
        ),
        (
            {"controls": [{"name": "depth", "image": edges, "preprocess": "canny"}]},
            "controls.0.preprocess",
            "depth one",
        ),
        ({"controls": [{"name": "canny", "image": small}]}, "controls.0.image", "job's size"),
        (
            {"controls": [{"name": "canny", "image": "http://example.com/a.png"}]},
            "controls.0.image",
            "",
        ),
    ]
    for extra, field, words in cases:
        with pytest.raises(RequestRejected) as caught:
            client.submit({**BASE, **extra})
        text = str(caught.value)
        assert field in text and words in text, text
    with pytest.raises(RequestRejected, match=r"controls.*tiny-flux2's manifest allows no"):
        client.submit(
            {**BASE, "model": "tiny-flux2", "controls": [{"name": "canny", "image": edges}]}
        )
    source = client.upload(png())
    for model in ("tiny-flux", "tiny-sd3", "tiny-qwenimage", "tiny-zimage"):
        family = model.removeprefix("tiny-")
        with pytest.raises(RequestRejected, match=f"{family} takes a control in txt2img only"):
            client.submit(
                {
                    "model": model,
                    "prompt": "a fox",
                    "image": source,
                    "controls": [{"name": "canny", "image": edges}],
                }
            )
    zimage = {**BASE, "model": "tiny-zimage"}
    for field, value, words in (("start", 0.2, "must be 0 on"), ("end", 0.5, "must be 1 on")):
        with pytest.raises(RequestRejected) as caught:
            client.submit({**zimage, "controls": [{"name": "canny", "image": edges, field: value}]})
        text = str(caught.value)
        assert f"controls.0.{field}" in text and words in text and "control_guidance" in text, text
    with pytest.raises(RequestRejected, match="qwenimage takes one control"):
        client.submit(
            {
                **BASE,
                "model": "tiny-qwenimage",
                "controls": [{"name": "canny", "image": edges}] * 2,
            }
        )
    three = [{"name": "canny", "image": edges}] * 3
    with pytest.raises(RequestRejected, match="controls"):
        client.submit({**BASE, "controls": three})


def test_the_worker_checks_a_control_image_again(redis_conn: Redis, settings: Any) -> None:
    """A producer that skips the client's checks: the worker reads the control image itself and
    fails the job naming the field and the size."""
    client = client_for(redis_conn, settings)
    small = client.upload(png((64, 64)))
    job_id = enqueue_raw(
        redis_conn,
        "tiny-sd15",
        {"request": {**BASE, "controls": [{"name": "canny", "image": small}]}},
    )
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    with pytest.raises(RenderFailed, match=r"controls.0.image .*is 64x64, not the job's size"):
        client.job(job_id).wait(timeout=5)


def test_a_controlled_image_carries_its_controls_and_replays(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    edges = client.upload(png(seed=9))
    request = {
        **BASE,
        "controls": [{"name": "canny", "image": edges, "strength": 0.7, "preprocess": "canny"}],
    }
    first = client.submit(request)
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    path = first.wait(timeout=5).images[0].path
    assert path is not None
    details = read_details(Path(path))
    assert [c.name for c in details.controls] == ["canny"]
    assert any(i.field == "controls.0.image" for i in details.inputs)
    with Image.open(path) as image:
        assert 'ControlNet 0: "Module: canny, Model: canny, Weight: 0.7' in image.text["parameters"]
    replay = details.replay_request()
    assert replay.controls is not None and replay.controls[0].image == edges
    again = client.submit(replay.model_dump(exclude_none=True))
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    assert np.array_equal(pixels(again.wait(timeout=5).images[0].path), pixels(path))


def test_manifests_refuse_controlnets_where_the_family_has_none() -> None:
    base = {
        "id": "m",
        "source": "x",
        "steps": {"default": 4, "max": 8},
        "guidance": {"default": 1.0, "max": 2.0},
        "resolutions": [[128, 128]],
        "min_vram_gb": 1,
        "controlnets": {"canny": {"source": "c", "kind": "canny"}},
    }
    with pytest.raises(ValidationError, match=r"FLUX\.2 klein has no ControlNet"):
        Manifest.model_validate({**base, "family": "flux2"})
    kontext = {**base, "family": "flux", "modes": ["txt2img", "edit"]}
    with pytest.raises(ValidationError, match="edit model's pipeline takes no ControlNet"):
        Manifest.model_validate(kontext)
    with pytest.raises(ValidationError, match="controlnet name"):
        Manifest.model_validate(
            {
                **base,
                "family": "sd15",
                "controlnets": {"Bad Name": {"source": "c", "kind": "canny"}},
            }
        )
    assert Manifest.model_validate({**base, "family": "sd15"}).controlnets["canny"].kind == "canny"


def test_a_union_family_needs_each_entry_s_mode() -> None:
    """SDXL's ControlNet is a union model: an entry without union_mode is refused by the
    manifest's check given the family, and where a request names it, naming entry and rule."""
    entries = {"canny": ControlNetSpec(source="c", kind="canny")}
    with pytest.raises(ValueError, match=r"controlnets.canny: union_mode=None: family sdxl"):
        check_control_names(entries, "sdxl")
    assert check_control_names(entries, "sd3") == entries
    problems: list[Problem] = []
    choice = ControlChoice(name="canny", image="kiln-input:" + "a" * 64)
    assert resolve_controls([choice], entries, "m", "sdxl", "txt2img", problems) == []
    [problem] = problems
    assert problem.field == "controls.0.name" and "union model" in problem.rule
    with_mode = {"canny": ControlNetSpec(source="c", kind="canny", union_mode=3)}
    assert check_control_names(with_mode, "sdxl") == with_mode


def test_the_submit_flag_spells_a_control() -> None:
    assert parse_control_flag("canny:/tmp/a.png").model_dump(exclude_none=True) == {
        "name": "canny",
        "image": "/tmp/a.png",
    }
    assert parse_control_flag("canny:/tmp/a.png:0.5").strength == 0.5
    assert parse_control_flag("canny:C:/x.png").image == "C:/x.png"
    for bad in ("canny", "canny:", ":a.png"):
        with pytest.raises(ValueError, match="NAME:PATH"):
            parse_control_flag(bad)
    with pytest.raises(RequestRejected, match=r"controls.0.image.*Field required"):
        RenderRequest.parse({**BASE, "controls": [{"name": "canny"}]})


def test_canny_finds_the_outline_of_a_square_one_pixel_wide() -> None:
    edges = np.asarray(canny(Image.open(io.BytesIO(square_png()))).convert("L")) > 0
    assert edges.shape == (128, 128)
    rows, cols = np.nonzero(edges)
    # Every edge pixel lies on the square's border (within a pixel of it), none inside or out.
    on_border = (
        (np.abs(rows - 32) <= 1)
        | (np.abs(rows - 95) <= 1)
        | (np.abs(cols - 32) <= 1)
        | (np.abs(cols - 95) <= 1)
    )
    assert on_border.all()
    assert not edges[40:88, 40:88].any() and not edges[:24].any()
    # Thin: each side is one line, not the two-pixel-wide band the raw gradient marks.
    assert edges[64, 20:44].sum() == 1 and edges[20:44, 64].sum() == 1
    # Flat images have no edges; noise well under the low threshold none either.
    assert not (np.asarray(canny(Image.new("RGB", (64, 64), (90, 90, 90)))) > 0).any()


def test_kiln_submit_uploads_a_control_image_and_queues_its_control(
    kiln_env: dict[str, str], redis_conn: Redis, tmp_path: Path
) -> None:
    from rq.job import Job
    from rq.serializers import JSONSerializer

    edges = tmp_path / "edges.png"
    edges.write_bytes(square_png())
    flags = ("--control", f"canny:{edges}:0.5", "--control-preprocess", "canny", "--json")
    queued = kiln("submit", "a fox", "--model", "tiny-sd15", *flags, env=kiln_env)
    assert queued.returncode == 0, queued.stderr
    stored = Job.fetch(
        json.loads(queued.stdout)["job_id"], connection=redis_conn, serializer=JSONSerializer
    )
    [control] = stored.kwargs["request"]["controls"]
    assert control["image"].startswith("kiln-input:") and control["strength"] == 0.5
    assert control["preprocess"] == "canny"
    refused = kiln("submit", "a fox", "--model", "tiny-sd15", "--control", "canny", env=kiln_env)
    assert refused.returncode == 2 and "NAME:PATH" in refused.stderr


def test_kiln_pull_fetches_a_union_controlnet_once(tmp_path: Path) -> None:
    from api_client.manifest import load_manifest_file
    from tests.conftest import MANIFESTS
    from worker.pipelines.pull import fetches

    manifest = load_manifest_file(MANIFESTS / "flux1-dev.yaml")
    assert len(manifest.controlnets) == 4  # canny, tile, depth, pose: one checkpoint
    union = [f for f in fetches(manifest, tmp_path) if "Controlnet-Union" in f.repo]
    assert [f.allow_patterns for f in union] == [
        [
            "config.json",
            "diffusion_pytorch_model.safetensors",
            "diffusion_pytorch_model-*",
            "diffusion_pytorch_model.safetensors.index.json",
        ]
    ]


def test_the_client_s_control_modes_are_the_worker_s_pipelines() -> None:
    """api_client.controls.CONTROL_MODES (what a request may ask, no torch) and each family's
    control pipelines in the worker name the same modes."""
    from api_client.controls import CONTROL_MODES
    from worker.pipelines.families import SPECS

    for family, spec in SPECS.items():
        control = spec.control
        served = set(control.pipelines) if control is not None else set()
        assert served == set(CONTROL_MODES.get(family, ())), family
