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
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
)

from worker.tiny import BUILDER_VERSION, STAMP_FILE, TINY_FAMILIES, build_tiny_models

PIPELINE_CLASSES: dict[str, type[Any]] = {
    "sd15": StableDiffusionPipeline,
    "sdxl": StableDiffusionXLPipeline,
    "sd3": StableDiffusion3Pipeline,
}
LATENT_CHANNELS = {"sd15": 4, "sdxl": 4, "sd3": 16}
UNICODE_PROMPT = "a cat 🐱 on a roof, 猫が屋根の上に, кошка, ünïcödé ✨ naïve café"
LONG_PROMPT = " ".join(["a very detailed photo of a red dragon over the city"] * 30)  # 330 words


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def loaded(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[tuple[str, Any]]:
    family: str = request.param
    pipe = PIPELINE_CLASSES[family].from_pretrained(tiny_dir / f"tiny-{family}")
    pipe.set_progress_bar_config(disable=True)
    yield family, pipe


def _render(pipe: DiffusionPipeline, seed: int, prompt: str = "a cat", steps: int = 3) -> Any:
    generator = torch.Generator("cpu").manual_seed(seed)
    return pipe(
        prompt,
        height=128,
        width=128,
        num_inference_steps=steps,
        generator=generator,
        output_type="np",
    ).images


def _digests(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def test_builds_every_family_as_a_diffusers_dir(tiny_dir: Path) -> None:
    # Temp and moved-aside dirs are dot-prefixed; none may outlive a build.
    assert not [p.name for p in tiny_dir.iterdir() if p.name.startswith(".")]
    for family in TINY_FAMILIES:
        root = tiny_dir / f"tiny-{family}"
        index = json.loads((root / "model_index.json").read_text())
        assert index["_class_name"] == PIPELINE_CLASSES[family].__name__
        stamp = json.loads((root / STAMP_FILE).read_text())
        assert stamp["builder_version"] == BUILDER_VERSION
        assert list(root.rglob("*.safetensors"))
        assert not list(root.rglob("*.bin"))
        size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        assert size < 10_000_000, f"tiny-{family} is {size} bytes"


def test_renders_128px_deterministically(loaded: tuple[str, Any]) -> None:
    _, pipe = loaded
    first = _render(pipe, seed=7)
    assert first.shape == (1, 128, 128, 3)
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(first, _render(pipe, seed=7))
    assert not np.array_equal(first, _render(pipe, seed=8))


def test_vae_downscales_by_8(loaded: tuple[str, Any]) -> None:
    family, pipe = loaded
    latents = pipe(
        "a cat",
        height=128,
        width=128,
        num_inference_steps=1,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="latent",
    ).images
    assert tuple(latents.shape) == (1, LATENT_CHANNELS[family], 16, 16)


def test_tokenizers_match_text_encoders(loaded: tuple[str, Any]) -> None:
    _, pipe = loaded
    for suffix in ("", "_2", "_3"):
        tokenizer = getattr(pipe, f"tokenizer{suffix}", None)
        if tokenizer is None:
            continue
        encoder = getattr(pipe, f"text_encoder{suffix}")
        assert len(tokenizer) == encoder.config.vocab_size
        assert tokenizer.eos_token_id == encoder.config.eos_token_id
        assert tokenizer.pad_token_id == encoder.config.pad_token_id


def test_unicode_and_long_prompts_tokenize_and_truncate(loaded: tuple[str, Any]) -> None:
    _, pipe = loaded
    tokenizers = [getattr(pipe, n, None) for n in ("tokenizer", "tokenizer_2", "tokenizer_3")]
    for tokenizer in filter(None, tokenizers):
        limit = tokenizer.model_max_length
        short = tokenizer(UNICODE_PROMPT, truncation=True, max_length=limit).input_ids
        # Only the final eos: for CLIP, unk is eos, so an uncovered byte would show up here.
        assert short.index(tokenizer.eos_token_id) == len(short) - 1
        assert all(0 <= i < len(tokenizer) for i in short)
        long = tokenizer(
            LONG_PROMPT, padding="max_length", truncation=True, max_length=limit
        ).input_ids
        assert len(long) == limit
        assert long[-1] == tokenizer.eos_token_id
    # The pipeline's own encode path (truncation warning, pooling at eos) must also accept them.
    images = _render(pipe, seed=0, prompt=f"{UNICODE_PROMPT} {LONG_PROMPT}", steps=1)
    assert images.shape == (1, 128, 128, 3)


def test_rebuild_skips_current_and_force_replaces(tmp_path: Path) -> None:
    target = build_tiny_models(tmp_path, ["sd15"])["tiny-sd15"]
    inode, digests = target.stat().st_ino, _digests(target)

    assert build_tiny_models(tmp_path, ["sd15"]) == {"tiny-sd15": target}
    assert target.stat().st_ino == inode

    build_tiny_models(tmp_path, ["sd15"], force=True)
    assert target.stat().st_ino != inode
    assert _digests(target) == digests, "rebuilding must give identical files"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-sd15"]


def test_rebuild_replaces_other_builder_version(tmp_path: Path) -> None:
    target = build_tiny_models(tmp_path, ["sd15"])["tiny-sd15"]
    (target / STAMP_FILE).write_text(json.dumps({"builder_version": BUILDER_VERSION - 1}))
    inode = target.stat().st_ino

    build_tiny_models(tmp_path, ["sd15"])

    assert target.stat().st_ino != inode
    assert json.loads((target / STAMP_FILE).read_text())["builder_version"] == BUILDER_VERSION


def test_build_leaves_callers_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    build_tiny_models(tmp_path, ["sd3"])
    assert torch.equal(torch.rand(4), expected)


def test_unknown_family_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sd9"):
        build_tiny_models(tmp_path, ["sd15", "sd9"])
    assert not list(tmp_path.iterdir())
