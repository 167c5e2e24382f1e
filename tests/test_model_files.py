"""Model files as self-hosters have them (#39): never a pickle (refused by `kiln manifests check`
and at load), kohya / A1111 LoRA files, `kiln manifests new` from a file's header, single-file
checkpoints and a component from its own (GGUF) file, each against the tiny diffusers-layout
pipeline it was converted from."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from redis import Redis
from safetensors.torch import load_file, save_file

from api_client.loras import LoraSpec
from api_client.manifest import Manifest, ManifestInvalid, load_manifest_file
from api_client.model_files import PickleRefused
from tests.conftest import MANIFESTS, kiln
from tests.support.images import pixels
from tests.support.inprocess import burst, client_for, make_renderer
from worker.manifest import load_manifests
from worker.memory.device import probe
from worker.ops.new_manifest import read_header, tell_family
from worker.pipelines.adapters import read_adapter
from worker.pipelines.loading import read_pipeline
from worker.pipelines.tiny.files import KOHYA_LORA

TINY_SD15 = """\
id: {id}
family: sd15
source: {source}
steps: {{default: 2, max: 8}}
guidance: {{default: 7.0, max: 15.0}}
resolutions: [[128, 128]]
min_vram_gb: 0.1
"""


def _manifest(**fields: Any) -> Manifest:
    """A tiny-sd15 manifest with fields replaced, unvalidated: what a load meets when a manifest
    came from somewhere other than a checked file."""
    shipped = load_manifests(MANIFESTS, ["tiny-sd15"])["tiny-sd15"]
    return shipped.model_copy(update=fields)


def _render(loaded: Any, seed: int = 4) -> Any:
    generator = torch.Generator().manual_seed(seed)
    out = loaded.pipe(
        "a fox", num_inference_steps=1, height=128, width=128, generator=generator, output_type="np"
    )
    return out.images[0]


def test_check_refuses_a_pickle_checkpoint_lora_or_component(
    tmp_path: Path, kiln_env: dict[str, str]
) -> None:
    (tmp_path / "a.yaml").write_text(TINY_SD15.format(id="a", source="dreamshaper.ckpt"))
    lora = TINY_SD15.format(id="b", source="tiny-sd15")
    lora += "loras: {x: {source: loras/x.pt, max_rank: 4}}\n"
    (tmp_path / "b.yaml").write_text(lora)
    part = TINY_SD15.format(id="c", source="tiny-sd15")
    part += "components: {unet: {file: unet.pth, gb: 1.0}}\n"
    (tmp_path / "c.yaml").write_text(part)
    (tmp_path / "d.yaml").write_text(TINY_SD15.format(id="d", source="model.bin"))
    done = kiln("manifests", "check", str(tmp_path), env=kiln_env)
    assert done.returncode == 1, done.stdout
    for name, suffix in (("a", ".ckpt"), ("b", ".pt"), ("c", ".pth"), ("d", ".bin")):
        line = next(line for line in done.stderr.splitlines() if f"{name}.yaml" in line)
        assert f"is a pickle ({suffix})" in line and "arbitrary code on load" in line, line
        assert "convert it to safetensors" in line, line
    assert "0 valid, 4 invalid" in done.stdout
    both = TINY_SD15.format(id="e", source="tiny-sd15").replace("family: sd15", "family: flux")
    both += "components: {transformer: {file: t.gguf, gb: 1}}\nquantize: {transformer: int8}\n"
    (tmp_path / "e.yaml").write_text(both)
    with pytest.raises(ManifestInvalid, match="a GGUF component is what its file holds"):
        load_manifest_file(tmp_path / "e.yaml")


def test_the_load_refuses_a_pickle_whatever_the_manifest_said(
    tiny_dir: Path, settings: Any, tmp_path: Path
) -> None:
    info = probe(settings)
    with pytest.raises(PickleRefused, match=r"model tiny-sd15: source 'x\.ckpt' is a pickle"):
        read_pipeline(_manifest(source="x.ckpt"), info, settings)
    spec = LoraSpec.model_construct(source="loras/x.pt", weight_name="w.pt", max_rank=4)
    with pytest.raises(PickleRefused, match="is a pickle"):
        read_pipeline(_manifest(loras={"x": spec}), info, settings)
    # A LoRA's directory holding a pickle under a safetensors-looking name is never unpickled
    # either: the adapter file is read by safetensors alone.
    torch.save({"x": torch.zeros(1)}, tmp_path / "adapter.pth")
    spec = LoraSpec.model_construct(source=str(tmp_path), weight_name="adapter.pth", max_rank=4)
    with pytest.raises(PickleRefused, match=r"adapter\.pth' is a pickle"):
        read_adapter(_manifest(), "x", spec, object, "unet", tiny_dir)


def test_a_diffusers_layout_with_only_pickled_weights_is_never_unpickled(
    tiny_dir: Path, make_settings: Any, tmp_path: Path
) -> None:
    """from_pretrained never falls back to a repository's .bin weights (use_safetensors)."""
    models = tmp_path / "models"
    shutil.copytree(tiny_dir / "tiny-sd15", models / "tiny-sd15")
    unet = models / "tiny-sd15" / "unet"
    weights = unet / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(weights), unet / "diffusion_pytorch_model.bin")
    weights.unlink()
    settings = make_settings(models_dir=models)
    with pytest.raises(OSError, match="safetensors"):
        read_pipeline(_manifest(), probe(settings), settings)


def test_a_kohya_lora_file_renders_as_the_peft_lora_it_came_from(settings: Any) -> None:
    """tiny-sd15's `kohya` is `detail` in kohya / A1111 key names (tiny/files.py): diffusers'
    converter reads it back to the same layers, so the same weight renders the same pixels."""
    from api_client.schema import LoraChoice

    kohya = load_file(settings.models_dir / "tiny-sd15/loras" / KOHYA_LORA)
    assert kohya and all(k.startswith("lora_unet_") for k in kohya)
    kinds = {k.rsplit(".", 2)[-2] if k.endswith(".weight") else "alpha" for k in kohya}
    assert kinds == {"lora_down", "lora_up", "alpha"}
    shipped = _manifest()
    manifest = shipped.model_copy(
        update={"loras": {n: shipped.loras[n] for n in ("detail", "kohya")}, "taesd": None}
    )
    loaded = read_pipeline(manifest, probe(settings), settings)
    slots = loaded.adapters
    assert slots is not None and slots.adapters["kohya"].rank == 4
    shown = []
    for ask in ([], [("kohya", 1.0)], [("detail", 1.0)], [("kohya", 0.0)]):
        slots.apply([LoraChoice(name=n, weight=w) for n, w in ask])
        shown.append(_render(loaded))
    assert not np.array_equal(shown[0], shown[1]), "the kohya LoRA changes the image"
    assert np.array_equal(shown[1], shown[2]), "the kohya file renders its PEFT twin's pixels"
    assert np.array_equal(shown[0], shown[3]), "at weight 0 it changes nothing"


def _zeros(*shape: int) -> torch.Tensor:
    return torch.zeros(shape)


# A file's first tensors as each layout names them (tiny shapes; the header is what is read).
LAYOUTS: dict[str, dict[str, torch.Tensor]] = {
    "sd15": {
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": _zeros(
            8, 768
        ),
        "first_stage_model.decoder.conv_in.weight": _zeros(4, 4, 3, 3),
        "cond_stage_model.transformer.text_model.final_layer_norm.weight": _zeros(768),
    },
    "sd2": {
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": _zeros(
            8, 1024
        ),
        "cond_stage_model.model.token_embedding.weight": _zeros(4, 1024),
    },
    "sdxl": {
        "model.diffusion_model.input_blocks.0.0.weight": _zeros(8, 4, 3, 3),
        "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight": _zeros(768),
        "conditioner.embedders.1.model.token_embedding.weight": _zeros(4, 1280),
    },
    "sd3": {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": _zeros(24, 8)},
    "flux": {"double_blocks.0.img_attn.qkv.weight": _zeros(24, 8)},
}


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_manifests_new_tells_the_family_from_the_header(family: str, tmp_path: Path) -> None:
    from api_client.manifest import load_manifest_file, manifest_dirs
    from worker.ops.new_manifest import new_manifest

    path = tmp_path / f"Civitai {family}.safetensors"
    save_file(LAYOUTS[family], path)
    written = new_manifest(path, manifest_dirs(), tmp_path, tmp_path / "out")
    manifest = load_manifest_file(written)
    assert written.name == f"civitai-{family}.yaml" and manifest.family == family
    if family == "flux":  # the transformer alone: a component over the family's repo
        assert manifest.source == "tiny-flux" and manifest.config is None
        assert manifest.components["transformer"].file == path.name
    else:
        config = "stabilityai/sd-turbo" if family == "sd2" else f"tiny-{family}"  # no tiny-sd2
        assert manifest.source == path.name and manifest.config == config
    assert manifest.min_vram_gb > 0 and manifest.component_gb


def test_manifests_new_refuses_a_pickle_and_asks_for_a_family_it_cannot_tell(
    tmp_path: Path, kiln_env: dict[str, str]
) -> None:
    torch.save({"x": torch.zeros(1)}, tmp_path / "model.ckpt")
    done = kiln(
        "manifests", "new", str(tmp_path / "model.ckpt"), "--out", str(tmp_path), env=kiln_env
    )
    assert done.returncode == 1 and "is a pickle" in done.stderr, done.stderr
    assert "convert it to safetensors" in done.stderr
    unclear = dict(LAYOUTS["sd15"])
    unclear.pop("cond_stage_model.transformer.text_model.final_layer_norm.weight")
    save_file(unclear, tmp_path / "unet.safetensors")
    done = kiln(
        "manifests", "new", str(tmp_path / "unet.safetensors"), "--out", str(tmp_path), env=kiln_env
    )
    assert done.returncode == 1 and "pass --family sd15 or sd2" in done.stderr, done.stderr
    done = kiln(
        "manifests",
        "new",
        str(tmp_path / "unet.safetensors"),
        *("--family", "sd15", "--id", "mine", "--config", "tiny-sd15", "--out", str(tmp_path)),
        env=kiln_env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "mine.yaml")
    assert "config: tiny-sd15" in (tmp_path / "mine.yaml").read_text()


def test_manifests_new_reads_a_gguf_transformer(tmp_path: Path) -> None:
    import gguf

    from api_client.manifest import load_manifest_file, manifest_dirs
    from worker.ops.new_manifest import new_manifest

    path = tmp_path / "flux1-dev-Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), "flux")
    weights = np.random.default_rng(0).random((64, 64), dtype=np.float32)
    quant = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor(
        "double_blocks.0.img_attn.qkv.weight", gguf.quantize(weights, quant), raw_dtype=quant
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    manifest = load_manifest_file(new_manifest(path, manifest_dirs(), tmp_path, tmp_path))
    assert manifest.family == "flux" and manifest.components["transformer"].gguf
    assert "transformer" not in manifest.quantize, "a GGUF file is what it holds"
    assert "(Q8_0)" in (tmp_path / "flux1-dev-q8_0.yaml").read_text()


@pytest.mark.parametrize("family", ["sd15", pytest.param("sdxl", marks=pytest.mark.slow)])
def test_a_single_file_checkpoint_renders_the_pixels_of_its_diffusers_twin(
    settings: Any, family: str
) -> None:
    """tiny-<family>.safetensors holds the tiny pipeline's own weights in the original layout
    (LDM, SGM); from_single_file with the twin's directory as config reads them back exactly."""
    from api_client.manifest import load_manifest_file

    info = probe(settings)
    twin = load_manifest_file(MANIFESTS / f"tiny-{family}.yaml").model_copy(
        update={"loras": {}, "controlnets": {}, "ip_adapter": None, "taesd": None}
    )
    single = load_manifest_file(MANIFESTS / f"tiny-{family}-file.yaml").model_copy(
        update={"loras": {}}
    )
    header = read_header(settings.models_dir / single.source)
    assert tell_family(header) == (family, True), "manifests new tells the tiny file's family"
    from_file = read_pipeline(single, info, settings)
    assert any("one checkpoint file" in n.reason for n in from_file.settings.applied)
    assert np.array_equal(_render(read_pipeline(twin, info, settings)), _render(from_file))


def test_a_single_file_checkpoint_serves_every_mode_with_a_lora_on_a_lower_rung(
    redis_conn: Redis, settings: Any
) -> None:
    """Through the job path a worker runs: tiny-sd15-file takes txt2img and img2img with its kohya
    LoRA at model_offload (the hotswap lifts and restores the offload hooks on the worker's own
    device: diffusers' own restore raised "requires accelerator" on a CPU) and inpaint at
    group_offload, and renders tiny-sd15's pixels for each, request for request."""
    from tests.support.images import mask_png, png

    client = client_for(redis_conn, settings)
    image, mask = client.upload(png()), client.upload(mask_png())
    base = {"prompt": "a fox", "steps": 2, "seed": 4}
    asks = [
        {"loras": [{"name": "kohya"}], "rung": "model_offload"},
        {"image": image, "strength": 0.6, "loras": [{"name": "kohya", "weight": 0.5}],
         "rung": "model_offload"},
        {"image": image, "mask": mask, "rung": "group_offload"},
    ]
    models = ["tiny-sd15", "tiny-sd15-file"]
    jobs = {m: [client.submit({"model": m, **base, **ask}) for ask in asks] for m in models}
    burst(redis_conn, make_renderer(settings, models), models)
    results = {m: [job.wait(timeout=5) for job in jobs[m]] for m in models}
    for twin, single in zip(results["tiny-sd15"], results["tiny-sd15-file"], strict=True):
        assert single.rung == twin.rung
        assert np.array_equal(pixels(twin.images[0].path), pixels(single.images[0].path))
    assert [r.rung for r in results["tiny-sd15-file"]] == [a["rung"] for a in asks]
    shown = [pixels(r.images[0].path) for r in results["tiny-sd15-file"]]
    assert not np.array_equal(shown[0], shown[1]) and not np.array_equal(shown[1], shown[2])


SINGLE_ON_THE_HUB = """\
id: civitai-sdxl
family: sdxl
source: someone/civitai-sdxl/juggernaut.safetensors
config: stabilityai/stable-diffusion-xl-base-1.0
steps: {default: 20, max: 50}
guidance: {default: 6.0, max: 12.0}
resolutions: [[1024, 1024]]
min_vram_gb: 10
"""


def test_pull_takes_a_single_file_and_its_config_and_never_fetches_offline(
    settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    from api_client.manifest import load_manifest_file
    from worker.pipelines.pull import PullError, fetches, missing, pull

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fetched: list[str] = []
    for name in ("snapshot_download", "hf_hub_download"):
        real = getattr(huggingface_hub, name)
        monkeypatch.setattr(
            huggingface_hub,
            name,
            lambda repo, *a, _real=real, local_files_only=False, **k: (
                (fetched.append(repo) if not local_files_only else None)
                or _real(repo, *a, local_files_only=local_files_only, **k)
            ),
        )
    (tmp_path / "civitai-sdxl.yaml").write_text(SINGLE_ON_THE_HUB)
    manifest = load_manifest_file(tmp_path / "civitai-sdxl.yaml")
    wanted = fetches(manifest, settings.models_dir)
    assert [(f.repo, f.allow_patterns[0], f.configs_only) for f in wanted] == [
        ("someone/civitai-sdxl", "juggernaut.safetensors", False),
        ("stabilityai/stable-diffusion-xl-base-1.0", "model_index.json", True),
    ]
    assert not any(p.endswith(".safetensors") for p in wanted[1].allow_patterns), "configs only"
    models = {manifest.id: manifest}
    assert "someone/civitai-sdxl" in missing(models, settings.models_dir)[manifest.id]
    with pytest.raises(PullError, match="HF_HUB_OFFLINE is set"):
        pull(models, settings.models_dir, say=lambda _line: None)
    assert fetched == [], "offline: nothing fetched"
    tiny = load_manifests(MANIFESTS, ["tiny-sd15-file", "tiny-sdxl-file"])
    assert [fetches(m, settings.models_dir) for m in tiny.values()] == [[], []], "on this disk"


def _psnr(a: Any, b: Any) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_a_gguf_transformer_renders_close_to_full_precision_and_says_so(
    redis_conn: Redis, make_settings: Any
) -> None:
    """tiny-flux-gguf is tiny-flux with its transformer from a Q8_0 GGUF of the same weights:
    not the same pixels as tiny-flux at full precision (KILN_QUANTIZE=off governs torchao; a
    GGUF file is what it holds), within 25 dB PSNR of them on the same seed; the record and the
    result name it."""
    from worker.render.timings import read_records

    settings = make_settings(quantize="off")
    header = read_header(settings.models_dir / "tiny-flux/tiny-flux-transformer-Q8_0.gguf")
    assert header.quant == "Q8_0" and tell_family(header) == ("flux", False)
    client = client_for(redis_conn, settings)
    models = ["tiny-flux", "tiny-flux-gguf"]
    jobs = [client.submit({"model": m, "prompt": "a fox", "steps": 2, "seed": 6}) for m in models]
    burst(redis_conn, make_renderer(settings, models), models)
    results = [job.wait(timeout=5) for job in jobs]
    full, gguf = (pixels(r.images[0].path) for r in results)
    assert not np.array_equal(full, gguf), "the GGUF transformer is what its file holds"
    assert _psnr(full, gguf) >= 25, _psnr(full, gguf)
    assert results[0].quantized == {} and results[1].quantized == {"transformer": "gguf-Q8_0"}
    by_model = {r.model: r for r in read_records(settings.timings_log)}
    assert by_model["tiny-flux-gguf"].quantized == {"transformer": "gguf-Q8_0"}
