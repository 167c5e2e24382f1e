"""Upscaling (#30 item 3): an upscaler is a manifest of its own (family upscaler) loaded with
spandrel; mode upscale takes an image and returns it scale times larger, through a real worker on
tiny-upscaler (a random ESRGAN, spandrel's own architecture); large images go through in
overlapping tiles, and an out-of-memory drill halves the tile, each try an attempt."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from redis import Redis

from api_client import RenderFailed, RequestRejected
from api_client.manifest import Manifest
from tests.support.images import pixels, png
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.pipelines.upscale import tiled

UPSCALER = "tiny-upscaler"


def test_an_upscale_returns_the_image_twice_as_large(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    square, wide = client.upload(png(seed=1)), client.upload(png((192, 128), seed=2))
    jobs = [client.submit({"model": UPSCALER, "image": uri}) for uri in (square, wide, square)]
    burst(redis_conn, make_renderer(settings, [UPSCALER]), [UPSCALER])
    results = [job.wait(timeout=5) for job in jobs]
    assert [(r.images[0].width, r.images[0].height) for r in results] == [
        (256, 256),
        (384, 256),
        (256, 256),
    ]
    assert pixels(results[0].images[0].path).shape == (256, 256, 3)
    # The same image and model give the same pixels (nothing random in an upscale).
    assert np.array_equal(pixels(results[0].images[0].path), pixels(results[2].images[0].path))
    by_id = {r.job_id: r for r in records(settings.timings_log)}
    first, again = by_id[jobs[0].id], by_id[jobs[2].id]
    assert first.mode == "upscale" and first.status == "done"
    assert first.timings.upscale > 0 and first.timings.denoise == 0
    assert first.load_source == "disk" and first.cold
    assert again.timings.load == 0 and not again.cold  # resident across jobs
    assert first.scheduler == "ESRGAN" and first.rung == "full"
    assert [a.outcome for a in first.attempts] == ["ok"]


def test_an_out_of_memory_drill_halves_the_tiles(redis_conn: Redis, make_settings: Any) -> None:
    """Two drilled OOMs at 128 and 64 px tiles: the image runs in 32 px tiles, each try in the
    record; the next job starts at the size that worked."""
    settings = make_settings(faults="oom@upscale:full*2")
    client = client_for(redis_conn, settings)
    source = client.upload(png(seed=4))
    first = client.submit({"model": UPSCALER, "image": source})
    second = client.submit({"model": UPSCALER, "image": source})
    burst(redis_conn, make_renderer(settings, [UPSCALER]), [UPSCALER])
    image = first.wait(timeout=5).images[0]
    assert (image.width, image.height) == (256, 256)
    by_id = {r.job_id: r for r in records(settings.timings_log)}
    tries = [(a.outcome, a.phase, a.detail.split(":")[0]) for a in by_id[first.id].attempts]
    assert tries == [
        ("oom", "upscale", "tile 128px"),
        ("oom", "upscale", "tile 64px"),
        ("ok", "upscale", "tile 32px"),
    ]
    assert [a.detail for a in by_id[second.id].attempts] == ["tile 32px"]
    second.wait(timeout=5)


def test_tiles_blend_back_into_the_untiled_result() -> None:
    """For a model whose output pixel depends on its input pixel alone, tiles with overlap must
    reproduce the one-pass result exactly; the blend weights never reach zero at an edge."""
    model = torch.nn.Upsample(scale_factor=3, mode="nearest")
    batch = torch.rand(1, 3, 70, 45)
    whole = model(batch)
    for tile, overlap in ((32, 8), (16, 4), (64, 0), (40, 16)):
        assert torch.allclose(tiled(model, batch, 3, tile, overlap), whole, atol=1e-6)


def test_upscale_requests_are_refused_naming_field_value_and_rule(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    source, odd = client.upload(png()), client.upload(png((96, 80)))
    cases: list[tuple[dict[str, Any], str]] = [
        ({}, "mode upscale needs an image"),
        ({"image": source, "prompt": "a fox"}, "prompt='a fox': mode upscale takes no prompt"),
        ({"image": source, "steps": 20}, "steps=20: mode upscale takes no steps"),
        ({"image": source, "num_images": 2}, "num_images=2: must be 1"),
        ({"image": source, "mode": "img2img"}, "mode='img2img': must be upscale"),
        ({"image": source, "rung": "model_offload"}, "mode upscale takes no rung"),
        ({"image": source, "width": 6000, "height": 6000}, "makes 12000x12000; an upscale"),
    ]
    for extra, words in cases:
        with pytest.raises(RequestRejected) as caught:
            client.submit({"model": UPSCALER, **extra})
        assert words in str(caught.value), str(caught.value)
    assert redis_conn.keys("rq:job:*") == []
    # Any size: an upscale is the image's (96x80 makes 192x160).
    job = client.submit({"model": UPSCALER, "image": odd})
    burst(redis_conn, make_renderer(settings, [UPSCALER]), [UPSCALER])
    image = job.wait(timeout=5).images[0]
    assert (image.width, image.height) == (192, 160)


def test_a_file_of_another_scale_fails_its_job_naming_both(
    redis_conn: Redis, make_settings: Any, tmp_path: Any
) -> None:
    extra = tmp_path / "manifests"
    extra.mkdir()
    source = make_settings().models_dir / "tiny-upscaler" / "tiny-upscaler-x2.safetensors"
    (extra / "wrong-scale.yaml").write_text(
        f"id: wrong-scale\nfamily: upscaler\nsource: {source}\nscale: 4\n"
    )
    settings = make_settings(manifests=[extra])
    client = client_for(redis_conn, settings)
    job = client.submit({"model": "wrong-scale", "image": client.upload(png())})
    burst(redis_conn, make_renderer(settings, ["wrong-scale"]), ["wrong-scale"])
    with pytest.raises(RenderFailed, match="is a 2x ESRGAN, and the manifest declares scale 4"):
        job.wait(timeout=5)


def test_upscaler_manifests_hold_no_diffusion_fields(tmp_path: Any) -> None:
    from worker.pipelines.pull import fetches

    base = {"id": "u", "family": "upscaler", "source": "owner/repo/x4.pth", "scale": 4}
    upscaler = Manifest.model_validate(base)
    assert upscaler.modes == ["upscale"] and upscaler.steps.max == 1 and upscaler.tile == 512
    # As workers publish it and clients read it back: its fixed steps and guidance pass.
    assert Manifest.model_validate_json(upscaler.model_dump_json()) == upscaler
    [fetch] = fetches(upscaler, tmp_path)
    assert (fetch.repo, fetch.allow_patterns) == ("owner/repo", ["x4.pth"])
    with pytest.raises(ValidationError, match="loras: a diffusion pipeline's fields"):
        Manifest.model_validate({**base, "loras": {"a": {"source": "s", "max_rank": 4}}})
    with pytest.raises(ValidationError, match="resolutions: a diffusion pipeline's fields"):
        Manifest.model_validate({**base, "resolutions": [[512, 512]]})
    with pytest.raises(ValidationError, match="scale: an upscaler names its native scale"):
        Manifest.model_validate({k: v for k, v in base.items() if k != "scale"})
    for bad in ("owner/repo/../x.pth", "owner/repo", "x.exe"):
        with pytest.raises(ValidationError, match="an upscaler's source is its weights file"):
            Manifest.model_validate({**base, "source": bad})
    with pytest.raises(FileNotFoundError, match="nor owner/repo/file on the hub"):
        fetches(Manifest.model_validate({**base, "source": "x4.pth"}), tmp_path)
    diffusion = {
        "id": "d",
        "family": "sd15",
        "source": "x",
        "steps": {"default": 4, "max": 8},
        "guidance": {"default": 1.0, "max": 2.0},
        "resolutions": [[512, 512]],
        "min_vram_gb": 1,
    }
    with pytest.raises(ValidationError, match="scale: family sd15 is no upscaler"):
        Manifest.model_validate({**diffusion, "scale": 4})
    with pytest.raises(ValidationError, match="resolutions: a diffusion model lists at least"):
        Manifest.model_validate({**diffusion, "resolutions": []})


def test_a_hires_pass_returns_scale_times_the_size_in_two_passes(
    redis_conn: Redis, settings: Any
) -> None:
    """Latent and model upscalers on tiny-sd15, latent on tiny-flux (its packed latents are
    unpacked first); the second pass adds to denoise and decode, and the record says passes 2."""
    client = client_for(redis_conn, settings)
    base = {"model": "tiny-sd15", "prompt": "a fox", "steps": 4, "seed": 3}
    plain = client.submit(base)
    latent = client.submit({**base, "hires": {"scale": 1.5}})
    model = client.submit(
        {**base, "hires": {"scale": 2, "upscaler": UPSCALER, "steps": 2, "strength": 0.5}}
    )
    flux = client.submit(
        {"model": "tiny-flux", "prompt": "a fox", "steps": 3, "hires": {"scale": 1.5}}
    )
    models = ["tiny-sd15", "tiny-flux", UPSCALER]
    burst(redis_conn, make_renderer(settings, models), models)
    sizes = [
        (j.wait(timeout=5).images[0].width, j.wait(timeout=5).images[0].height)
        for j in (plain, latent, model, flux)
    ]
    assert sizes == [(128, 128), (192, 192), (256, 256), (192, 192)]
    by_id = {r.job_id: r for r in records(settings.timings_log)}
    one, two = by_id[plain.id], by_id[latent.id]
    assert one.passes == 1 and two.passes == 2
    # 4 steps, then hires strength 0.35 of tiny-sd15's default 8 / 2 = 4 steps: 1 more
    # denoised (SD 1.5's PLMS runs its first timestep twice, in each pass: 5, then 2).
    assert (one.steps_denoised, two.steps_denoised) == (5, 5 + 2) and two.timings.upscale > 0
    assert by_id[model.id].steps_denoised == 5 + 2  # strength 0.5 of 2 steps: 1, run twice
    # tiny-flux: half its 4 default steps is 2, too few at 0.35; at 3, diffusers' get_timesteps
    # starts at int(3 - 3 x 0.35) = 1 and runs 2.
    assert by_id[flux.id].steps_denoised == 3 + 2
    assert by_id[model.id].timings.upscale > 0
    assert any(a.phase == "upscale" for a in by_id[model.id].attempts)
    assert by_id[flux.id].passes == 2 and by_id[flux.id].status == "done"
    result = latent.wait(timeout=5)
    assert result.passes == 2 and result.width == 128  # the request's size; its image's 192


def test_hires_requests_are_refused_naming_field_value_and_rule(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    base = {"model": "tiny-sd15", "prompt": "a fox"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"scale": 1.0}, "hires.scale=1.0: must be above 1 and at most 4"),
        ({"scale": 5}, "hires.scale=5"),
        ({"scale": 1.3}, "128x128 times 1.3 is 166.4x166.4"),
        ({"scale": 2, "strength": 0}, "hires.strength=0"),
        ({"scale": 2, "steps": 2, "strength": 0.3}, "with 2 steps re-noises 0.6 of them"),
        ({"scale": 2, "steps": 99}, "hires.steps=99"),
        ({"scale": 2, "upscaler": "nope"}, "hires.upscaler='nope': must be latent or an upscaler"),
        ({"scale": 2, "upscaler": "tiny-sd15"}, "hires.upscaler='tiny-sd15'"),
    ]
    for hires, words in cases:
        with pytest.raises(RequestRejected) as caught:
            client.submit({**base, "hires": hires})
        assert words in str(caught.value), str(caught.value)
    with pytest.raises(RequestRejected, match="family qwenimage's img2img takes no latents"):
        client.submit({"model": "tiny-qwenimage", "prompt": "a", "hires": {"scale": 2}})
    with pytest.raises(RequestRejected, match="a hires pass follows txt2img only"):
        client.submit({**base, "image": client.upload(png()), "hires": {"scale": 2}})
    assert redis_conn.keys("rq:job:*") == []


def test_a_hires_image_and_an_upscaled_one_replay_from_their_details(
    redis_conn: Redis, settings: Any
) -> None:
    """The details carry the hires pass (and A1111's hires fields) and an upscale's mode and
    input: replaying each renders the same pixels."""
    from pathlib import Path

    from PIL import Image

    from worker.files.details import read_details

    client = client_for(redis_conn, settings)
    models = ["tiny-sd15", UPSCALER]
    hires = client.submit(
        {"model": "tiny-sd15", "prompt": "a fox", "steps": 4, "seed": 9, "hires": {"scale": 1.5}}
    )
    upscaled = client.submit({"model": UPSCALER, "image": client.upload(png(seed=6))})
    burst(redis_conn, make_renderer(settings, models), models)
    firsts = [job.wait(timeout=5).images[0].path for job in (hires, upscaled)]
    assert all(firsts)
    details = [read_details(Path(str(path))) for path in firsts]
    assert details[0].hires is not None and details[0].hires.upscaler == "latent"
    assert details[1].mode == "upscale" and [i.field for i in details[1].inputs] == ["image"]
    with Image.open(str(firsts[0])) as image:
        text = image.text["parameters"]
    assert "Hires upscale: 1.5" in text and "Hires upscaler: Latent" in text, text
    again = [client.submit(d.replay_request().model_dump(exclude_none=True)) for d in details]
    burst(redis_conn, make_renderer(settings, models), models)
    for job, first in zip(again, firsts, strict=True):
        assert np.array_equal(pixels(job.wait(timeout=5).images[0].path), pixels(first))
