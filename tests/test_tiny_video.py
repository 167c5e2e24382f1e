"""Tiny Wan 2.2 TI2V and LTX-Video: each builds, saves and loads back as an ordinary diffusers
directory, renders text-to-video and (from_pipe, the same modules) image-to-video from a seed,
and its latents decode through worker.pipelines.video_decode to the pipeline's own frames."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import (
    DiffusionPipeline,
    LTXImageToVideoPipeline,
    LTXPipeline,
    WanImageToVideoPipeline,
    WanPipeline,
)
from PIL import Image

from worker.pipelines.tiny.ltx import ltx
from worker.pipelines.tiny.wan import wan
from worker.pipelines.video_decode import decode_ltx, decode_wan

FRAMES = 9  # 4k+1 for Wan, 8k+1 for LTX
STEPS = 2
# LTX-Video 0.9.1's decoder runs at a timestep after mixing in some noise; any nonzero values
# put that path (and its draw from the generator) under test.
LTX_DECODE = {"decode_timestep": 0.05, "decode_noise_scale": 0.025}

Frames = list[list[Image.Image]]


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], DiffusionPipeline]
    text_to_video: type[DiffusionPipeline]
    image_to_video: type[DiffusionPipeline]
    size: int  # the smallest the family's grid allows
    call: dict[str, Any]  # the family's own call arguments
    # (pipe, latents as output_type="latent" returns them, the generator the call used) -> frames
    decode: Callable[[Any, torch.Tensor, torch.Generator], Frames]


FAMILIES = (
    Family(
        "wan",
        wan,
        WanPipeline,
        WanImageToVideoPipeline,
        # 16x VAE, then the DiT's 2x2 patches
        size=32,
        call={},
        decode=lambda pipe, latents, _g: decode_wan(pipe, latents),
    ),
    Family(
        "ltx",
        ltx,
        LTXPipeline,
        LTXImageToVideoPipeline,
        size=32,
        call=LTX_DECODE,
        decode=lambda pipe, latents, g: decode_ltx(
            pipe, latents, 32, 32, FRAMES, **LTX_DECODE, generator=g
        ),
    ),
)
MODES = ("txt2video", "img2video")


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def family(request: pytest.FixtureRequest) -> Family:
    chosen: Family = request.param
    return chosen


@pytest.fixture(scope="module")
def loaded(
    family: Family, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, DiffusionPipeline]]:
    """The family's tiny pipeline saved and loaded back, and its image-to-video twin (from_pipe)."""
    directory: Path = tmp_path_factory.mktemp(f"tiny-{family.name}")
    family.build().save_pretrained(directory, safe_serialization=True)
    pipe = DiffusionPipeline.from_pretrained(directory)
    pipes = {"txt2video": pipe, "img2video": family.image_to_video.from_pipe(pipe)}
    for each in pipes.values():
        each.set_progress_bar_config(disable=True)
    yield pipes


@pytest.fixture(scope="module")
def seed0(family: Family, loaded: dict[str, DiffusionPipeline]) -> dict[str, np.ndarray]:
    """Each mode's frames from seed 0, as output_type="np" gives them: the reference the
    repeats, the other seed and the decoded latents are held to."""
    return {mode: _render(family, loaded[mode], mode, _seeded(0)) for mode in MODES}


def _picture(size: int, shade: int) -> Image.Image:
    ramp = np.linspace(0, 255, size, dtype=np.uint8)
    rgb = np.stack([np.tile(ramp, (size, 1)), np.tile(ramp[:, None], (1, size))], axis=-1)
    pixels = np.concatenate([rgb, np.full((size, size, 1), shade, np.uint8)], axis=-1)
    return Image.fromarray(pixels)


def _render(
    family: Family,
    pipe: DiffusionPipeline,
    mode: str,
    generator: torch.Generator,
    output_type: str = "np",
    shade: int = 40,
) -> Any:
    image = {"image": _picture(family.size, shade)} if mode == "img2video" else {}
    return pipe(
        prompt="a red fox running through snow",
        height=family.size,
        width=family.size,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        generator=generator,
        output_type=output_type,
        **image,
        **family.call,
    ).frames


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_builds_the_same_weights_twice(family: Family) -> None:
    first, second = family.build(), family.build()
    for name in ("transformer", "vae", "text_encoder"):
        a, b = first.components[name].state_dict(), second.components[name].state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_loads_back_and_serves_image_to_video_with_the_same_modules(
    family: Family, loaded: dict[str, DiffusionPipeline]
) -> None:
    pipe, twin = loaded["txt2video"], loaded["img2video"]
    assert type(pipe) is family.text_to_video
    assert type(twin) is family.image_to_video
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert twin.components[name] is pipe.components[name], name


@pytest.mark.parametrize("mode", MODES)
def test_renders_frames_from_a_seed(
    family: Family, loaded: dict[str, DiffusionPipeline], seed0: dict[str, np.ndarray], mode: str
) -> None:
    pipe, video = loaded[mode], seed0[mode]
    assert video.shape == (1, FRAMES, family.size, family.size, 3)
    assert np.isfinite(video).all()
    assert np.array_equal(video, _render(family, pipe, mode, _seeded(0)))
    assert not np.allclose(video, _render(family, pipe, mode, _seeded(1)), atol=1e-3)
    if mode == "img2video":
        other = _render(family, pipe, mode, _seeded(0), shade=220)
        assert not np.allclose(video, other, atol=1e-3), "the input image changed nothing"


@pytest.mark.parametrize("mode", MODES)
def test_latents_decode_to_the_pipelines_own_frames(
    family: Family, loaded: dict[str, DiffusionPipeline], seed0: dict[str, np.ndarray], mode: str
) -> None:
    pipe, expected = loaded[mode], seed0[mode][0]
    generator = _seeded(0)
    latents = _render(family, pipe, mode, generator, output_type="latent")
    (frames,) = family.decode(pipe, latents, generator)
    decoded = np.stack([np.asarray(frame, dtype=np.float64) / 255 for frame in frames])
    assert decoded.shape == expected.shape
    # The PIL frames are the pipeline's floats rounded to 8 bits.
    assert np.abs(decoded - expected).max() <= 0.5 / 255 + 1e-6
