"""How the video families (wan, ltx) encode a prompt, what their pipeline call takes beside the
image families' arguments, and how their latents become one video's frames: the functions
worker.pipelines.families names in their specs (encode_<family>, decode_<family>,
call_<family>), kept here because they import torch and diffusers' video helpers
(worker.pipelines.video_decode).

A video job renders one video (api_client.resolve), so a decode returns its frames as one list:
the encode phase (worker.render.renderer) turns them into the container the request names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.pipelines import video_decode

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from worker.pipelines.prompt import Embeds, Prompt

# WanPipeline.__call__ encodes at 512 tokens; its encode_prompt's own default is 226.
WAN_TOKENS = 512


def encode_wan(pipe: Any, device: torch.device, p: Prompt) -> Embeds:
    positive, negative = pipe.encode_prompt(
        prompt=p.text,
        negative_prompt=p.negative or None,
        do_classifier_free_guidance=p.cfg,
        num_videos_per_prompt=p.count,
        device=device,
        **(p.tokens() or {"max_sequence_length": WAN_TOKENS}),
    )
    embeds: Embeds = {"prompt_embeds": positive}
    if p.cfg:
        embeds["negative_prompt_embeds"] = negative
    return embeds


def encode_ltx(pipe: Any, device: torch.device, p: Prompt) -> Embeds:
    """LTX-Video's T5 sequence comes with its attention mask (prompts are padded to its length)."""
    positive, mask, negative, negative_mask = pipe.encode_prompt(
        prompt=p.text,
        negative_prompt=p.negative or None,
        do_classifier_free_guidance=p.cfg,
        num_videos_per_prompt=p.count,
        device=device,
        **p.tokens(),
    )
    embeds: Embeds = {"prompt_embeds": positive, "prompt_attention_mask": mask}
    if p.cfg:
        embeds["negative_prompt_embeds"] = negative
        embeds["negative_prompt_attention_mask"] = negative_mask
    return embeds


def decode_wan(pipe: Any, latents: torch.Tensor, _w: int, _h: int) -> list[Image.Image]:
    return [frame for video in video_decode.decode_wan(pipe, latents) for frame in video]


def decode_ltx(pipe: Any, latents: torch.Tensor, width: int, height: int) -> list[Image.Image]:
    """LTX-Video returns its latents packed into tokens, one per latent cell (its patches are
    1x1x1): the frame count follows from the tokens over the size's cells."""
    spatial = pipe.vae_spatial_compression_ratio
    latent_frames = latents.shape[1] // ((height // spatial) * (width // spatial))
    frames = (latent_frames - 1) * pipe.vae_temporal_compression_ratio + 1
    return [
        frame
        for video in video_decode.decode_ltx(pipe, latents, width, height, frames)
        for frame in video
    ]


def call_wan(frames: int, _fps: int) -> dict[str, Any]:
    return {"num_frames": frames}


def call_ltx(frames: int, fps: int) -> dict[str, Any]:
    """LTX-Video's frame rate is an input of its model (the rotary positions' time scale), not
    only of the container: the job's fps goes in."""
    return {"num_frames": frames, "frame_rate": fps}
