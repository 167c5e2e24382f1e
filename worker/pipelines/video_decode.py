"""Video latents to frames: what the Wan and LTX-Video pipelines do after their last step, for a
render worker that denoises with output_type="latent" and decodes on its own.

Each follows its pipeline's __call__ (diffusers 0.42: pipeline_wan.py, pipeline_wan_i2v.py,
pipeline_ltx.py, pipeline_ltx_image2video.py) step for step, so a decode here gives the
pipeline's own frames for the real models (Wan 2.1, Wan 2.2, LTX-Video) as for the tiny ones.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.utils.torch_utils import get_module_execution_device, randn_tensor
from PIL import Image


@torch.no_grad()
def decode_wan(pipe: Any, latents: torch.Tensor) -> list[list[Image.Image]]:
    """One list of frames per video, from a WanPipeline's or WanImageToVideoPipeline's latents
    ([B, z_dim, F, H, W], normalised; image-to-video has already put the image's first frame in).

    The VAE's config carries the per-channel mean and std (Wan 2.1's 16, Wan 2.2's 48)."""
    vae = pipe.vae
    latents = latents.to(get_module_execution_device(vae), vae.dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape)
    # Divided by the inverse, as the pipelines do, so the frames are theirs to the last bit.
    latents = latents / inverse_std.to(latents.device, latents.dtype) + mean
    video = vae.decode(latents, return_dict=False)[0]
    return _frames(pipe, video)


@torch.no_grad()
def decode_ltx(
    pipe: Any,
    latents: torch.Tensor,
    width: int,
    height: int,
    frames: int,
    *,
    decode_timestep: float = 0.0,
    decode_noise_scale: float | None = None,
    generator: torch.Generator | None = None,
) -> list[list[Image.Image]]:
    """One list of frames per video, from an LTXPipeline's or LTXImageToVideoPipeline's packed
    latents ([B, tokens, channels]) of a width x height, frames-long render, or from
    LTXConditionPipeline's (LTX-Video 0.9.5 on), which it returns unpacked ([B, C, F, H, W]).

    A VAE with timestep_conditioning (LTX-Video 0.9.1 and later) decodes at decode_timestep
    after mixing in decode_noise_scale of fresh noise (decode_timestep's value when None), as
    the pipeline's call of the same arguments does; that noise comes from generator, so the
    generator the denoising used, passed on in the state it was left in, gives the pipeline's
    own frames."""
    vae = pipe.vae
    if latents.ndim == 3:
        latents = pipe._unpack_latents(
            latents,
            (frames - 1) // pipe.vae_temporal_compression_ratio + 1,
            height // pipe.vae_spatial_compression_ratio,
            width // pipe.vae_spatial_compression_ratio,
            pipe.transformer_spatial_patch_size,
            pipe.transformer_temporal_patch_size,
        )
    latents = pipe._denormalize_latents(
        latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
    )
    latents = latents.to(get_module_execution_device(vae), vae.dtype)
    timestep = None
    if vae.config.timestep_conditioning:
        latents, timestep = _noised(latents, decode_timestep, decode_noise_scale, generator)
    video = vae.decode(latents, timestep, return_dict=False)[0]
    return _frames(pipe, video)


def _noised(
    latents: torch.Tensor,
    decode_timestep: float,
    decode_noise_scale: float | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LTX-Video's latents with decode_noise_scale of fresh noise mixed in, and the decoder's
    timestep for each video."""
    noise = randn_tensor(
        latents.shape, generator=generator, device=latents.device, dtype=latents.dtype
    )
    count = latents.shape[0]
    noise_scale = decode_timestep if decode_noise_scale is None else decode_noise_scale
    scale = torch.tensor([noise_scale] * count, device=latents.device, dtype=latents.dtype)
    timestep = torch.tensor([decode_timestep] * count, device=latents.device, dtype=latents.dtype)
    scale = scale[:, None, None, None, None]
    return (1 - scale) * latents + scale * noise, timestep


def _frames(pipe: Any, video: torch.Tensor) -> list[list[Image.Image]]:
    frames: list[list[Image.Image]] = pipe.video_processor.postprocess_video(
        video, output_type="pil"
    )
    return frames
