"""What bench/gpu_check.py's controls section builds beside its random-weight pipelines: each
family's published ControlNet layout on the check's own denoiser config, and RealESRGAN x4plus's
RRDBNet, random weights at the real sizes (shrunk with the pipelines in a dry run).

Where the layouts come from. The hub's config.json files cannot be read from here, so each value
is from public copies of them or from the code that wrote them; what none confirms is said.
- sd15, lllyasviel's ControlNets (no kiln manifest names one yet): the UNet's config, and a hint
  encoder of 16, 32, 96 and 256 channels (ControlNet's cldm_v15.yaml input_hint_block), which is
  ControlNetModel's default: what diffusers' ControlNetModel.from_unet builds.
- sdxl, xinsir/controlnet-union-sdxl-1.0 (manifests/sdxl-base.yaml): ControlNetModel_Union of
  xinsir6/ControlNetPlus (models/controlnet_union.py) on SDXL's UNet config. Its condition
  transformer (320 channels, 8 heads, one layer, a 320-wide projection) is hard-coded there, and
  is ControlNetUnionModel's default; 320 is the UNet's first width, which its output is added
  to, so a dry run takes its UNet's. The hint encoder's 16, 32, 96, 256 channels are from a
  public copy of the repository's config_promax.json (ControlNetUnionModel defaults to 48, 96,
  192, 384). num_control_type 6 is ControlNetModel_Union's default and the six modes sdxl-base.yaml
  indexes; config_promax.json says 8 (ProMax's tile and repaint): unconfirmed that config.json
  says 6.
- flux, InstantX/FLUX.1-dev-Controlnet-Union (manifests/flux1-dev.yaml): FluxControlNetModel on
  FLUX.1-dev's transformer config (24 heads of 128, joint 4096, pooled 768, rope 16/56/56,
  guidance embeds), with 5 double and 10 single blocks and num_mode 10, as public copies of its
  config.json list them.
- upscaler, RealESRGAN_x4plus (manifests/realesrgan-x4plus.yaml): ESRGAN's RRDBNet with 64
  features, 23 blocks, growth 32 and 4x, as xinntao/Real-ESRGAN's inference_realesrgan.py builds
  it (RRDBNet(num_feat=64, num_block=23, num_grow_ch=32, scale=4)); spandrel's ESRGAN fixes the
  growth at 32 and reads the rest back off the state dict, as it reads the published file.
Counted at full size (on the meta device): sd15's ControlNet has 0.361 B parameters, 1.45 GB in
fp32 as lllyasviel's diffusers files are; sdxl's 1.256 B, 2.51 GB at 16 bits, sdxl-base.yaml's gb
(the hub file's size); flux's 3.302 B, 6.60 GB at 16 bits, flux1-dev.yaml's gb (it said 6.2
before this count).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

# diffusers zero-initialises a ControlNet's output layers, so one built from a config adds
# nothing: kiln's tiny ControlNets get those layers random, and so do these.
from worker.pipelines.tiny.controlnet import randomised

# Family -> what the published ControlNet changes over its denoiser's config, and the published
# manifest whose canny entry (kind, union mode) it is served as here.
LAYOUTS: dict[str, dict[str, Any]] = {
    "sd15": {},
    "sdxl": {"conditioning_embedding_out_channels": [16, 32, 96, 256], "num_control_type": 6},
    "flux": {"num_layers": 5, "num_single_layers": 10, "num_mode": 10},
}
PUBLISHED: dict[str, str] = {"sdxl": "sdxl-base.yaml", "flux": "flux1-dev.yaml"}
UPSCALER: dict[str, Any] = {"num_filters": 64, "num_blocks": 23, "scale": 4}
# The IP-Adapter's image encoder: h94/IP-Adapter's models/image_encoder, OpenCLIP's ViT-H/14
# vision tower as CLIPVisionModelWithProjection (632M parameters, 1.264 GB at 16 bits; its adapter
# for SDXL, ip-adapter_sdxl_vit-h, and for SD1.5, ip-adapter_sd15, both read its 1024-wide
# embedding). A dry run takes kiln's tiny encoder (worker.pipelines.tiny.ip_adapter.ENCODER).
VIT_H: dict[str, Any] = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 14,
    "projection_dim": 1024,
    "hidden_act": "gelu",  # OpenCLIP's towers use exact GELU, not OpenAI CLIP's quick_gelu
}


def controlnet(
    family: str, model_class: str, denoiser: dict[str, Any], changes: dict[str, Any]
) -> Any:
    """model_class (kiln's for the family: a diffusers ModelMixin) in the published layout on the
    denoiser's config, with changes (a dry run's) over it, every layer random; built on torch's
    default device and dtype."""
    import diffusers

    cls = getattr(diffusers, model_class)
    keys = cls._get_init_keys(cls)
    layout = {k: v for k, v in denoiser.items() if k in keys} | LAYOUTS[family]
    if family == "sdxl":
        width = denoiser["block_out_channels"][0]
        layout |= {"num_trans_channel": width, "num_proj_channel": width}
    return randomised(cls(**layout | changes).eval())


def upscaler(path: Path, changes: dict[str, Any]) -> int:
    """RealESRGAN x4plus's architecture with changes (a dry run's), random weights, saved as its
    published safetensors file is, so spandrel detects it the same way; the bytes written."""
    from safetensors.torch import save_file
    from spandrel.architectures.ESRGAN import ESRGAN

    model = ESRGAN(**UPSCALER | changes)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path.stat().st_size


def square_png(width: int, height: int) -> str:
    """A white square on black as a data: URL: a map for a ControlNet, an image for an upscaler,
    and a few kB at any size (kiln caps a data: URL at 2 MiB; noise at 1024^2 is 3 MB)."""
    from PIL import Image

    image = Image.new("RGB", (width, height), (0, 0, 0))
    image.paste((255, 255, 255), (width // 4, height // 4, 3 * width // 4, 3 * height // 4))
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
