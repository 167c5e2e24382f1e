"""Per-job LoRA (#17 item 3): adapters a manifest allows, named per request with weights,
hot-swapped into slots on the resident denoiser, bypassed by jobs that name none; the record
and the image's details carry them; (slow) alternating adapters on a compiled tiny model builds
the slotted graphs once, beside the plain ones, and nothing after."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from redis import Redis
from safetensors.torch import load_file, save_file

from api_client import RequestRejected
from api_client.loras import parse_lora_flag
from api_client.schema import LoraChoice
from tests.conftest import kiln
from tests.support.images import pixels
from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.files.details import read_details
from worker.manifest import load_manifests
from worker.pipelines.adapters import AdapterRefused, AdapterSlots
from worker.pipelines.tiny.lora import TINY_LORAS, WEIGHT_NAME
from worker.render.context import LocalContext

FAMILIES = ["sd15", "sdxl", "sd3", "flux", "flux2", "qwenimage", "zimage"]
# make test renders a UNet's and a transformer's LoRA job; make test-slow the other five's.
RENDERED = [
    family if family in ("sd15", "flux") else pytest.param(family, marks=pytest.mark.slow)
    for family in FAMILIES
]


def test_the_builder_makes_two_adapters_on_different_layers_and_ranks(tiny_dir: Path) -> None:
    for family in FAMILIES:
        detail = load_file(tiny_dir / f"tiny-{family}/loras/detail/{WEIGHT_NAME}")
        style = load_file(tiny_dir / f"tiny-{family}/loras/style/{WEIGHT_NAME}")
        assert set(style) < set(detail), "style's layers are a part of detail's"
        downs = {k: v for k, v in detail.items() if "lora_A" in k}
        assert downs and {v.shape[0] for v in downs.values()} == {TINY_LORAS["detail"][1]}
        assert {v.shape[0] for k, v in style.items() if "lora_A" in k} == {TINY_LORAS["style"][1]}
        assert not any(".to_k." in k for k in style), "style covers to_q and to_v only"


@pytest.mark.parametrize("family", RENDERED)
def test_a_lora_job_renders_through_a_worker_and_swapping_back_reproduces(
    redis_conn: Redis, settings: Any, family: str
) -> None:
    model = f"tiny-{family}"
    client = client_for(redis_conn, settings)
    base = {"model": model, "prompt": "a fox", "steps": 2, "seed": 3}
    asks = [
        None,
        [{"name": "detail"}],
        [{"name": "style", "weight": 1.5}],
        [{"name": "detail"}, {"name": "style", "weight": 0.5}],
        [{"name": "detail"}],
        None,
    ]
    renderer = make_renderer(settings, [model])
    jobs, wrapper_calls = [], []
    for ask in asks:  # one at a time, counting the calls into the denoiser's LoRA wrappers
        jobs.append(client.submit({**base, **({"loras": ask} if ask else {})}))
        calls = WrapperCalls(renderer, model)
        burst(redis_conn, renderer, [model])
        wrapper_calls.append(calls.count)
        slots = renderer.cache.get(model).adapters
        assert slots and all(getattr(p, n) is w for p, n, w in slots.wrappers), "wrappers back"
    # A job that names no adapter runs the denoiser without its slots (the first job loads the
    # pipeline, so nothing counted it); one that names any runs through them.
    assert wrapper_calls[5] == 0 and all(n > 0 for n in wrapper_calls[1:5]), wrapper_calls
    by_id = {r.job_id: r for r in records(settings.timings_log)}
    got = [by_id[j.id] for j in jobs]
    assert all(r.status == "done" for r in got), [r.error for r in got]
    assert [[(x.name, x.weight) for x in r.loras] for r in got] == [
        [],
        [("detail", 0.8)],  # the manifest's default_weight
        [("style", 1.5)],
        [("detail", 0.8), ("style", 0.5)],
        [("detail", 0.8)],
        [],
    ]
    assert got[0].load_source == "disk" and got[0].timings.load > 0
    assert all(r.load_source == "resident" for r in got[1:])
    # The swap is the adapters' load; a job that changes no slot loads nothing.
    assert got[1].timings.load > 0 and got[5].timings.load > 0
    shown = [pixels(job.wait(timeout=5).images[0].path) for job in jobs]
    assert not np.array_equal(shown[0], shown[1]) and not np.array_equal(shown[1], shown[2])
    assert not np.array_equal(shown[1], shown[3])
    assert np.array_equal(shown[1], shown[4]), "back to detail alone: the same pixels"
    assert np.array_equal(shown[0], shown[5]), "no adapters: the base model's pixels"
    applied = {n.name: n.reason for n in got[0].settings.applied}
    slots = 3 if family == "sd15" else 2  # tiny-sd15 also allows detail's kohya twin
    assert (
        applied["loras"].startswith(f"{slots} hot-swap slot(s)")
        and "padded to rank 8" in applied["loras"]
    )


class WrapperCalls:
    """Counts forward calls into the model's LoRA wrappers, once the renderer holds it."""

    def __init__(self, renderer: Any, model: str) -> None:
        self.count = 0
        loaded = renderer.cache.get(model)
        slots = loaded.adapters if loaded else None
        for _, _, wrapper in slots.wrappers if slots else []:
            wrapper.register_forward_hook(self._called)

    def _called(self, *_: Any) -> None:
        self.count += 1


def test_slots_stand_back_in_place_whatever_ends_a_bypassed_job(settings: Any) -> None:
    """The wrappers leave their parents only inside bypassed(), and are back after an error."""
    renderer = make_renderer(settings, ["tiny-sd15"])
    renderer.render({"model": "tiny-sd15", "prompt": "x", "steps": 1}, LocalContext("bypass"))
    slots = renderer.cache.get("tiny-sd15").adapters
    assert slots is not None and len(slots.wrappers) >= 4
    parent, name, wrapper = slots.wrappers[0]
    with pytest.raises(RuntimeError, match="out of memory"), slots.bypassed():
        assert getattr(parent, name) is wrapper.base_layer
        raise RuntimeError("CUDA out of memory (as a denoise would raise it)")
    assert all(getattr(p, n) is w for p, n, w in slots.wrappers)
    slots.apply([LoraChoice(name="style", weight=0.5)])
    with slots.bypassed():  # a slot in use: nothing is bypassed
        assert getattr(parent, name) is wrapper


def test_the_image_carries_its_adapters_and_replays_with_them(
    redis_conn: Redis, settings: Any
) -> None:
    client = client_for(redis_conn, settings)
    request = {"model": "tiny-sd15", "prompt": "a fox", "steps": 2, "seed": 9}
    first = client.submit({**request, "loras": [{"name": "style", "weight": 0.7}]})
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    path = Path(first.wait(timeout=5).images[0].path or "")
    details = read_details(path)
    assert [(x.name, x.weight) for x in details.loras] == [("style", 0.7)]
    with Image.open(path) as image:
        assert image.info["parameters"].startswith("a fox <lora:style:0.7>\n")
    replay = details.replay_request()
    assert replay.loras == [LoraChoice(name="style", weight=0.7)]
    again = client.submit(replay)
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    assert np.array_equal(pixels(str(path)), pixels(again.wait(timeout=5).images[0].path))


def test_lora_requests_are_checked_at_submit(redis_conn: Redis, settings: Any) -> None:
    client = client_for(redis_conn, settings)
    base = {"model": "tiny-sd15", "prompt": "a fox"}
    cases = [
        ([{"name": "nope"}], "loras.0.name", "must be one of detail, kohya, style"),
        ([{"name": "detail"}, {"name": "detail"}], "loras.1.name", "is named twice"),
        ([{"name": "detail", "weight": 4.5}], "loras.0.weight", "between -4 and 4"),
        ([{"name": "detail", "weight": float("nan")}], "loras.0.weight", "between -4 and 4"),
        ([{"name": "detail"}] * 5, "loras", "at most 4 items"),
        ([{"name": "detail", "scale": 1}], "loras.0.scale", "Extra inputs"),
    ]
    for loras, field, rule in cases:
        with pytest.raises(RequestRejected) as caught:
            client.submit({**base, "loras": loras})
        problems = {p.field: p.rule for p in caught.value.problems}
        assert field in problems and rule in problems[field], (loras, problems)
    with pytest.raises(RequestRejected, match="sd-turbo's manifest allows no loras"):
        client.validate({"model": "sd-turbo", "prompt": "x", "loras": [{"name": "detail"}]})
    # An empty list asks for nothing: the same request, and the same digest, as none.
    assert client.validate({**base, "loras": []}).loras is None
    assert redis_conn.llen("rq:queue:kiln:tiny-sd15") == 0


def test_the_lora_flag(kiln_env: dict[str, str]) -> None:
    assert parse_lora_flag("detail") == LoraChoice(name="detail")
    assert parse_lora_flag("style:-0.5") == LoraChoice(name="style", weight=-0.5)
    with pytest.raises(ValueError, match="weight 'x' is not a number"):
        parse_lora_flag("style:x")
    run = kiln("submit", "--model", "tiny-sd15", "--prompt", "x", "--lora", ":1", env=kiln_env)
    assert run.returncode == 2 and "--lora ':1': must be NAME or NAME:WEIGHT" in run.stderr


def _manifest_with(settings: Any, tmp_path: Path, loras: dict[str, Any]) -> Any:
    manifest = load_manifests(settings.manifests, ["tiny-sd15"])["tiny-sd15"]
    return manifest.model_copy(update={"loras": manifest.loras | loras})


def _pipe(settings: Any) -> Any:
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(settings.models_dir / "tiny-sd15")


def test_an_adapter_that_trains_the_text_encoder_is_refused_naming_it(
    settings: Any, tmp_path: Path
) -> None:
    from api_client.loras import LoraSpec

    detail = load_file(settings.models_dir / f"tiny-sd15/loras/detail/{WEIGHT_NAME}")
    encoder_layer = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"
    detail[f"{encoder_layer}.lora_A.weight"] = torch.zeros(4, 32)
    detail[f"{encoder_layer}.lora_B.weight"] = torch.zeros(32, 4)
    (tmp_path / "te").mkdir()
    save_file(detail, tmp_path / "te" / WEIGHT_NAME)
    manifest = _manifest_with(
        settings, tmp_path, {"te": LoraSpec(source=str(tmp_path / "te"), max_rank=8)}
    )
    with pytest.raises(AdapterRefused, match=r"lora te: .*trains more than the unet \(2 tensors"):
        AdapterSlots.prepare(_pipe(settings), manifest, "unet", settings.models_dir)


def test_an_adapter_above_its_max_rank_is_refused(settings: Any, tmp_path: Path) -> None:
    from api_client.loras import LoraSpec

    style = str(settings.models_dir / "tiny-sd15/loras/style")
    manifest = _manifest_with(settings, tmp_path, {"style": LoraSpec(source=style, max_rank=4)})
    with pytest.raises(AdapterRefused, match="lora style: has rank 8, above its max_rank 4"):
        AdapterSlots.prepare(_pipe(settings), manifest, "unet", settings.models_dir)


def test_manifest_lora_entries_are_checked(tmp_path: Path) -> None:
    from api_client.manifest import ManifestInvalid, load_manifest_file
    from tests.conftest import MANIFESTS

    text = (MANIFESTS / "tiny-sd15.yaml").read_text(encoding="utf-8")
    for bad, rule in [
        ("  Bad Name: {source: x, max_rank: 4}", "lora name 'Bad Name' must be"),
        ("  odd: {source: x, max_rank: 0}", "greater than or equal to 1"),
        ("  odd: {source: x, max_rank: 4, default_weight: 9}", "less than or equal to 4"),
        ("  odd: {source: x, max_rank: 4, scale: 1}", "Extra inputs"),
    ]:
        path = tmp_path / "tiny-sd15.yaml"
        path.write_text(text.replace("loras:", f"loras:\n{bad}", 1), encoding="utf-8")
        with pytest.raises(ManifestInvalid, match=rule.replace("(", r"\(")):
            load_manifest_file(path)


@pytest.mark.slow
def test_alternating_adapters_on_a_compiled_model_compiles_each_branch_once(
    redis_conn: Redis, make_settings: Any
) -> None:
    """A compiled denoiser keeps two sets of graphs: the plain one (jobs that name no adapter
    bypass the slots) and the slotted one, built at the first adapter job with its cause named.
    After that, B, A, none, B, A build 0 graphs; the images differ, and going back to A gives
    A's pixels exactly."""
    settings = make_settings(compile="on")
    client = client_for(redis_conn, settings)
    base = {"model": "tiny-sd15", "prompt": "compiled", "steps": 2, "seed": 4}
    a, b = [{"name": "detail"}], [{"name": "style"}]
    order = [None, a, b, a, None, b, a]
    jobs = [client.submit({**base, **({"loras": x} if x else {})}) for x in order]
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    got = [records(settings.timings_log)[i] for i in range(len(order))]
    assert all(r.status == "done" and r.compiled for r in got), [r.error for r in got]
    assert got[1].recompiles > 0 and got[1].recompile_causes[0].startswith("new adapter set")
    assert got[-1].recompiles == got[1].recompiles
    assert all(r.recompile_causes == [] for r in got[2:]), [r.recompile_causes for r in got]
    shown = [pixels(job.wait(timeout=5).images[0].path) for job in jobs]
    assert not np.array_equal(shown[1], shown[2]) and not np.array_equal(shown[0], shown[1])
    assert np.array_equal(shown[1], shown[3]) and np.array_equal(shown[1], shown[6])
    assert np.array_equal(shown[2], shown[5])
    # The swap itself, from the records' load phase: tens of milliseconds, not a recompile.
    swaps = [r.timings.load for r in got[1:4]]
    print(json.dumps({"swap_s": swaps}))
    assert max(swaps) < 5


def test_a_pull_fetches_a_hub_adapter_file_and_skips_a_local_one(settings: Any) -> None:
    from api_client.loras import LoraSpec
    from worker.pipelines.pull import fetches

    flux = load_manifests(settings.manifests, ["flux1-dev"])["flux1-dev"]
    hub = LoraSpec(source="someone/flux-detail", weight_name="detail.safetensors", max_rank=16)
    local = LoraSpec(source=str(settings.models_dir / "tiny-flux/loras/detail"), max_rank=4)
    manifest = flux.model_copy(update={"loras": {"detail": hub, "local": local}, "controlnets": {}})
    [_pipeline, adapter] = fetches(manifest, settings.models_dir)
    assert (adapter.repo, adapter.allow_patterns) == ("someone/flux-detail", ["detail.safetensors"])
    assert adapter.marker == "detail.safetensors"


def test_a_lora_job_on_a_streamed_offload_is_refused_naming_why(
    redis_conn: Redis, make_settings: Any
) -> None:
    """A T4 profile streams group offload: its pinned copies would keep the old adapter."""
    settings = make_settings(device_profile="t4", memory_mode="group_offload")
    client = client_for(redis_conn, settings)
    job = client.submit(
        {"model": "tiny-sd15", "prompt": "a fox", "steps": 2, "loras": [{"name": "detail"}]}
    )
    burst(redis_conn, make_renderer(settings, ["tiny-sd15"]), ["tiny-sd15"])
    [record] = records(settings.timings_log)
    assert record.status == "failed"
    assert "loras at rung group_offload with CUDA streams" in (record.error or "")
    assert "pin rung model_offload" in (record.error or "")
    assert job.status() == "failed"
