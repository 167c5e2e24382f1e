"""Previews for the video families, which have no TAESD in kiln: the middle frame of the latest
step's latents projected to RGB by one fixed linear map per VAE latent space (ComfyUI's
Latent2RGB preview), scaled up to the job's size. No weights to load; a few milliseconds a step.

The maps are ComfyUI's latent_rgb_factors and latent_rgb_factors_bias (classes Wan21, Wan22 and
LTXV of comfy/latent_formats.py), fitted by its authors against each VAE's decodes:
https://github.com/Comfy-Org/ComfyUI/blob/9a9a69fd745de98e89b0f1a629cd3bc43d513a42/comfy/latent_formats.py
(the same values at 75399d78ddcc01f46f9b94521b29f1fe8a90ed53). ComfyUI applies them as
rgb = latent . factors + bias, read as [-1, 1] (comfy/latent_preview.py, Latent2RGBPreviewer),
to latents in the space the diffusers pipelines denoise in: normalised by the VAE's per-channel
mean and std (docs/video-sources.md, section 4). A latent space is told by its VAE's channel
count under the config field that counts them (Wan's z_dim, LTX-Video's latent_channels), so a
VAE with no table here (a tiny model's shrunk one) previews nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from PIL import Image

    from worker.pipelines.resident import LoadedPipeline

RGB = tuple[float, float, float]


@dataclass(frozen=True)
class LatentSpace:
    """One VAE latent space's linear map to RGB: a row of R, G, B weights per latent channel."""

    name: str
    field: str  # the VAE config field that counts its latent channels
    factors: tuple[RGB, ...]
    bias: RGB

    @property
    def channels(self) -> int:
        return len(self.factors)


def space_for(vae: Any) -> LatentSpace | None:
    """The latent space of this VAE's latents, or None where kiln has no table for it."""
    config = getattr(vae, "config", None)
    return next((s for s in SPACES if getattr(config, s.field, None) == s.channels), None)


def previews(loaded: LoadedPipeline) -> bool:
    """Whether a job on loaded previews by projection: a video family's, whose VAE's latent space
    has a table (an image family's 16-channel VAE is not Wan 2.1's space, whatever its count)."""
    return loaded.manifest.family_row.video and space_for(loaded.pipe.vae) is not None


def project(pipe: Any, latents: torch.Tensor, width: int, height: int, frames: int) -> Image.Image:
    """The first video's middle latent frame as RGB at width x height, from latents as the step
    callback hands them: [B, C, F, H, W], or LTX-Video's tokens [B, F*H*W, C] (a width x height,
    frames-long render's, unpacked here)."""
    import torch.nn.functional as F
    from PIL import Image

    space = space_for(pipe.vae)
    if space is None:
        raise ValueError(f"{type(pipe.vae).__name__}: no latent-to-RGB table for its latents")
    video = _unpacked(pipe, latents[:1], width, height, frames)
    frame = video[0, :, video.shape[2] // 2].float()  # [C, H, W]
    factors = torch.tensor(space.factors, device=frame.device)
    bias = torch.tensor(space.bias, device=frame.device)
    rgb = torch.einsum("chw,cr->rhw", frame, factors) + bias[:, None, None]
    rgb = F.interpolate(rgb[None], size=(height, width), mode="bilinear")[0]
    pixels = ((rgb + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy())


def _unpacked(
    pipe: Any, latents: torch.Tensor, width: int, height: int, frames: int
) -> torch.Tensor:
    """[B, C, F, H, W]: LTX-Video's packed tokens unpacked with its pipeline's own helper."""
    if latents.ndim == 5:
        return latents
    spatial = pipe.vae_spatial_compression_ratio
    return pipe._unpack_latents(  # type: ignore[no-any-return]
        latents,
        (frames - 1) // pipe.vae_temporal_compression_ratio + 1,
        height // spatial,
        width // spatial,
        pipe.transformer_spatial_patch_size,
        pipe.transformer_temporal_patch_size,
    )


# ComfyUI's Wan21: Wan 2.1's VAE, 16 channels, 8x spatial, 4x temporal.
WAN21 = LatentSpace(
    "Wan 2.1",
    "z_dim",
    factors=(
        (-0.1299, -0.1692, 0.2932),
        (0.0671, 0.0406, 0.0442),
        (0.3568, 0.2548, 0.1747),
        (0.0372, 0.2344, 0.1420),
        (0.0313, 0.0189, -0.0328),
        (0.0296, -0.0956, -0.0665),
        (-0.3477, -0.4059, -0.2925),
        (0.0166, 0.1902, 0.1975),
        (-0.0412, 0.0267, -0.1364),
        (-0.1293, 0.0740, 0.1636),
        (0.0680, 0.3019, 0.1128),
        (0.0032, 0.0581, 0.0639),
        (-0.1251, 0.0927, 0.1699),
        (0.0060, -0.0633, 0.0005),
        (0.3477, 0.2275, 0.2950),
        (0.1984, 0.0913, 0.1861),
    ),
    bias=(-0.1835, -0.0868, -0.3360),
)

# ComfyUI's Wan22: Wan 2.2 TI2V-5B's VAE, 48 channels, 16x spatial, 4x temporal.
WAN22 = LatentSpace(
    "Wan 2.2",
    "z_dim",
    factors=(
        (0.0119, 0.0103, 0.0046),
        (-0.1062, -0.0504, 0.0165),
        (0.0140, 0.0409, 0.0491),
        (-0.0813, -0.0677, 0.0607),
        (0.0656, 0.0851, 0.0808),
        (0.0264, 0.0463, 0.0912),
        (0.0295, 0.0326, 0.0590),
        (-0.0244, -0.0270, 0.0025),
        (0.0443, -0.0102, 0.0288),
        (-0.0465, -0.0090, -0.0205),
        (0.0359, 0.0236, 0.0082),
        (-0.0776, 0.0854, 0.1048),
        (0.0564, 0.0264, 0.0561),
        (0.0006, 0.0594, 0.0418),
        (-0.0319, -0.0542, -0.0637),
        (-0.0268, 0.0024, 0.0260),
        (0.0539, 0.0265, 0.0358),
        (-0.0359, -0.0312, -0.0287),
        (-0.0285, -0.1032, -0.1237),
        (0.1041, 0.0537, 0.0622),
        (-0.0086, -0.0374, -0.0051),
        (0.0390, 0.0670, 0.2863),
        (0.0069, 0.0144, 0.0082),
        (0.0006, -0.0167, 0.0079),
        (0.0313, -0.0574, -0.0232),
        (-0.1454, -0.0902, -0.0481),
        (0.0714, 0.0827, 0.0447),
        (-0.0304, -0.0574, -0.0196),
        (0.0401, 0.0384, 0.0204),
        (-0.0758, -0.0297, -0.0014),
        (0.0568, 0.1307, 0.1372),
        (-0.0055, -0.0310, -0.0380),
        (0.0239, -0.0305, 0.0325),
        (-0.0663, -0.0673, -0.0140),
        (-0.0416, -0.0047, -0.0023),
        (0.0166, 0.0112, -0.0093),
        (-0.0211, 0.0011, 0.0331),
        (0.1833, 0.1466, 0.2250),
        (-0.0368, 0.0370, 0.0295),
        (-0.3441, -0.3543, -0.2008),
        (-0.0479, -0.0489, -0.0420),
        (-0.0660, -0.0153, 0.0800),
        (-0.0101, 0.0068, 0.0156),
        (-0.0690, -0.0452, -0.0927),
        (-0.0145, 0.0041, 0.0015),
        (0.0421, 0.0451, 0.0373),
        (0.0504, -0.0483, -0.0356),
        (-0.0837, 0.0168, 0.0055),
    ),
    bias=(0.0317, -0.0878, -0.1388),
)

# ComfyUI's LTXV: LTX-Video's VAE, 128 channels, 32x spatial, 8x temporal.
LTXV = LatentSpace(
    "LTX-Video",
    "latent_channels",
    factors=(
        (1.1202e-02, -6.3815e-04, -1.0021e-02),
        (8.6031e-02, 6.5813e-02, 9.5409e-04),
        (-1.2576e-02, -7.5734e-03, -4.0528e-03),
        (9.4063e-03, -2.1688e-03, 2.6093e-03),
        (3.7636e-03, 1.2765e-02, 9.1548e-03),
        (2.1024e-02, -5.2973e-03, 3.4373e-03),
        (-8.8896e-03, -1.9703e-02, -1.8761e-02),
        (-1.3160e-02, -1.0523e-02, 1.9709e-03),
        (-1.5152e-03, -6.9891e-03, -7.5810e-03),
        (-1.7247e-03, 4.6560e-04, -3.3839e-03),
        (1.3617e-02, 4.7077e-03, -2.0045e-03),
        (1.0256e-02, 7.7318e-03, 1.3948e-02),
        (-1.6108e-02, -6.2151e-03, 1.1561e-03),
        (7.3407e-03, 1.5628e-02, 4.4865e-04),
        (9.5357e-04, -2.9518e-03, -1.4760e-02),
        (1.9143e-02, 1.0868e-02, 1.2264e-02),
        (4.4575e-03, 3.6682e-05, -6.8508e-03),
        (-4.5681e-04, 3.2570e-03, 7.7929e-03),
        (3.3902e-02, 3.3405e-02, 3.7454e-02),
        (-2.3001e-02, -2.4877e-03, -3.1033e-03),
        (5.0265e-02, 3.8841e-02, 3.3539e-02),
        (-4.1018e-03, -1.1095e-03, 1.5859e-03),
        (-1.2689e-01, -1.3107e-01, -2.1005e-01),
        (2.6276e-02, 1.4189e-02, -3.5963e-03),
        (-4.8679e-03, 8.8486e-03, 7.8029e-03),
        (-1.6610e-03, -4.8597e-03, -5.2060e-03),
        (-2.1010e-03, 2.3610e-03, 9.3796e-03),
        (-2.2482e-02, -2.1305e-02, -1.5087e-02),
        (-1.5753e-02, -1.0646e-02, -6.5083e-03),
        (-4.6975e-03, 5.0288e-03, -6.7390e-03),
        (1.1951e-02, 2.0712e-02, 1.6191e-02),
        (-6.3704e-03, -8.4827e-03, -9.5483e-03),
        (7.2610e-03, -9.9326e-03, -2.2978e-02),
        (-9.1904e-04, 6.2882e-03, 9.5720e-03),
        (-3.7178e-02, -3.7123e-02, -5.6713e-02),
        (-1.3373e-01, -1.0720e-01, -5.3801e-02),
        (-5.3702e-03, 8.1256e-03, 8.8397e-03),
        (-1.5247e-01, -2.1437e-01, -2.1843e-01),
        (3.1441e-02, 7.0335e-03, -9.7541e-03),
        (2.1528e-03, -8.9817e-03, -2.1023e-02),
        (3.8461e-03, -5.8957e-03, -1.5014e-02),
        (-4.3470e-03, -1.2940e-02, -1.5972e-02),
        (-5.4781e-03, -1.0842e-02, -3.0204e-03),
        (-6.5347e-03, 3.0806e-03, -1.0163e-02),
        (-5.0414e-03, -7.1503e-03, -8.9686e-04),
        (-8.5851e-03, -2.4351e-03, 1.0674e-03),
        (-9.0016e-03, -9.6493e-03, 1.5692e-03),
        (5.0914e-03, 1.2099e-02, 1.9968e-02),
        (1.3758e-02, 1.1669e-02, 8.1958e-03),
        (-1.0518e-02, -1.1575e-02, -4.1307e-03),
        (-2.8410e-02, -3.1266e-02, -2.2149e-02),
        (2.9336e-03, 3.6511e-02, 1.8717e-02),
        (-1.6703e-02, -1.6696e-02, -4.4529e-03),
        (4.8818e-02, 4.0063e-02, 8.7410e-03),
        (-1.5066e-02, -5.7328e-04, 2.9785e-03),
        (-1.7613e-02, -8.1034e-03, 1.3086e-02),
        (-9.2633e-03, 1.0803e-02, -6.3489e-03),
        (3.0851e-03, 4.7750e-04, 1.2347e-02),
        (-2.2785e-02, -2.3043e-02, -2.6005e-02),
        (-2.4787e-02, -1.5389e-02, -2.2104e-02),
        (-2.3572e-02, 1.0544e-03, 1.2361e-02),
        (-7.8915e-03, -1.2271e-03, -6.0968e-03),
        (-1.1478e-02, -1.2543e-03, 6.2679e-03),
        (-5.4229e-02, 2.6644e-02, 6.3394e-03),
        (4.4216e-03, -7.3338e-03, -1.0464e-02),
        (-4.5013e-03, 1.6082e-03, 1.4420e-02),
        (1.3673e-02, 8.8877e-03, 4.1253e-03),
        (-1.0145e-02, 9.0072e-03, 1.5695e-02),
        (-5.6234e-03, 1.1847e-03, 8.1261e-03),
        (-3.7171e-03, -5.3538e-03, 1.2590e-03),
        (2.9476e-02, 2.1424e-02, 3.0424e-02),
        (-3.4925e-02, -2.4340e-02, -2.5316e-02),
        (-3.4127e-02, -2.2406e-02, -1.0589e-02),
        (-1.7342e-02, -1.3249e-02, -1.0719e-02),
        (-2.1478e-03, -8.6051e-03, -2.9878e-03),
        (1.2089e-03, -4.2391e-03, -6.8569e-03),
        (9.0411e-04, -6.6886e-03, -6.7547e-05),
        (1.6048e-02, -1.0057e-02, -2.8929e-02),
        (1.2290e-03, 1.0163e-02, 1.8861e-02),
        (1.7264e-02, 2.7257e-04, 1.3785e-02),
        (-1.3482e-02, -3.6427e-03, 6.7481e-04),
        (4.6782e-03, -5.2423e-03, 2.4467e-03),
        (-5.9113e-03, -6.2244e-03, -1.8162e-03),
        (1.5496e-02, 1.4582e-02, 1.9514e-03),
        (7.4958e-03, 1.5886e-03, -8.2305e-03),
        (1.9086e-02, 1.6360e-03, -3.9674e-03),
        (-5.7021e-03, -2.7307e-03, -4.1066e-03),
        (1.7450e-03, 1.4602e-02, 2.5794e-02),
        (-8.2788e-04, 2.2902e-03, 4.5161e-03),
        (1.1632e-02, 8.9193e-03, -7.2813e-03),
        (7.5721e-03, 2.6784e-03, 1.1393e-02),
        (5.1939e-03, 3.6903e-03, 1.4049e-02),
        (-1.8383e-02, -2.2529e-02, -2.4477e-02),
        (5.8842e-04, -5.7874e-03, -1.4770e-02),
        (-1.6125e-02, -8.6101e-03, -1.4533e-02),
        (2.0540e-02, 2.0729e-02, 6.4338e-03),
        (3.3587e-03, -1.1226e-02, -1.6444e-02),
        (-1.4742e-03, -1.0489e-02, 1.7097e-03),
        (2.8130e-02, 2.3546e-02, 3.2791e-02),
        (-1.8532e-02, -1.2842e-02, -8.7756e-03),
        (-8.0533e-03, -1.0771e-02, -1.7536e-02),
        (-3.9009e-03, 1.6150e-02, 3.3359e-02),
        (-7.4554e-03, -1.4154e-02, -6.1910e-03),
        (3.4734e-03, -1.1370e-02, -1.0581e-02),
        (1.1476e-02, 3.9281e-03, 2.8231e-03),
        (7.1639e-03, -1.4741e-03, -3.8066e-03),
        (2.2250e-03, -8.7552e-03, -9.5719e-03),
        (2.4146e-02, 2.1696e-02, 2.8056e-02),
        (-5.4365e-03, -2.4291e-02, -1.7802e-02),
        (7.4263e-03, 1.0510e-02, 1.2705e-02),
        (6.2669e-03, 6.2658e-03, 1.9211e-02),
        (1.6378e-02, 9.4933e-03, 6.6971e-03),
        (1.7173e-02, 2.3601e-02, 2.3296e-02),
        (-1.4568e-02, -9.8279e-03, -1.1556e-02),
        (1.4431e-02, 1.4430e-02, 6.6362e-03),
        (-6.8230e-03, 1.8863e-02, 1.4555e-02),
        (6.1156e-03, 3.4700e-03, -2.6662e-03),
        (-2.6983e-03, -5.9402e-03, -9.2276e-03),
        (1.0235e-02, 7.4173e-03, -7.6243e-03),
        (-1.3255e-02, 1.9322e-02, -9.2153e-04),
        (2.4222e-03, -4.8039e-03, -1.5759e-02),
        (2.6244e-02, 2.5951e-02, 2.0249e-02),
        (1.5711e-02, 1.8498e-02, 2.7407e-03),
        (-2.1714e-03, 4.7214e-03, -2.2443e-02),
        (-7.4747e-03, 7.4166e-03, 1.4430e-02),
        (-8.3906e-03, -7.9776e-03, 9.7927e-03),
        (3.8321e-02, 9.6622e-03, -1.9268e-02),
        (-1.4605e-02, -6.7032e-03, 3.9675e-03),
    ),
    bias=(-0.0571, -0.1657, -0.2512),
)

SPACES = (WAN21, WAN22, LTXV)
