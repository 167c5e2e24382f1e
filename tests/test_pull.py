"""Weights before jobs, without the network: which files of a repository a manifest pulls, the
Hugging Face cache read offline (a fake cache layout), the gated and offline messages, a missing
local directory, and a worker that will not take jobs without its weights."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from huggingface_hub.utils import filter_repo_objects

from tests.conftest import kiln
from worker.manifest import load_manifests
from worker.pipelines.pull import (
    PullError,
    _pipeline_fetch,
    fetches,
    missing,
    pipeline_components,
    pull,
)

# The top of stabilityai/stable-diffusion-xl-base-1.0's file list, as the hub shows it.
SDXL_FILES = [
    "model_index.json",
    "sd_xl_base_1.0.safetensors",
    "sd_xl_offset_example-lora_1.0.safetensors",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.fp16.safetensors",
    "text_encoder/model.safetensors",
    "text_encoder/openvino_model.bin",
    "text_encoder_2/config.json",
    "text_encoder_2/model.fp16.safetensors",
    "text_encoder_2/model.safetensors",
    "tokenizer/merges.txt",
    "tokenizer/vocab.json",
    "tokenizer_2/merges.txt",
    "tokenizer_2/vocab.json",
    "unet/config.json",
    "unet/diffusion_flax_model.msgpack",
    "unet/diffusion_pytorch_model.fp16.safetensors",
    "unet/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.fp16.safetensors",
    "vae/diffusion_pytorch_model.safetensors",
    "vae_1_0/diffusion_pytorch_model.fp16.safetensors",
    "vae_decoder/model.onnx",
]
SDXL_INDEX = {
    "_class_name": "StableDiffusionXLPipeline",
    "feature_extractor": [None, None],
    "scheduler": ["diffusers", "EulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


# FLUX.1-dev's layout: the single-file checkpoint and autoencoder at the top (kiln loads neither),
# sharded transformer and T5, each shard set with its index.
FLUX_FILES = [
    "LICENSE.md",
    "ae.safetensors",
    "flux1-dev.safetensors",
    "model_index.json",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "text_encoder_2/config.json",
    "text_encoder_2/model-00001-of-00002.safetensors",
    "text_encoder_2/model-00002-of-00002.safetensors",
    "text_encoder_2/model.safetensors.index.json",
    "tokenizer/merges.txt",
    "tokenizer/vocab.json",
    "tokenizer_2/spiece.model",
    "tokenizer_2/tokenizer.json",
    "transformer/config.json",
    "transformer/diffusion_pytorch_model-00001-of-00003.safetensors",
    "transformer/diffusion_pytorch_model-00002-of-00003.safetensors",
    "transformer/diffusion_pytorch_model-00003-of-00003.safetensors",
    "transformer/diffusion_pytorch_model.safetensors.index.json",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
]


def selected(fetch: Any, files: list[str] = SDXL_FILES) -> list[str]:
    return list(
        filter_repo_objects(
            files, allow_patterns=fetch.allow_patterns, ignore_patterns=fetch.ignore_patterns
        )
    )


def test_a_flux_pull_takes_every_shard_and_no_single_file_checkpoint(settings: Any) -> None:
    flux = load_manifests(settings.manifests, ["flux1-dev"])["flux1-dev"]
    [pipeline, controlnet] = fetches(flux, settings.models_dir)
    assert pipeline.repo == "black-forest-labs/FLUX.1-dev"
    assert controlnet.repo == "InstantX/FLUX.1-dev-Controlnet-Union"  # its four kinds, once
    taken = selected(pipeline, FLUX_FILES)
    assert taken == [f for f in FLUX_FILES if "/" in f or f == "model_index.json"]
    # A Qwen3 tokenizer keeps its chat template beside its config (FLUX.2 klein, Z-Image).
    klein = load_manifests(settings.manifests, ["flux2-klein-4b"])["flux2-klein-4b"]
    template = ["tokenizer/chat_template.jinja", "tokenizer/tokenizer_config.json"]
    assert selected(_pipeline_fetch(klein, ["tokenizer"]), template) == template


def test_a_pull_takes_only_the_variant_of_the_components_the_pipeline_loads(
    settings: Any,
) -> None:
    sdxl = load_manifests(settings.manifests, ["sdxl-base"])["sdxl-base"]
    [pipeline, taesd, union, adapter] = fetches(sdxl, settings.models_dir)
    assert union.repo == "xinsir/controlnet-union-sdxl-1.0"
    # The IP-Adapter's weights and its image encoder: one repository, one fetch of three files.
    assert (adapter.repo, adapter.allow_patterns) == (
        "h94/IP-Adapter",
        [
            "sdxl_models/ip-adapter_sdxl_vit-h.safetensors",
            "models/image_encoder/config.json",
            "models/image_encoder/model.safetensors",
        ],
    )
    assert (pipeline.repo, taesd.repo) == (sdxl.source, "madebyollin/taesdxl")
    assert taesd.allow_patterns == ["config.json", "diffusion_pytorch_model.safetensors"]
    # Before model_index.json is read: every folder, fp16 weights only, no top-level checkpoint.
    first = selected(pipeline)
    assert "sd_xl_base_1.0.safetensors" not in first and "unet/openvino_model.bin" not in first
    assert "unet/diffusion_pytorch_model.safetensors" not in first
    components = _pipeline_fetch(sdxl, pipeline_components(SDXL_INDEX))
    assert selected(components) == [
        "model_index.json",
        "scheduler/scheduler_config.json",
        "text_encoder/config.json",
        "text_encoder/model.fp16.safetensors",
        "text_encoder_2/config.json",
        "text_encoder_2/model.fp16.safetensors",
        "tokenizer/merges.txt",
        "tokenizer/vocab.json",
        "tokenizer_2/merges.txt",
        "tokenizer_2/vocab.json",
        "unet/config.json",
        "unet/diffusion_pytorch_model.fp16.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.fp16.safetensors",
    ]
    # Without a variant: the plain weights, never a variant's.
    plain = _pipeline_fetch(sdxl.model_copy(update={"variant": None}), ["unet"])
    assert [f for f in selected(plain) if f.endswith(".safetensors")] == [
        "unet/diffusion_pytorch_model.safetensors"
    ]


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cached(cache: Path, repo: str, files: dict[str, str]) -> None:
    """A snapshot in the cache's own layout: refs/main -> snapshots/<commit>/..."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0123abcd")
    for name, text in files.items():
        path = root / "snapshots" / "0123abcd" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_offline_a_cached_model_is_ready_and_a_missing_one_is_named(
    settings: Any, hf_cache: Path
) -> None:
    manifests = load_manifests(settings.manifests, ["sdxl-turbo"])
    assert set(missing(manifests, settings.models_dir)) == {"sdxl-turbo"}
    with pytest.raises(PullError) as failure:
        pull(manifests, settings.models_dir, say=lambda _line: None)
    message = str(failure.value)
    assert "stabilityai/sdxl-turbo" in message and "HF_HUB_OFFLINE" in message
    assert str(hf_cache) in message and "`kiln pull --models sdxl-turbo`" in message

    index = {k: v for k, v in SDXL_INDEX.items() if k != "feature_extractor"}
    files = {"model_index.json": json.dumps(index)}
    files.update({f"{name}/config.json": "{}" for name in pipeline_components(index)})
    cached(hf_cache, "stabilityai/sdxl-turbo", files)
    cached(hf_cache, "madebyollin/taesdxl", {"config.json": "{}"})
    assert missing(manifests, settings.models_dir) == {}
    said: list[str] = []
    assert pull(manifests, settings.models_dir, say=said.append) == []
    assert said == [
        "sdxl-turbo: stabilityai/sdxl-turbo already in the cache",
        "sdxl-turbo: madebyollin/taesdxl already in the cache",
    ]


def test_a_gated_repository_fails_in_one_line(
    settings: Any, hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def gated(repo: str, *args: Any, **kwargs: Any) -> str:
        # What GatedRepoError reads of the HTTP response: its headers and request.
        response = SimpleNamespace(headers={}, request=None, status_code=403)
        raise GatedRepoError("403 Client Error: access to model is restricted", response=response)  # type: ignore[arg-type]

    # One fake for the gated hub, standing in for both calls a pull makes.
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", gated)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    manifests = load_manifests(settings.manifests, ["sd35-medium"])
    with pytest.raises(PullError) as failure:
        pull(manifests, settings.models_dir, say=lambda _line: None)
    message = str(failure.value)
    assert "\n" not in message
    assert "stabilityai/stable-diffusion-3.5-medium is gated" in message
    assert "https://huggingface.co/stabilityai/stable-diffusion-3.5-medium" in message
    assert "HF_TOKEN" in message


def test_a_missing_local_directory_names_its_path_and_builder(
    settings: Any, tmp_path: Path
) -> None:
    manifests = load_manifests(settings.manifests, ["tiny-sd15", "ssd-1b-lightning"])
    gaps = missing(manifests, tmp_path / "empty")
    assert str(tmp_path / "empty" / "tiny-sd15") in gaps["tiny-sd15"]
    assert "`kiln tiny-models`" in gaps["tiny-sd15"]
    assert "manifests/ssd-1b-lightning.yaml" in gaps["ssd-1b-lightning"]
    with pytest.raises(PullError, match="kiln tiny-models"):
        pull({"tiny-sd15": manifests["tiny-sd15"]}, tmp_path / "empty", say=lambda _line: None)


def test_a_file_missing_under_a_local_directory_is_named_not_fetched(
    settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tiny-sd15 built by an older kiln: its directory is here, its kohya LoRA file is not. The
    # name reads as owner/repo/file, but asking the hub for "tiny-sd15/loras" is never right.
    import shutil

    import huggingface_hub

    def no_hub(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the hub was asked for a local file")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    models = tmp_path / "models"
    shutil.copytree(settings.models_dir / "tiny-sd15", models / "tiny-sd15")
    (models / "tiny-sd15" / "loras" / "tiny-sd15-lora-kohya.safetensors").unlink()
    manifests = load_manifests(settings.manifests, ["tiny-sd15"])
    gap = missing(manifests, models)["tiny-sd15"]
    assert "tiny-sd15-lora-kohya.safetensors" in gap and "`kiln tiny-models`" in gap
    with pytest.raises(PullError, match="kiln tiny-models"):
        pull(manifests, models, say=lambda _line: None)


def test_a_hub_that_cannot_be_reached_fails_in_one_line(
    settings: Any, hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise LocalEntryNotFoundError("Got: ConnectError: Name or service not known\nmore")

    # Both calls a pull makes: huggingface_hub's own backoff would spend 23 s on DNS retries.
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    manifests = load_manifests(settings.manifests, ["sdxl-turbo"])
    with pytest.raises(PullError) as failure:
        pull(manifests, settings.models_dir, say=lambda _line: None)
    message = str(failure.value)
    assert message.startswith("model sdxl-turbo: could not fetch stabilityai/sdxl-turbo from the")
    assert "\n" not in message  # one line, never huggingface_hub's traceback


def test_kiln_pull_and_a_worker_offline_without_weights(
    kiln_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**kiln_env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    done = kiln("pull", "--models", "tiny-sd15", env=env)
    assert done.returncode == 0, done.stderr
    assert "1 models ready, 0 fetched" in done.stdout
    refused = kiln("pull", "--models", "sdxl-turbo", env=env)
    assert refused.returncode == 1 and "HF_HUB_OFFLINE is set" in refused.stderr
    worker = kiln("worker", "--burst", "--models", "sdxl-turbo", env=env)
    assert worker.returncode == 1
    out = worker.stdout + worker.stderr
    assert "weights_unavailable" in out and "kiln pull --models sdxl-turbo" in out
