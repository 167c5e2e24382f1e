"""The tiny-model builder: pipelines reload through diffusers, render, and rebuild idempotently."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import (
    DiffusionPipeline,
    Flux2KleinPipeline,
    FluxKontextPipeline,
    FluxPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    ZImagePipeline,
)
from transformers import Qwen2Tokenizer

from api_client.families import FAMILIES
from worker.pipelines.tiny import (
    BUILDER_VERSION,
    STAMP_FILE,
    TAESD_LATENTS,
    TINY_FAMILIES,
    build_tiny_models,
)

# The image families' tiny models; the video ones (tiny-wan, tiny-ltx) have their own tests in
# tests/test_tiny_video.py, as their pipelines return frames of several sizes and counts.
IMAGE_TINIES = tuple(f for f in TINY_FAMILIES if not (f in FAMILIES and FAMILIES[f].video))
PIPELINE_CLASSES: dict[str, type[Any]] = {
    "sd15": StableDiffusionPipeline,
    "sdxl": StableDiffusionXLPipeline,
    "sd3": StableDiffusion3Pipeline,
    "flux": FluxPipeline,
    "flux-kontext": FluxKontextPipeline,
    "flux2": Flux2KleinPipeline,
    "qwenimage": QwenImagePipeline,
    "zimage": ZImagePipeline,
}
# What output_type="latent" returns for a 128x128 image: every VAE is 8x, so 16x16 latents.
# sd15/sdxl/sd3 and zimage hand back the denoiser's (B, C, H, W) latents. flux and qwenimage hand
# back the packed sequence the transformer denoises: one token per 2x2 patch, (16/2)**2 = 64
# tokens of 4 x 16 channels. flux2 unpacks, un-normalises (the VAE's batch-norm stats) and
# unpatchifies before returning, so it gives the VAE's own 32-channel latents.
LATENT_SHAPES: dict[str, tuple[int, ...]] = {
    "sd15": (1, 4, 16, 16),
    "sdxl": (1, 4, 16, 16),
    "sd3": (1, 16, 16, 16),
    "flux": (1, 64, 64),
    "flux-kontext": (1, 64, 64),
    "flux2": (1, 32, 16, 16),
    "qwenimage": (1, 64, 64),
    "zimage": (1, 16, 16, 16),
}
# Each new family rendered the way its model card runs it (flux: FLUX.1-dev's embedded guidance;
# qwenimage: true CFG against a negative prompt); the other families take their defaults.
CALL_ARGS: dict[str, dict[str, Any]] = {
    "flux": {"guidance_scale": 3.5},
    "flux-kontext": {"guidance_scale": 2.5},
    "qwenimage": {"true_cfg_scale": 4.0, "negative_prompt": "blurry"},
}
# Two guidance settings a family must tell apart: off, and on (with a negative prompt where the
# pipeline takes one), so both branches of each pipeline's guidance code run. Z-Image's guidance
# is pos + scale * (pos - neg), on for any scale > 0, so its off is 0, not 1.
GUIDANCE: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "flux": ({"guidance_scale": 1.0}, {"guidance_scale": 3.5}),
    "flux2": ({"guidance_scale": 1.0}, {"guidance_scale": 4.0}),
    "qwenimage": ({"true_cfg_scale": 1.0}, {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}),
    "zimage": ({"guidance_scale": 0.0}, {"guidance_scale": 4.0, "negative_prompt": "blurry"}),
}
# The longest prompt, in tokens, each Qwen-tokenized pipeline pads or truncates to.
QWEN_PROMPT_LIMITS = {"flux2": 512, "zimage": 512, "qwenimage": 1024 + 34}
UNICODE_PROMPT = "a cat 🐱 on a roof, 猫が屋根の上に, кошка, ünïcödé ✨ naïve café"
LONG_PROMPT = " ".join(["a very detailed photo of a red dragon over the city"] * 30)  # 330 words


@pytest.fixture(scope="module", params=IMAGE_TINIES)
def loaded(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[tuple[str, Any]]:
    family: str = request.param
    pipe = PIPELINE_CLASSES[family].from_pretrained(tiny_dir / f"tiny-{family}")
    pipe.set_progress_bar_config(disable=True)
    yield family, pipe


def _render(
    family: str,
    pipe: DiffusionPipeline,
    seed: int,
    prompt: str = "a cat",
    steps: int = 2,
    size: tuple[int, int] = (128, 128),
    **extra: Any,
) -> Any:
    # prompt by keyword: Flux2KleinPipeline's first positional parameter is image. Two steps at
    # least: with Qwen-Image's shift_terminal one step's only sigma is 0/0 (NaN), as upstream.
    if isinstance(pipe, FluxKontextPipeline):  # it rescales any size to max_area (1 MP) unless told
        extra.setdefault("max_area", size[0] * size[1])
    return pipe(
        prompt=prompt,
        height=size[0],
        width=size[1],
        num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type=extra.pop("output_type", "np"),
        **{**CALL_ARGS.get(family, {}), **extra},
    ).images


def _digests(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def _tokenizer_pairs(pipe: DiffusionPipeline) -> Iterator[tuple[Any, Any]]:
    for suffix in ("", "_2", "_3"):
        tokenizer = getattr(pipe, f"tokenizer{suffix}", None)
        if tokenizer is not None:
            yield tokenizer, getattr(pipe, f"text_encoder{suffix}")


def test_builds_every_family_as_a_diffusers_dir(tiny_dir: Path) -> None:
    # Temp and moved-aside dirs are dot-prefixed; none may outlive a build.
    assert not [p.name for p in tiny_dir.iterdir() if p.name.startswith(".")]
    assert set(IMAGE_TINIES) == set(PIPELINE_CLASSES)
    for family in IMAGE_TINIES:
        root = tiny_dir / f"tiny-{family}"
        index = json.loads((root / "model_index.json").read_text())
        assert index["_class_name"] == PIPELINE_CLASSES[family].__name__
        stamp = json.loads((root / STAMP_FILE).read_text())
        assert stamp["builder_version"] == BUILDER_VERSION
        assert list(root.rglob("*.safetensors"))
        assert not list(root.rglob("*.bin"))
        assert (root / "taesd").is_dir() == (family in TAESD_LATENTS)
        size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        assert size < 10_000_000, f"tiny-{family} is {size} bytes"


def test_renders_128px_deterministically(loaded: tuple[str, Any]) -> None:
    family, pipe = loaded
    first = _render(family, pipe, seed=7)
    assert first.shape == (1, 128, 128, 3)
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(first, _render(family, pipe, seed=7))
    assert not np.array_equal(first, _render(family, pipe, seed=8))


@pytest.mark.parametrize("size", [(192, 128), (128, 192)])
def test_renders_non_square(loaded: tuple[str, Any], size: tuple[int, int]) -> None:
    family, pipe = loaded
    images = _render(family, pipe, seed=3, size=size)
    assert images.shape == (1, *size, 3)
    assert np.isfinite(images).all()


def test_vae_downscales_by_8(loaded: tuple[str, Any]) -> None:
    family, pipe = loaded
    latents = _render(family, pipe, seed=0, output_type="latent")
    assert tuple(latents.shape) == LATENT_SHAPES[family]
    assert torch.isfinite(latents).all()


@pytest.mark.parametrize("loaded", list(GUIDANCE), indirect=True)
def test_guidance_settings_render_and_differ(loaded: tuple[str, Any]) -> None:
    family, pipe = loaded
    off, on = (_render(family, pipe, seed=5, **args) for args in GUIDANCE[family])
    assert np.isfinite(off).all() and np.isfinite(on).all()
    assert not np.array_equal(off, on)


def test_tokenizers_match_text_encoders(loaded: tuple[str, Any]) -> None:
    _, pipe = loaded
    for tokenizer, encoder in _tokenizer_pairs(pipe):
        # Qwen2.5-VL keeps its text settings in a sub-config; the others return themselves.
        config = encoder.config.get_text_config()
        assert len(tokenizer) == config.vocab_size
        assert tokenizer.eos_token_id == config.eos_token_id
        assert tokenizer.pad_token_id == config.pad_token_id


def test_unicode_and_long_prompts_tokenize_and_truncate(loaded: tuple[str, Any]) -> None:
    family, pipe = loaded
    for tokenizer, _ in _tokenizer_pairs(pipe):
        if isinstance(tokenizer, Qwen2Tokenizer):
            _check_byte_level(tokenizer, QWEN_PROMPT_LIMITS[family])
        else:
            _check_eos_terminated(tokenizer)
    # The pipeline's own encode path (truncation, chat template, template drop, pooling at eos)
    # must also accept them.
    images = _render(family, pipe, seed=0, prompt=f"{UNICODE_PROMPT} {LONG_PROMPT}")
    assert images.shape == (1, 128, 128, 3)
    assert np.isfinite(images).all()


def _check_eos_terminated(tokenizer: Any) -> None:
    limit = tokenizer.model_max_length
    short = tokenizer(UNICODE_PROMPT, truncation=True, max_length=limit).input_ids
    # Only the final eos: for CLIP, unk is eos, so an uncovered byte would show up here.
    assert short.index(tokenizer.eos_token_id) == len(short) - 1
    assert all(0 <= i < len(tokenizer) for i in short)
    long = tokenizer(LONG_PROMPT, padding="max_length", truncation=True, max_length=limit).input_ids
    assert len(long) == limit
    # Truncation keeps the closing eos; a prompt that fits (FLUX's 512 T5 tokens) is padded.
    whole = len(tokenizer(LONG_PROMPT).input_ids)
    assert long[min(whole, limit) - 1] == tokenizer.eos_token_id
    assert set(long[whole:]) <= {tokenizer.pad_token_id}


def _check_byte_level(tokenizer: Qwen2Tokenizer, limit: int) -> None:
    # One token a byte and nothing unknown: the prompt comes back from its ids exactly.
    ids = tokenizer(UNICODE_PROMPT).input_ids
    assert len(ids) == len(UNICODE_PROMPT.encode("utf-8"))
    assert tokenizer.decode(ids) == UNICODE_PROMPT
    long = tokenizer(LONG_PROMPT, padding="max_length", truncation=True, max_length=limit).input_ids
    assert len(long) == limit
    assert tokenizer.pad_token_id not in long


def test_qwen3_chat_template_follows_enable_thinking(tiny_dir: Path) -> None:
    tokenizer = Qwen2Tokenizer.from_pretrained(tiny_dir / "tiny-flux2" / "tokenizer")
    messages = [{"role": "user", "content": "a cat"}]
    turn = "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    for thinking, expected in ((True, turn), (False, turn + "<think>\n\n</think>\n\n")):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        assert text == expected
    # The markers are single tokens, not spelled out byte by byte.
    for marker in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert len(tokenizer(marker).input_ids) == 1


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_rebuild_skips_current_and_force_replaces(tmp_path: Path, family: str) -> None:
    name = f"tiny-{family}"
    target = build_tiny_models(tmp_path, [family])[name]
    inode, digests = target.stat().st_ino, _digests(target)

    assert build_tiny_models(tmp_path, [family]) == {name: target}
    assert target.stat().st_ino == inode

    build_tiny_models(tmp_path, [family], force=True)
    assert target.stat().st_ino != inode
    assert _digests(target) == digests, "rebuilding must give identical files"
    # Beside it, only its single-file twin (tiny-sd15.safetensors: worker/pipelines/tiny/files.py).
    assert [p.name for p in tmp_path.iterdir() if p.name != f"{name}.safetensors"] == [name]


def test_rebuild_replaces_other_builder_version(tmp_path: Path) -> None:
    target = build_tiny_models(tmp_path, ["sd15"])["tiny-sd15"]
    (target / STAMP_FILE).write_text(json.dumps({"builder_version": BUILDER_VERSION - 1}))
    inode = target.stat().st_ino

    build_tiny_models(tmp_path, ["sd15"])

    assert target.stat().st_ino != inode
    assert json.loads((target / STAMP_FILE).read_text())["builder_version"] == BUILDER_VERSION


@pytest.mark.parametrize("family", ["sd3", "flux2"])
def test_build_leaves_callers_rng_alone(tmp_path: Path, family: str) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    build_tiny_models(tmp_path, [family])
    assert torch.equal(torch.rand(4), expected)


def test_unknown_family_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sd9"):
        build_tiny_models(tmp_path, ["sd15", "sd9"])
    assert not list(tmp_path.iterdir())
