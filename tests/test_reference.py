"""A reference image through an IP-Adapter (#30 item 2): a manifest's ip_adapter (the adapter
and its image encoder), a request's `reference: {image, strength}`, the adapter read at the
first job with one and kept beside the resident pipeline, placed by its rung, engaged in the
denoiser only for the jobs that have a reference. strength 0 renders the same pixels as none,
and a job after a reference job renders as it did before any; refusals name field, value and
rule; the reference image travels with the image's details so a replay finds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from pydantic import ValidationError
from redis import Redis

from api_client import RequestRejected
from api_client.manifest import Manifest, load_manifest_file
from api_client.references import parse_reference_flag
from api_client.resolve import resolve_request
from api_client.schema import ReferenceChoice, ReferenceReport, RenderRequest
from tests.conftest import ROOT
from tests.support.images import mask_png, pixels, png, square_png
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.files.details import parameters_text, read_details

BASE: dict[str, Any] = {"model": "tiny-sd15", "prompt": "a fox", "steps": 3, "seed": 7}


def test_a_reference_steers_the_render_and_strength_0_is_no_reference(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    # Any size: the encoder's processor resizes and crops it (here 200x150 for a 128x128 job).
    ref, other = client.upload(png((200, 150), seed=3)), client.upload(png(seed=9))
    source, mask, edges = (
        client.upload(png()),
        client.upload(mask_png()),
        client.upload(square_png()),
    )
    plain = client.submit(BASE)
    off = client.submit({**BASE, "reference": {"image": ref, "strength": 0.0}})
    on = client.submit({**BASE, "reference": {"image": ref}})
    half = client.submit({**BASE, "reference": {"image": ref, "strength": 0.5}})
    elsewhere = client.submit({**BASE, "reference": {"image": other}})
    after = client.submit(BASE)  # the denoiser's own attention is back
    pair = {**BASE, "num_images": 2}
    pair_plain, pair_off = (
        client.submit(pair),
        client.submit({**pair, "reference": {"image": ref, "strength": 0}}),
    )
    img2img = {**BASE, "image": source, "strength": 0.7}
    i2i_plain, i2i_off = (
        client.submit(img2img),
        client.submit({**img2img, "reference": {"image": ref, "strength": 0}}),
    )
    i2i_on = client.submit({**img2img, "reference": {"image": ref}})
    inpaint = {**BASE, "image": source, "mask": mask}
    inp_plain, inp_on = (
        client.submit(inpaint),
        client.submit({**inpaint, "reference": {"image": ref}}),
    )
    hires = {**BASE, "hires": {"scale": 2}}  # its second pass runs with the reference too
    hires_plain = client.submit(hires)
    hires_off = client.submit({**hires, "reference": {"image": ref, "strength": 0}})
    hires_on = client.submit({**hires, "reference": {"image": ref}})
    control = {**BASE, "controls": [{"name": "canny", "image": edges}]}
    ctl_plain, ctl_off = (
        client.submit(control),
        client.submit({**control, "reference": {"image": ref, "strength": 0}}),
    )
    ctl_on = client.submit({**control, "reference": {"image": ref}})
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])

    def shown(job: Any, index: int = 0) -> Any:
        return pixels(job.wait(timeout=5).images[index].path)

    assert np.array_equal(shown(plain), shown(off)), "strength 0 must render what none renders"
    assert np.array_equal(shown(plain), shown(after)), "a reference job left its adapter engaged"
    for index in range(2):
        assert np.array_equal(shown(pair_plain, index), shown(pair_off, index))
    assert np.array_equal(shown(i2i_plain), shown(i2i_off))
    assert np.array_equal(shown(ctl_plain), shown(ctl_off))
    assert np.array_equal(shown(hires_plain), shown(hires_off))
    assert shown(hires_on).shape == (256, 256, 3)
    for base, steered in (
        (plain, on),
        (plain, half),
        (on, half),
        (on, elsewhere),
        (i2i_plain, i2i_on),
        (inp_plain, inp_on),
        (ctl_plain, ctl_on),
        (hires_plain, hires_on),
    ):
        assert not np.array_equal(shown(base), shown(steered)), (
            f"{steered.id} ignored its reference"
        )

    by_id = {r.job_id: r for r in records(settings.timings_log)}
    assert by_id[on.id].reference == ReferenceReport(strength=1.0)
    assert by_id[half.id].reference == ReferenceReport(strength=0.5)
    assert by_id[plain.id].reference is None
    assert on.wait(timeout=5).reference == ReferenceReport(strength=1.0)
    # Read once, by the first job with a reference (off), in its load phase.
    assert by_id[off.id].timings.load > by_id[on.id].timings.load

    # The image's details carry the reference: its image among the inputs, its strength; the
    # replay request asks for it again, and A1111's parameters name the unit.
    details = read_details(Path(half.wait(timeout=5).images[0].path or ""))
    assert details.reference == ReferenceReport(strength=0.5)
    assert [i.field for i in details.inputs] == ["reference.image"]
    replay = details.replay_request()
    assert replay.reference is not None and replay.reference.strength == 0.5
    assert replay.reference.image == f"kiln-input:{details.inputs[0].sha256}"
    assert "Weight: 0.5" in parameters_text(details)
    again = client.submit(replay.model_dump(exclude_none=True))
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    assert np.array_equal(shown(half), shown(again)), "a replay must render the same pixels"


def test_each_rung_places_the_adapter_and_renders_what_full_renders(
    redis_conn: Redis, settings: Any
) -> None:
    """Model offload keeps the adapter on the host and moves its encoder on for its pass (the
    denoiser's hook moves the processors in it); group offload streams it at leaf level."""
    client = client_for(redis_conn, settings)
    ref = client.upload(png(seed=3))
    base = {**BASE, "model": "tiny-sdxl", "reference": {"image": ref, "strength": 0.8}}
    rungs = ("full", "model_offload", "group_offload")
    jobs = [client.submit({**base, "rung": rung}) for rung in rungs]
    plain = client.submit({**BASE, "model": "tiny-sdxl", "rung": "group_offload"})
    burst(redis_conn, make_renderer(settings, ["tiny-sdxl"]), ["tiny-sdxl"])
    results = [job.wait(timeout=5) for job in (*jobs, plain)]
    assert [r.rung for r in results] == [*rungs, "group_offload"]
    shown = [pixels(r.images[0].path) for r in results]
    for rung, image in zip(rungs[1:], shown[1:3], strict=True):
        assert np.abs(shown[0] - image).max() <= 1, f"{rung} must render what full renders"
    assert not np.array_equal(shown[2], shown[3])


def test_an_adapter_that_cannot_be_read_fails_its_job_naming_the_file(
    settings: Any, tmp_path: Path
) -> None:
    """A truncated weights file fails the reference job naming it, and the denoiser is as it
    was: the next plain job renders the pixels the one before it did."""
    import base64

    from worker.render.context import LocalContext
    from worker.render.renderer import Renderer

    data = yaml.safe_load((ROOT / "manifests" / "tiny-sd15.yaml").read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "ip-adapter.safetensors").write_bytes(b"not a safetensors file")
    data["ip_adapter"] = {**data["ip_adapter"], "source": str(broken), "subfolder": None}
    renderer = Renderer(settings, {"tiny-sd15": Manifest(**data)})
    image = "data:image/png;base64," + base64.b64encode(png(seed=3)).decode()
    before = renderer.render(BASE, LocalContext("before"))
    with pytest.raises(RuntimeError, match=r"ip_adapter .*broken/ip-adapter.safetensors could"):
        renderer.render({**BASE, "reference": {"image": image}}, LocalContext("broken"))
    after = renderer.render(BASE, LocalContext("after"))
    assert before.images[0].sha256 == after.images[0].sha256


def _resolve(request: dict[str, Any], manifest: str = "tiny-sd15") -> RenderRequest:
    loaded = load_manifest_file(ROOT / "manifests" / f"{manifest}.yaml")
    return resolve_request(RenderRequest(**{**BASE, "model": manifest, **request}), loaded)


def test_refusals_name_field_value_and_rule() -> None:
    ok = _resolve({"reference": {"image": "kiln-input:" + "a" * 64}})
    assert ok.reference == ReferenceChoice(image="kiln-input:" + "a" * 64, strength=1.0)
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {"reference": {"image": "kiln-input:" + "a" * 64, "strength": 2.5}},
            "reference.strength",
            "between 0 and 2",
        ),
        ({"reference": {"image": "/etc/passwd"}}, "reference.image", ""),
    ]
    for request, field, rule in cases:
        with pytest.raises(RequestRejected) as caught:
            _resolve(request)
        problems = {p.field: p for p in caught.value.problems}
        assert field in problems, caught.value
        assert rule in problems[field].rule
    # A family without an IP-Adapter, and a manifest that names none.
    with pytest.raises(RequestRejected, match="manifest names no ip_adapter"):
        _resolve({"reference": {"image": "kiln-input:" + "a" * 64}}, "tiny-flux")


def test_a_manifest_names_its_adapter_only_where_the_family_has_one(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "manifests" / "tiny-sd15.yaml").read_text())
    Manifest(**data)
    for family, said in (
        ("flux", "FLUX.1's IP-Adapter"),
        ("qwenimage", "Qwen-Image has no"),
        ("sd2", "SD 2.x"),
    ):
        flux = yaml.safe_load((ROOT / "manifests" / "tiny-flux.yaml").read_text())
        flux.update(family=family, ip_adapter=data["ip_adapter"])
        with pytest.raises(ValidationError, match=said):
            Manifest(**flux)
    broken = {**data, "ip_adapter": {**data["ip_adapter"], "weight_name": "ip-adapter.ckpt"}}
    with pytest.raises(ValidationError, match=r"safetensors or \.bin file name"):
        Manifest(**broken)
    faceid = {**data["ip_adapter"], "weight_name": "ip-adapter-faceid_sd15.bin"}
    with pytest.raises(ValidationError, match="FaceID adapter carries a LoRA"):
        Manifest(**{**data, "ip_adapter": faceid})


def test_the_reference_flag_takes_a_path_and_a_strength() -> None:
    assert parse_reference_flag("cat.png") == ReferenceChoice(image="cat.png")
    assert parse_reference_flag("cat.png:0.6") == ReferenceChoice(image="cat.png", strength=0.6)
    assert parse_reference_flag("C:/x.png") == ReferenceChoice(image="C:/x.png")
    with pytest.raises(ValueError, match="--reference"):
        parse_reference_flag("")


@pytest.mark.slow  # compiles the tiny UNet twice (plain and with the adapter): about a minute
def test_a_compiled_denoiser_keeps_its_plain_graphs_across_reference_jobs(
    redis_conn: Redis, make_settings: Any
) -> None:
    """Under compile a reference job is another mode, its graphs built at the first one with
    the cause named; after that plain, reference, plain build nothing (the processors put back
    are the same objects), strength 0 still renders what none renders, and the plain pixels are
    the eager pipeline's own."""
    settings = make_settings(compile="on")
    client = client_for(redis_conn, settings)
    ref = client.upload(png(seed=3))
    base = {**BASE, "steps": 2}
    order: list[dict[str, Any] | None] = [None, {"image": ref}, None, {"image": ref}, None]
    order.append({"image": ref, "strength": 0.0})
    jobs = [client.submit({**base, "reference": given}) for given in order]
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    got = records(settings.timings_log)
    assert all(r.status == "done" and r.compiled for r in got), [r.error for r in got]
    assert got[1].recompile_causes and "reference" in got[1].recompile_causes[0]
    assert all(r.recompile_causes == [] for r in got[2:]), [r.recompile_causes for r in got]
    shown = [pixels(job.wait(timeout=5).images[0].path) for job in jobs]
    assert np.array_equal(shown[0], shown[2]) and np.array_equal(shown[0], shown[4])
    assert np.array_equal(shown[1], shown[3]) and not np.array_equal(shown[0], shown[1])
    assert np.array_equal(shown[0], shown[5])
