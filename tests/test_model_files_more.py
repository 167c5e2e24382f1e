"""Model files as self-hosters have them (#39), the rest: an SD3 checkpoint in one file (SD3's own
layout, text encoders included), a FLUX.1 transformer in BFL's layout, and the same in float8
e4m3 as ComfyUI ships it, each against the tiny diffusers-layout pipeline it was written from
(worker/pipelines/tiny/files.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from redis import Redis
from safetensors.torch import load_file, save_file

from api_client.manifest import Manifest, load_manifest_file
from tests.conftest import MANIFESTS
from tests.support.images import pixels
from tests.support.inprocess import burst, client_for, make_renderer
from worker.memory.device import probe
from worker.memory.peaks import module_bytes
from worker.ops.new_manifest import read_header, tell_family
from worker.pipelines.loading import read_pipeline
from worker.pipelines.tiny.files import BFL_TRANSFORMER, FP8_TRANSFORMER


def _bare(name: str) -> Manifest:
    """A shipped manifest without the adapters and previews a render here does not need."""
    return load_manifest_file(MANIFESTS / f"{name}.yaml").model_copy(
        update={"loras": {}, "controlnets": {}, "ip_adapter": None, "taesd": None}
    )


def _render(loaded: Any, seed: int = 4) -> Any:
    generator = torch.Generator().manual_seed(seed)
    out = loaded.pipe(
        "a fox", num_inference_steps=2, height=128, width=128, generator=generator, output_type="np"
    )
    return out.images[0]


def _psnr(a: Any, b: Any) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_an_sd3_file_renders_the_pixels_of_its_diffusers_twin(make_settings: Any) -> None:
    """tiny-sd3.safetensors holds tiny-sd3's weights as sd3.5_medium.safetensors holds SD3's.
    diffusers reads SD3's CLIP-L unprojected (an identity text_projection, as SD3's reference
    code uses CLIP-L: return_projected_pooled=False), so the twin's projection is made the
    identity; every other weight is read back exactly, the T5 tied and in eval mode (dropout
    off) as from_pretrained leaves it."""
    settings = make_settings(quantize="off")
    info = probe(settings)
    single = _bare("tiny-sd3-file")
    assert tell_family(read_header(settings.models_dir / single.source)) == ("sd3", True)
    from_file = read_pipeline(single, info, settings)
    assert any("one checkpoint file" in n.reason for n in from_file.settings.applied)
    twin = read_pipeline(_bare("tiny-sd3"), info, settings)
    unprojected = _render(twin)
    with torch.no_grad():
        projection = twin.pipe.text_encoder.text_projection.weight
        projection.copy_(torch.eye(projection.shape[0]))
    assert np.array_equal(_render(twin), _render(from_file))
    assert not np.array_equal(unprojected, _render(from_file)), "the projection is read as SD3's"
    t5 = from_file.pipe.text_encoder_3
    assert t5.encoder.embed_tokens.weight is t5.shared.weight and not t5.training
    assert module_bytes(t5) == module_bytes(twin.pipe.text_encoder_3), "held once, as the twin"


def test_a_bfl_flux_transformer_renders_the_pixels_of_its_twin(settings: Any) -> None:
    """tiny-flux-transformer.safetensors is tiny-flux's transformer in BFL's names. diffusers'
    BFL converter cannot read it alone (it splits linear1 at FLUX.1's 3072 width); kiln splits
    it at the config's width and leaves the rest to the converter, which then reads it exactly:
    quantized by torchao as tiny-flux's is, it renders tiny-flux's pixels."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    path = settings.models_dir / "tiny-flux" / BFL_TRANSFORMER
    assert tell_family(read_header(path)) == ("flux", False)
    bfl = load_file(path)
    assert "single_blocks.0.linear1.weight" in bfl and "double_blocks.0.img_attn.qkv.weight" in bfl
    with pytest.raises(RuntimeError, match="split_with_sizes"):
        convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    info = probe(settings)
    from_file = read_pipeline(_bare("tiny-flux-file"), info, settings)
    twin = read_pipeline(_bare("tiny-flux"), info, settings)
    # The file's fp32 weights are no quantization of their own: torchao's int8 (this CPU) is
    # the manifest's, as tiny-flux's.
    assert from_file.quantized == twin.quantized == {"transformer": "int8"}
    assert np.array_equal(_render(twin), _render(from_file))


def test_an_fp8_transformer_is_held_in_fp8_renders_close_and_says_so(
    redis_conn: Redis, make_settings: Any
) -> None:
    """tiny-flux-fp8 reads its transformer from a float8_e4m3fn file (BFL's layout, as ComfyUI
    ships FLUX.1 in fp8): held in fp8 (resident bytes counted as held), computed in the worker's
    dtype, within 35 dB PSNR of tiny-flux at full precision (46 dB measured); the record and the
    result say quantized {transformer: fp8-e4m3}."""
    from worker.render.timings import read_records

    settings = make_settings(quantize="off")
    path = settings.models_dir / "tiny-flux" / FP8_TRANSFORMER
    assert load_file(path)["single_blocks.0.linear1.weight"].dtype == torch.float8_e4m3fn
    loaded = read_pipeline(_bare("tiny-flux-fp8"), probe(settings), settings)
    transformer = loaded.pipe.transformer
    linear1 = transformer.single_transformer_blocks[0].attn.to_q.weight
    assert linear1.dtype == torch.float8_e4m3fn, "held as the file holds it"
    full = read_pipeline(_bare("tiny-flux"), probe(settings), settings).pipe.transformer
    assert module_bytes(transformer) < 0.5 * module_bytes(full)
    client = client_for(redis_conn, settings)
    models = ["tiny-flux", "tiny-flux-fp8"]
    jobs = [client.submit({"model": m, "prompt": "a fox", "steps": 2, "seed": 6}) for m in models]
    burst(redis_conn, make_renderer(settings, models), models)
    results = [job.wait(timeout=5) for job in jobs]
    full_px, fp8_px = (pixels(r.images[0].path) for r in results)
    assert not np.array_equal(full_px, fp8_px), "the fp8 transformer is what its file holds"
    assert _psnr(full_px, fp8_px) >= 35, _psnr(full_px, fp8_px)
    assert results[0].quantized == {} and results[1].quantized == {"transformer": "fp8-e4m3"}
    by_model = {r.model: r for r in read_records(settings.timings_log)}
    assert by_model["tiny-flux-fp8"].quantized == {"transformer": "fp8-e4m3"}


def test_an_fp8_file_is_refused_where_it_cannot_be_what_it_holds(
    make_settings: Any, tmp_path: Path
) -> None:
    """quantize may not name a component whose file holds fp8 (torchao would quantize weights
    already quantized), and ComfyUI's scaled fp8 files (a scale_weight a layer) are refused:
    diffusers would read their weights without the scales."""
    settings = make_settings(quantize="off")
    info = probe(settings)
    with pytest.raises(ValueError, match="holds fp8-e4m3 weights; drop transformer from quantize"):
        read_pipeline(
            _bare("tiny-flux-fp8").model_copy(update={"quantize": {"transformer": "int8"}}),
            info,
            settings,
        )
    scaled = load_file(settings.models_dir / "tiny-flux" / FP8_TRANSFORMER)
    scaled["single_blocks.0.linear1.scale_weight"] = torch.ones(1)
    save_file(scaled, tmp_path / "scaled.safetensors")
    manifest = _bare("tiny-flux-fp8")
    spec = manifest.components["transformer"].model_copy(
        update={"file": str(tmp_path / "scaled.safetensors")}
    )
    with pytest.raises(ValueError, match="scaled fp8 file"):
        read_pipeline(
            manifest.model_copy(update={"components": {"transformer": spec}}), info, settings
        )


def test_a_lora_on_an_fp8_transformer_computes_in_the_workers_dtype(make_settings: Any) -> None:
    """PEFT makes a LoRA's layers in the fp8 base layer's dtype; the load makes them the
    worker's (single_file.lora_layers_in_compute_dtype): the LoRA then changes the image, at
    weight 0 it does not, and it stays as close to tiny-flux with the same LoRA as without it."""
    from api_client.schema import LoraChoice

    settings = make_settings(quantize="off")
    info = probe(settings)
    loras = {"detail": load_manifest_file(MANIFESTS / "tiny-flux.yaml").loras["detail"]}
    fp8 = read_pipeline(_bare("tiny-flux-fp8").model_copy(update={"loras": loras}), info, settings)
    full = read_pipeline(_bare("tiny-flux").model_copy(update={"loras": loras}), info, settings)
    shown: list[Any] = []
    twin: list[Any] = []
    for ask in ([], [("detail", 1.0)], [("detail", 0.0)]):
        for loaded, images in ((fp8, shown), (full, twin)):
            assert loaded.adapters is not None
            loaded.adapters.apply([LoraChoice(name=n, weight=w) for n, w in ask])
            images.append(_render(loaded))
    assert not np.array_equal(shown[0], shown[1]) and np.array_equal(shown[0], shown[2])
    close = _psnr(twin[1] * 255, shown[1] * 255)
    assert close >= 35, close


@pytest.mark.slow  # three loads and renders; make test holds fp8's render and record
def test_an_fp8_transformer_renders_the_same_on_every_rung(
    redis_conn: Redis, make_settings: Any
) -> None:
    """Held in fp8 at full, model_offload and group_offload alike (with release keeping the
    layerwise-casting hook, measured: the same pixels on each rung)."""
    settings = make_settings(quantize="off")
    client = client_for(redis_conn, settings)
    models = ["tiny-flux-fp8"]
    base = {"model": "tiny-flux-fp8", "prompt": "a fox", "steps": 2, "seed": 6}
    rungs = ("full", "model_offload", "group_offload")
    jobs = [client.submit({**base, "rung": rung}) for rung in rungs]
    burst(redis_conn, make_renderer(settings, models), models)
    results = [job.wait(timeout=5) for job in jobs]
    assert [r.rung for r in results] == list(rungs)
    shown = [pixels(r.images[0].path) for r in results]
    assert all(np.array_equal(shown[0], other) for other in shown[1:])


SD2 = """\
id: {id}
family: sd2
source: {source}
{config}steps: {{default: 2, max: 8}}
guidance: {{default: 7.0, max: 15.0}}
resolutions: [[128, 128]]
min_vram_gb: 0.1
"""


def _tiny_sd2(directory: Path) -> None:
    """tiny-sd15 made SD 2.x-shaped (no tiny-sd2 ships): a linear-projection UNet, a GELU text
    encoder that the file holds in OpenCLIP's layout, a v-prediction scheduler."""
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    from worker.pipelines.tiny.components import CLIP_HIDDEN, LATENT_SIZE, clip_config, seeded
    from worker.pipelines.tiny.sd import sd15

    pipe = sd15()
    pipe.unet = seeded(
        61,
        lambda: UNet2DConditionModel(
            sample_size=LATENT_SIZE,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=CLIP_HIDDEN,
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            norm_num_groups=8,
        ),
    )
    pipe.text_encoder = seeded(62, lambda: CLIPTextModel(clip_config(len(pipe.tokenizer), "gelu")))
    pipe.scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="v_prediction",
        steps_offset=1,
    )
    pipe.save_pretrained(directory, safe_serialization=True)


def test_an_sd2_file_renders_the_pixels_of_its_diffusers_twin(
    make_settings: Any, tmp_path: Path
) -> None:
    """The LDM writer with OpenCLIP's text layout (ldm_openclip_file) is SD 2.x's single file:
    read back through the same single-file path, v-prediction from the config, the same pixels."""
    from worker.pipelines.tiny.files import ldm_openclip_file

    models = tmp_path / "models"
    _tiny_sd2(models / "tiny-sd2")
    save_file(ldm_openclip_file(models / "tiny-sd2"), models / "tiny-sd2.safetensors")
    assert tell_family(read_header(models / "tiny-sd2.safetensors")) == ("sd2", True)
    for name, text in (
        ("twin", SD2.format(id="twin", source="tiny-sd2", config="")),
        ("file", SD2.format(id="file", source="tiny-sd2.safetensors", config="config: tiny-sd2\n")),
    ):
        (tmp_path / f"{name}.yaml").write_text(text)
    settings = make_settings(models_dir=models, quantize="off")
    info = probe(settings)
    twin = read_pipeline(load_manifest_file(tmp_path / "twin.yaml"), info, settings)
    from_file = read_pipeline(load_manifest_file(tmp_path / "file.yaml"), info, settings)
    assert from_file.pipe.scheduler.config.prediction_type == "v_prediction"
    assert np.array_equal(_render(twin), _render(from_file))


def test_manifests_new_takes_an_fp8_file_as_what_it_holds(tmp_path: Path) -> None:
    """ComfyUI's fp8 transformer is held in float8 already: the manifest `kiln manifests new`
    writes quantizes it no further (a scheme on it would be refused at load)."""
    from api_client.manifest import manifest_dirs
    from worker.ops.new_manifest import new_manifest

    path = tmp_path / "flux-fp8.safetensors"
    save_file(
        {"double_blocks.0.img_attn.qkv.weight": torch.zeros(24, 8).to(torch.float8_e4m3fn)}, path
    )
    assert read_header(path).quant == "fp8-e4m3"
    manifest = load_manifest_file(new_manifest(path, manifest_dirs(), tmp_path, tmp_path / "out"))
    assert manifest.components["transformer"].file == path.name
    assert "transformer" not in manifest.quantize
