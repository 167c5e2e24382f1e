"""The bugs a first real GPU run would have hit, each reached on this CPU through a device
profile or one small fake: SD3 without a unet, emulated bf16 counted as native, the fp16 SDXL
VAE (override and upcast under group offload), torchao's global Inductor settings, a fixed
quantize table, the memory probe off Linux, the remembered rung, and answers from disk."""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from redis import Redis

from api_client import RequestRejected
from api_client.manifest import Manifest
from tests.support.inprocess import client_for, make_renderer
from tests.support.records import records
from worker.errors import OtherRequest
from worker.manifest import load_manifests
from worker.memory import device as dev
from worker.memory.device import DeviceInfo, simulate
from worker.memory.faults import FaultPlan
from worker.pipelines.loading import choose_dtype, load_pipeline
from worker.render.context import LocalContext
from worker.render.renderer import Renderer

CPU = DeviceInfo("cpu", "cpu", "test cpu", 8 * 2**30, 4 * 2**30, bf16=False, fp16=False)


def manifest(settings: Any, model: str, **changes: Any) -> Manifest:
    return load_manifests(settings.manifests, [model])[model].model_copy(update=changes)


# -- channels_last read pipe.unet ------------------------------------------------------------------


def test_sd3_loads_on_an_accelerator_where_it_has_no_unet(settings: Any) -> None:
    """channels_last auto compared the denoiser with pipe.unet: AttributeError for SD3."""
    loaded = load_pipeline(
        manifest(settings, "tiny-sd3"), "full", simulate("h100", CPU), settings, FaultPlan()
    )
    assert "channels_last" in loaded.settings.names("skipped")
    assert loaded.pipe.transformer is not None


# -- emulated bf16 -------------------------------------------------------------------------------


def test_a_t4_gets_fp16_because_its_bf16_is_only_emulated(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake T4: torch.cuda.is_bf16_supported() says yes unless asked for native support."""
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "mem_get_info", lambda *_: (15 * 2**30, 16 * 2**30))
    monkeypatch.setattr(cuda, "memory_reserved", lambda *_: 0)
    monkeypatch.setattr(cuda, "memory_allocated", lambda *_: 0)
    monkeypatch.setattr(
        cuda, "get_device_properties", lambda *_: SimpleNamespace(name="Tesla T4", major=7, minor=5)
    )
    monkeypatch.setattr(
        cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    settings = make_settings(device="cuda")
    info = dev.probe(settings)
    assert (info.bf16, info.fp16, info.fp8, info.capability) == (False, True, False, (7, 5))
    dtype, reason = choose_dtype(manifest(settings, "tiny-sdxl"), info)
    assert dtype == torch.float16 and "Tesla T4 has no bf16" in reason


# -- the fp16 SDXL VAE -----------------------------------------------------------------------------


def fp16_safe_vae(tiny_dir: Path, tmp_path: Path) -> Path:
    """A local stand-in for madebyollin/sdxl-vae-fp16-fix: tiny-sdxl's VAE, force_upcast off."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny_dir / "tiny-sdxl" / "vae")
    assert vae.config.force_upcast  # the stock VAE asks for the upcast
    vae.register_to_config(force_upcast=False)
    vae.save_pretrained(tmp_path / "sdxl-vae-fp16-fix")
    return tmp_path / "sdxl-vae-fp16-fix"


def test_manifest_vae_override_replaces_the_pipelines_vae(
    settings: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    path = fp16_safe_vae(tiny_dir, tmp_path)
    sdxl = manifest(settings, "tiny-sdxl", vae=str(path))
    loaded = load_pipeline(sdxl, "group_offload", simulate("t4", CPU), settings, FaultPlan())
    vae = loaded.pipe.vae
    assert vae.config.force_upcast is False and next(vae.parameters()).dtype == torch.float16
    [note] = [n for n in loaded.settings.skipped if n.name == "vae_upcast"]
    assert str(path) in note.reason and "fp16-safe" in note.reason


def test_manifest_vae_field_is_checked(settings: Any, tmp_path: Path) -> None:
    from pydantic import ValidationError

    data = manifest(settings, "tiny-sdxl").model_dump()
    assert Manifest.model_validate({**data, "vae": "madebyollin/sdxl-vae-fp16-fix"}).vae
    with pytest.raises(ValidationError, match="vae"):
        Manifest.model_validate({**data, "vae": ""})
    missing = manifest(settings, "tiny-sdxl", vae=str(tmp_path / "no-such-vae"))
    with pytest.raises(FileNotFoundError, match=r"no-such-vae.*holds no config\.json"):
        load_pipeline(missing, "full", simulate("t4", CPU), settings, FaultPlan())


def test_fp16_sdxl_vae_is_fp32_before_group_offload_places_it(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamed group offload pins host copies of each weight at placement and re-reads them
    at every onload: a VAE upcast at decode time is undone by the next onload. The VAE must be
    fp32 already when placement takes those copies, and decode must not upcast again."""
    import worker.pipelines.loading

    dtypes_at_placement: list[torch.dtype] = []
    place = worker.pipelines.loading._place

    def spy(loaded: Any, info: Any) -> None:
        dtypes_at_placement.append(next(loaded.pipe.vae.parameters()).dtype)
        place(loaded, info)

    monkeypatch.setattr(worker.pipelines.loading, "_place", spy)
    settings = make_settings(device_profile="t4", memory_mode="group_offload")
    renderer = make_renderer(settings, ["tiny-sdxl"])
    loaded = renderer.cache.get("tiny-sdxl")
    assert loaded is None
    result = renderer.render(
        {"model": "tiny-sdxl", "prompt": "a fox", "steps": 2, "seed": 3}, LocalContext("vae-go")
    )
    assert (result.rung, result.dtype) == ("group_offload", "fp16")
    assert dtypes_at_placement == [torch.float32]
    loaded = renderer.cache.get("tiny-sdxl")
    assert loaded is not None and "vae_upcast" in loaded.settings.names("applied")
    unet = next(loaded.pipe.unet.parameters())
    assert unet.dtype == torch.float16 and next(loaded.pipe.vae.parameters()).dtype == torch.float32

    def no_upcast() -> None:
        raise AssertionError("decode upcast the VAE again")

    loaded.pipe.upcast_vae = no_upcast
    renderer.render(
        {"model": "tiny-sdxl", "prompt": "a fox", "steps": 2, "seed": 4}, LocalContext("vae-go2")
    )


# -- torchao -------------------------------------------------------------------------------------


def test_int8_leaves_inductors_global_settings_alone() -> None:
    import torch._inductor.config as inductor

    from worker.pipelines.quantize import quantize_component

    # inductor's own patch, not monkeypatch: monkeypatch's undo deletes the option from
    # inductor's config module, and every later compile in this process then fails.
    with inductor.patch(coordinate_descent_tuning=False, force_fuse_int_mm_with_mul=False):
        layer = torch.nn.Sequential(torch.nn.Linear(64, 64))
        assert quantize_component(layer, "int8") is None
        assert type(layer[0].weight).__name__ == "Int8Tensor"
        assert inductor.coordinate_descent_tuning is False
        assert inductor.force_fuse_int_mm_with_mul is False
    assert hasattr(inductor, "coordinate_descent_tuning")


def test_doctor_tries_each_scheme_for_real(monkeypatch: pytest.MonkeyPatch) -> None:
    """An H100 may run int4, but only with a kernel package; doctor says what a real try gave."""
    import worker.ops.doctor
    from worker.pipelines.quantize import try_scheme

    assert try_scheme("int8", "cpu") is None  # a real quantize and forward on this CPU
    tried: list[tuple[str, str]] = []

    def fake_try(scheme: str, device: str) -> str | None:
        tried.append((scheme, device))
        return "ImportError: Requires mslk >= 1.0.0" if scheme == "int4" else None

    monkeypatch.setattr(worker.ops.doctor, "try_scheme", fake_try)
    verdicts = worker.ops.doctor._torchao(simulate("h100", CPU))
    assert verdicts["int4"] == "fails on cpu (ImportError: Requires mslk >= 1.0.0)"
    assert verdicts["int8"].startswith("ok (quantized and ran a linear layer on cpu")
    assert ("float8", "cpu") in tried  # the card allows float8; the real device is asked too
    t4 = worker.ops.doctor._torchao(simulate("t4", CPU))
    assert t4["float8"].startswith("skipped (float8 needs fp8 math (compute capability 8.9+")


# -- the memory probe off Linux ---------------------------------------------------------------


def test_memory_probe_works_without_proc_and_sc_avphys_pages(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on macOS: no /proc/meminfo or /proc/self/statm, and os.sysconf has no SC_AVPHYS_PAGES."""
    real_open, real_sysconf = builtins.open, os.sysconf

    def no_proc(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if str(path) in ("/proc/meminfo", "/proc/self/statm") and "b" not in mode:
            raise FileNotFoundError(path)
        return real_open(path, mode, *args, **kwargs)

    def sysconf(name: str | int) -> int:
        if name == "SC_AVPHYS_PAGES":
            raise ValueError("unrecognized configuration name")
        return real_sysconf(name)

    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setattr(os, "sysconf", sysconf)
    info = dev.probe(make_settings(device="cpu"))
    assert 0 < info.free_bytes <= info.total_bytes
    assert dev.free_bytes(info) > 0 and dev.allocated_bytes(info) > 0


# -- the remembered rung ---------------------------------------------------------------------------

A, B = (128, 128), (192, 128)


def job(renderer: Renderer, size: tuple[int, int], n: int) -> Any:
    width, height = size
    request = {"model": "tiny-sd15", "prompt": "p", "steps": 2, "seed": n}
    renderer.render({**request, "width": width, "height": height}, LocalContext(f"j{n}"))
    record = records(renderer.settings.timings_log)[-1]
    assert record.job_id == f"j{n}" and record.status == "done"
    return record


def pushed_down_at_b(renderer: Renderer) -> list[Any]:
    """A at full, then B out of memory at full twice: B descends and remembers partial."""
    first = job(renderer, A, 0)
    renderer.faults = FaultPlan.parse("oom@denoise:full*2")
    second = job(renderer, B, 1)
    assert (first.rung, second.rung) == ("full", "partial")
    return [first, second]


def test_alternating_sizes_with_different_rungs_load_at_most_twice(settings: Any) -> None:
    renderer = make_renderer(settings, ["tiny-sd15"])
    jobs = pushed_down_at_b(renderer)
    jobs += [job(renderer, size, n) for n, size in enumerate([A, B, A, B, A, B], start=2)]
    assert sum(1 for r in jobs if r.timings.load > 0) == 2
    assert {r.rung for r in jobs[2:]} == {"partial"}
    assert "192x128 remembered at or below it" in jobs[2].rung_reason


def test_a_remembered_rung_goes_back_up_after_clean_jobs(settings: Any) -> None:
    renderer = make_renderer(settings, ["tiny-sd15"])
    renderer.planner.rungs.forget_after = 2
    pushed_down_at_b(renderer)
    assert [job(renderer, B, n).rung for n in (2, 3)] == ["partial", "partial"]
    back = job(renderer, A, 4)  # B's ceiling is forgotten: nothing holds the model down
    assert back.rung == "full" and back.timings.load > 0
    assert back.rung_reason.startswith("back up from partial")
    assert job(renderer, B, 5).rung == "full"


def test_a_remembered_rung_goes_back_up_when_memory_grows(make_settings: Any) -> None:
    """On a simulated card the budget is the memory: raising it by a GB lifts the ceiling."""
    settings = make_settings(device_profile="l4", vram_budget_gb=0.3)
    renderer = make_renderer(settings, ["tiny-sd15"])
    renderer.faults = FaultPlan.parse("oom@denoise:full*2")
    assert job(renderer, A, 0).rung == "partial"
    assert job(renderer, A, 1).rung_reason.startswith("remembered")
    renderer.settings.vram_budget_gb = 2.0
    up = job(renderer, A, 2)
    assert up.rung == "full" and up.rung_reason.startswith("back up from partial")


# -- answered from disk --------------------------------------------------------------------------


def test_a_result_on_disk_answers_only_the_request_it_came_from(settings: Any) -> None:
    renderer = make_renderer(settings, ["tiny-sd15"])
    request = {"model": "tiny-sd15", "prompt": "a fox", "steps": 2, "seed": 1}
    first = renderer.render(request, LocalContext("same-id"))
    again = renderer.render(request, LocalContext("same-id"))
    assert again.images == first.images
    # Answered from disk, not rendered: the second call's record says so, with the render's
    # phases and who rendered it, and is kept out of medians and fits.
    answers = [(r.job_id, r.answered_from, r.steady) for r in records(settings.timings_log)]
    assert answers == [("same-id", "render", False), ("same-id", "store", False)]
    image = Path(first.images[0].path).read_bytes()
    with pytest.raises(OtherRequest, match=r"same-id.*different request"):
        renderer.render({**request, "prompt": "a wolf"}, LocalContext("same-id"))
    assert Path(first.images[0].path).read_bytes() == image  # never overwritten either
    failed = records(settings.timings_log)[-1]
    assert failed.status == "failed" and "OtherRequest" in (failed.error or "")


def test_submit_refuses_a_job_id_that_names_another_request(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    request = {"model": "tiny-sd15", "prompt": "a fox", "steps": 2}
    first = client.submit(request, job_id="order-17")
    # The same request again (its seed left to chance) is the same job: idempotent.
    assert client.submit(request, job_id="order-17").id == first.id
    with pytest.raises(RequestRejected) as refused:
        client.submit({**request, "prompt": "a wolf"}, job_id="order-17")
    assert "job_id" in str(refused.value) and "order-17" in str(refused.value)
    assert redis_conn.llen("rq:queue:kiln:tiny-sd15") == 1


def test_prewarm_job_ids_are_unique_per_start(settings: Any) -> None:
    from worker.serve import warm

    renderer = make_renderer(settings, ["tiny-sd15"])
    warm(renderer, ["tiny-sd15"], "w1")
    warm(make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"], "w1")  # a restart
    warmups = records(settings.timings_log)
    assert len({r.job_id for r in warmups}) == len(warmups) == 6
    assert all(r.status == "done" and r.timings.denoise > 0 for r in warmups)
    assert not any(settings.output_dir.glob("prewarm-*"))  # nobody's images are kept
