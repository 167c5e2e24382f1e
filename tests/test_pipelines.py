"""Loading: precision policy, torchao int8 of a named text encoder, the switch report with
manifest overrides, and the resident cache's eviction releasing memory."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from redis import Redis

from tests.support.inprocess import burst, client_for, make_renderer
from worker.manifest import load_manifests
from worker.memory.device import DeviceInfo
from worker.memory.faults import FaultPlan
from worker.pipelines.loading import choose_dtype, load_pipeline
from worker.pipelines.quantize import weight_summary

CPU = DeviceInfo("cpu", "cpu", "test cpu", 8 * 2**30, 4 * 2**30, bf16=False, fp16=False)


def gpu(bf16: bool) -> DeviceInfo:
    return DeviceInfo("cuda", "cuda:0", "test gpu", 16 * 2**30, 15 * 2**30, bf16=bf16, fp16=True)


def test_precision_policy(settings: Any) -> None:
    manifests = load_manifests(settings.manifests, ["tiny-sdxl", "tiny-sd3"])
    sdxl, sd3 = manifests["tiny-sdxl"], manifests["tiny-sd3"]
    assert choose_dtype(sdxl, gpu(bf16=True))[0] == torch.bfloat16
    assert choose_dtype(sdxl, gpu(bf16=False))[0] == torch.float16
    assert choose_dtype(sd3, gpu(bf16=True))[0] == torch.bfloat16
    dtype, reason = choose_dtype(sd3, gpu(bf16=False))
    assert dtype == torch.float32 and "must not run in fp16" in reason
    assert choose_dtype(sdxl, CPU)[0] == torch.float32
    assert choose_dtype(sdxl.model_copy(update={"dtype": "bf16"}), CPU)[0] == torch.bfloat16


def test_int8_quantizes_the_named_text_encoder(redis_conn: Redis, make_settings: Any) -> None:
    """tiny-sd3 names text_encoder_3: int8; with the switch off the same encoder stays fp32."""
    model = "tiny-sd3"
    renderer = make_renderer(make_settings(), [model])
    client_for(redis_conn, renderer.settings).submit({"model": model, "prompt": "q", "steps": 2})
    burst(redis_conn, renderer, [model])
    loaded = renderer.cache.get(model)
    assert loaded is not None and loaded.quantized == {"text_encoder_3": "int8"}
    kinds, int8_bytes = weight_summary(loaded.pipe.text_encoder_3)
    assert kinds == {"Int8Tensor"}
    assert "quantize:text_encoder_3" in loaded.settings.names("applied")

    plain = load_pipeline(
        loaded.manifest, "full", renderer.info, make_settings(quantize="off"), FaultPlan()
    )
    plain_kinds, fp32_bytes = weight_summary(plain.pipe.text_encoder_3)
    assert plain_kinds == {"Parameter"} and plain.quantized == {}
    assert "quantize" in plain.settings.names("skipped")
    # Linear weights drop from 4 bytes to 1 (plus scales); embeddings and norms stay fp32.
    assert int8_bytes < 0.75 * fp32_bytes


def test_a_scheme_this_device_cannot_run_is_skipped_with_its_reason(settings: Any) -> None:
    manifest = load_manifests(settings.manifests, ["tiny-sd3"])["tiny-sd3"]
    manifest = manifest.model_copy(update={"quantize": {"text_encoder_3": ["float8"]}})
    loaded = load_pipeline(manifest, "full", CPU, settings, FaultPlan())
    assert loaded.quantized == {}
    [note] = [n for n in loaded.settings.skipped if n.name == "quantize:text_encoder_3"]
    assert "float8 needs a CUDA or ROCm device" in note.reason


def test_switches_follow_settings_and_manifest_overrides(make_settings: Any) -> None:
    settings = make_settings(attention_slicing="on", vae_tiling="off")
    manifest = load_manifests(settings.manifests, ["tiny-sd15"])["tiny-sd15"]
    manifest = manifest.model_copy(
        update={"optimizations": {"vae_tiling": "on", "sdpa": "off", "channels_last": "on"}}
    )
    loaded = load_pipeline(manifest, "full", CPU, settings, FaultPlan())
    report = loaded.settings
    assert {"attention_slicing", "vae_tiling", "channels_last"} <= set(report.names("applied"))
    assert "sdpa" in report.names("skipped")  # the manifest's off beats the default
    assert loaded.pipe.vae.use_tiling
    assert loaded.pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    # Every switch is accounted for exactly once.
    names = [n.name for kind in ("applied", "skipped", "fell_back") for n in getattr(report, kind)]
    for switch in (
        "sdpa",
        "channels_last",
        "compile",
        "vae_tiling",
        "attention_slicing",
        "taesd_preview",
    ):
        assert names.count(switch) == 1, switch


def test_eviction_releases_the_pipeline_and_its_memory(
    redis_conn: Redis, make_settings: Any
) -> None:
    settings = make_settings(ram_cache_gb=0)  # no RAM cache: evicted pipelines are released
    models = ["tiny-sd15", "tiny-sdxl", "tiny-sd3"]
    renderer = make_renderer(settings, models)
    client = client_for(redis_conn, settings)
    for model in models:
        client.submit({"model": model, "prompt": "resident", "steps": 2})
    burst(redis_conn, renderer, models)
    assert renderer.cache.model_ids() == models
    unet = weakref.ref(renderer.cache.get("tiny-sdxl").pipe.unet)  # type: ignore[union-attr]
    renderer.cache.get("tiny-sd15")  # use order now: sd3, sdxl, sd15

    # Least recently used first: tiny-sd3, then tiny-sdxl; the kept tiny-sd15 never goes.
    evicted = renderer.cache.evict_lru_until(need_bytes=10**18, free_now=0, keep="tiny-sd15")
    assert evicted == ["tiny-sd3", "tiny-sdxl"]
    assert renderer.cache.model_ids() == ["tiny-sd15"]
    gc.collect()
    assert unet() is None  # nothing kiln holds keeps the weights alive
    for eviction in renderer.cache.evictions:
        # On CPU "allocated" is the process's resident set: it shrinks once the weights go.
        assert eviction.allocated_after < eviction.allocated_before, eviction
        assert eviction.freed_bytes > 0


@pytest.mark.parametrize("rung", ["model_offload", "group_offload"])
def test_offloaded_pipelines_are_released_too(settings: Any, rung: str) -> None:
    from worker.pipelines.resident import PipelineCache

    manifest = load_manifests(settings.manifests, ["tiny-sd15"])["tiny-sd15"]
    cache = PipelineCache(CPU)
    cache.put(load_pipeline(manifest, rung, CPU, settings, FaultPlan()))  # type: ignore[arg-type]
    unet = weakref.ref(cache.get("tiny-sd15").pipe.unet)  # type: ignore[union-attr]
    eviction = cache.evict("tiny-sd15")
    gc.collect()
    assert eviction is not None and eviction.rung == rung
    assert unet() is None


def test_every_manifest_scheduler_name_builds_a_diffusers_scheduler(tiny_dir: Path) -> None:
    """The schema (api_client, no torch) and the worker's table must name the same schedulers."""
    import json
    from typing import get_args

    import diffusers

    from api_client.manifest import Scheduler
    from worker.pipelines.loading import SCHEDULERS

    assert set(get_args(Scheduler)) == set(SCHEDULERS)
    config_file = tiny_dir / "tiny-sd15" / "scheduler" / "scheduler_config.json"
    config = json.loads(config_file.read_text())
    for name, (class_name, overrides) in SCHEDULERS.items():
        scheduler = getattr(diffusers, class_name).from_config(config, **overrides)
        scheduler.set_timesteps(4)
        assert len(scheduler.timesteps) >= 4, name
