"""The video families' previews and step caches: a video job that asks for previews gets a frame
of the latest step, its latents projected to RGB by ComfyUI's table for its VAE's latent space
(worker/pipelines/latent_preview.py), in its events and its record; a job with the step cache
reuses steps, says how many, and lands near the exact run's frames."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from redis import Redis

from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.files.video import frame, probe
from worker.pipelines import latent_preview
from worker.render.context import LocalContext


def test_a_latent_pixel_becomes_its_tables_colour_packed_or_not() -> None:
    """ComfyUI's rgb = latent . factors + bias, read from [-1, 1] to 0-255, on the middle latent
    frame; LTX-Video's tokens are unpacked with LTXPipeline's own helper first."""
    from diffusers import LTXPipeline

    space = latent_preview.LTXV
    channel = 37  # one of the table's stronger rows
    latents = torch.zeros(1, space.channels, 3, 2, 3)  # [B, C, F, H, W]: 17 frames of 64 x 96
    latents[0, channel, 1] = 1.0  # the middle frame only
    pipe = SimpleNamespace(
        vae=SimpleNamespace(config=SimpleNamespace(latent_channels=space.channels)),
        vae_spatial_compression_ratio=32,
        vae_temporal_compression_ratio=8,
        transformer_spatial_patch_size=1,
        transformer_temporal_patch_size=1,
        _unpack_latents=LTXPipeline._unpack_latents,
    )
    rgb = np.add(space.factors[channel], space.bias)
    expected = np.round(np.clip((rgb + 1) / 2, 0, 1) * 255)
    packed = LTXPipeline._pack_latents(latents, 1, 1)  # [B, F*H*W, C]
    for given in (latents, packed):
        image = latent_preview.project(pipe, given, 96, 64, 17)
        pixels = np.asarray(image).reshape(-1, 3).astype(np.float64)
        assert image.size == (96, 64)
        assert np.abs(pixels - expected).max() <= 1  # every pixel: float32 rounding apart


def test_a_space_is_told_by_its_vaes_own_channel_field() -> None:
    def vae(**config: int) -> Any:
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert latent_preview.space_for(vae(z_dim=48)) is latent_preview.WAN22
    assert latent_preview.space_for(vae(z_dim=16)) is latent_preview.WAN21
    assert latent_preview.space_for(vae(latent_channels=128)) is latent_preview.LTXV
    assert latent_preview.space_for(vae(latent_channels=16)) is None  # FLUX.1's, tiny-ltx's


@pytest.mark.parametrize("model", ["tiny-wan", "tiny-ltx"])
def test_a_video_job_previews_a_frame_of_its_latest_step(
    redis_conn: Redis, settings: Any, model: str
) -> None:
    client = client_for(redis_conn, settings)
    job = client.submit(
        {"model": model, "prompt": "a heron", "steps": 4, "seed": 2, "previews": True}
        | {"width": 96, "height": 64, "frames": 9}
    )
    burst(redis_conn, make_renderer(settings, [model]), [model])
    result = job.wait(timeout=5)
    seen = [e.preview for e in job.events(timeout=5) if e.preview is not None]
    assert len(seen) == 3  # after steps 1, 2 and 3 of 4: never the last, the decode follows
    shown = []
    for preview in seen:
        with Image.open(io.BytesIO(preview.jpeg() or b"")) as image:
            assert image.size == (96, 64)
            shown.append(np.asarray(image.convert("RGB")).astype(np.float64))
    assert all(pixels.std() > 5 for pixels in shown)  # a picture, not one colour
    assert np.abs(shown[0] - shown[-1]).mean() > 1  # each step's own latents
    [record] = [r for r in records(settings.timings_log) if r.job_id == result.job_id]
    assert record.previews == 3


def _frames(path: str) -> np.ndarray:
    data = Path(path).read_bytes()
    return np.stack([np.asarray(frame(data, i)) for i in range(probe(data).frames)])


@pytest.mark.parametrize(("model", "kind"), [("tiny-wan", "first_block"), ("tiny-ltx", "magcache")])
def test_a_cached_video_job_reuses_steps_near_the_exact_frames(
    make_settings: Any, model: str, kind: str
) -> None:
    """Wan's pipelines name "cond" and "uncond" around their two passes; LTX-Video's batch CFG
    into one pass named "cond_uncond", whose steps the report counts."""
    renderer = make_renderer(make_settings(), [model])
    job = {"model": model, "prompt": "a heron", "steps": 8, "seed": 5, "frames": 9}
    exact = renderer.render({**job, "step_cache": False}, LocalContext(f"{model}-exact"))
    cached = renderer.render({**job, "step_cache": True}, LocalContext(f"{model}-cached"))
    assert exact.step_cache is None and cached.step_cache is not None
    report = cached.step_cache
    assert report.kind == kind and report.steps_reused > 0
    assert report.steps_computed + report.steps_reused == 8
    videos = [_frames(r.videos[0].path or "").astype(np.float64) for r in (exact, cached)]
    assert videos[0].shape == videos[1].shape == (9, 64, 64, 3)
    difference = np.abs(videos[0] - videos[1]).mean()
    assert 0 < difference < 16, difference  # moved by the reused steps, not lost
