"""Tiny random-weight sd15, sdxl and sd3 pipelines built from configs with local tokenizers.

They are kiln's embedded default models: saved as ordinary diffusers directories so they load
through the same from_pretrained path as hub models, with no hub access at build or load time.
Over 300 lines because most of it is the three families' model configs, written out.
"""

from __future__ import annotations

import json
import shutil
import string
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final, TypeVar

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderTiny,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    PNDMScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)
from transformers.utils import logging as transformers_logging

TINY_FAMILIES: tuple[str, ...] = ("sd15", "sdxl", "sd3")

_T = TypeVar("_T")

# Bump whenever a config, tokenizer or seed below changes: existing builds are then replaced.
BUILDER_VERSION: Final = 2  # 2: a tiny TAESD in <pipeline>/taesd for previews
STAMP_FILE: Final = "kiln_tiny.json"

# Real CLIP and the pipelines' default prompt length; the positional table must cover it.
CLIP_MAX_LENGTH: Final = 77
# StableDiffusion3Pipeline's default max_sequence_length for the T5 prompt.
T5_MAX_LENGTH: Final = 256

# Hidden sizes shared by the components that must agree with each other.
CLIP_HIDDEN: Final = 32
CLIP_PROJECTION: Final = 32
T5_HIDDEN: Final = 64
# Four VAE levels give the real 8x downscale, so 128 px images use 16x16 latents.
VAE_CHANNELS: Final = (8, 16, 16, 16)
VAE_GROUPS: Final = 8
LATENT_SIZE: Final = 16


def build_tiny_models(
    out_dir: Path, families: Iterable[str] = TINY_FAMILIES, *, force: bool = False
) -> dict[str, Path]:
    """Build tiny-<family> pipelines under out_dir (out_dir/tiny-sd15 ...).

    Skips a pipeline whose dir already has a model_index.json and a matching builder version
    stamp unless force. Returns {"tiny-sd15": path, ...}.
    """
    wanted = list(families)
    unknown = [f for f in wanted if f not in _BUILDERS]
    if unknown:
        raise ValueError(f"families: unknown {unknown!r}; must be among {list(TINY_FAMILIES)!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    built: dict[str, Path] = {}
    for family in wanted:
        name = f"tiny-{family}"
        target = out_dir / name
        if force or not is_current(target):
            _build_into(target, family, force=force)
        built[name] = target
    return built


def is_current(path: Path) -> bool:
    """Whether path holds a complete pipeline stamped by this BUILDER_VERSION."""
    stamp = path / STAMP_FILE
    if not (path / "model_index.json").is_file() or not stamp.is_file():
        return False
    try:
        version = json.loads(stamp.read_text(encoding="utf-8")).get("builder_version")
    except (OSError, ValueError, AttributeError):
        return False
    return bool(version == BUILDER_VERSION)


def _build_into(target: Path, family: str, *, force: bool) -> None:
    # Build beside the target and rename, so readers never see a half-written pipeline.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    try:
        pipe = _BUILDERS[family]()
        taesd = _seeded(40, lambda: _taesd(*TAESD_LATENTS[family]))
        with _quiet_progress_bars():
            pipe.save_pretrained(tmp, safe_serialization=True)
            taesd.save_pretrained(tmp / "taesd", safe_serialization=True)
        _drop_config_key(tmp / "taesd" / "config.json", "block_out_channels")
        stamp = {"builder_version": BUILDER_VERSION, "family": family}
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
        # A concurrent builder may have finished first; keep its copy so readers are not cut off.
        if force or not is_current(target):
            _swap_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_into_place(new: Path, target: Path) -> None:
    # A directory cannot be renamed over a non-empty one, so the old build is moved aside first.
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
    if target.exists():
        target.rename(old)
    try:
        new.rename(target)
    except OSError:
        # Another builder won the race; its pipeline is as good as ours if it is current.
        if not is_current(target):
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    # transformers draws a "Writing model shards" bar per text encoder; in a worker log that is
    # noise. The switch is process-wide, so the caller's setting is put back afterwards.
    was_enabled = transformers_logging.is_progress_bar_enabled()
    # transformers leaves these two switches unannotated.
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _seeded(seed: int, make: Callable[[], _T]) -> _T:
    # Fork the RNG so building never disturbs the caller's global torch random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


# Tokenizers


def _clip_tokenizer() -> CLIPTokenizer:
    # Real CLIP's vocab layout without merges: the 256 byte-level symbols, the same symbols with
    # the "</w>" end-of-word suffix CLIPTokenizer always applies, then the two specials. Without
    # the suffixed half every word's last byte would become <|endoftext|> (the unk token).
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    symbols = [*alphabet, *(f"{c}</w>" for c in alphabet), "<|startoftext|>", "<|endoftext|>"]
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


_T5_WORDS: Final = """
a an the of and or in on at to with from by for as is are be this that it its his her their
photo photograph picture image painting drawing sketch render illustration portrait landscape
close up wide shot view detailed highly realistic cinematic lighting light dark night day
sunset sunrise morning evening sky cloud clouds sun moon star stars rain snow fog mist storm
city street road house building tower castle bridge river lake sea ocean beach mountain hill
forest tree trees flower flowers garden field grass desert island space planet
man woman person people girl boy child old young face eyes hair hand hands smile
cat cats dog dogs bird birds horse fish dragon robot car ship boat train plane
red orange yellow green blue purple pink black white gray grey brown gold golden silver
big small large tiny little tall long short bright soft sharp blurry beautiful cute
style art artist digital oil watercolor anime cartoon pixel 3d 4k 8k hd quality best
in front behind under over above below next inside outside near far
standing sitting walking running flying holding wearing looking reading playing
"""


def _t5_tokenizer() -> T5Tokenizer:
    # T5's id layout (<pad>=0, </s>=1, <unk>=2 are fixed by T5Tokenizer), then pieces whose
    # scores make whole words beat their spellings; unknown characters (emoji, CJK) become <unk>
    # as they do with the real SentencePiece vocab.
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [(c, -8.0) for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += [(f"▁{c}", -7.0) for c in string.ascii_lowercase + string.digits]
    known = {p for p, _ in pieces}
    pieces += [(f"▁{w}", -4.0) for w in dict.fromkeys(_T5_WORDS.split()) if f"▁{w}" not in known]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


# Components


def _clip_config(vocab_size: int, hidden_act: str) -> CLIPTextConfig:
    # Specials sit at the top of the vocab; pad is eos as in SD's CLIP tokenizer, and the text
    # model pools at the first eos_token_id, so the ids must be the tokenizer's.
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=CLIP_HIDDEN,
        intermediate_size=37,
        projection_dim=CLIP_PROJECTION,
        num_hidden_layers=5,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act=hidden_act,
        layer_norm_eps=1e-5,
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )


# (latent channels, scaling, shift) as the family's TAESD expects: sd15/sdxl TAESDs read the
# denoiser's latents as they are; SD3's mirrors its VAE's scale and shift.
TAESD_LATENTS: Final = {"sd15": (4, 1.0, 0.0), "sdxl": (4, 1.0, 0.0), "sd3": (16, 1.5035, 0.0609)}


def _drop_config_key(path: Path, key: str) -> None:
    # AutoencoderTiny records block_out_channels in its config but does not take it back,
    # warning on every load; TAESD's published configs do not carry it either.
    config = json.loads(path.read_text(encoding="utf-8"))
    config.pop(key, None)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _taesd(latent_channels: int, scaling_factor: float, shift_factor: float) -> AutoencoderTiny:
    """An AutoencoderTiny with TAESD's layout (8x, four levels) but a few channels a level."""
    return AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        num_encoder_blocks=(1, 1, 1, 1),
        num_decoder_blocks=(1, 1, 1, 1),
        latent_channels=latent_channels,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )


def _vae(
    latent_channels: int, scaling_factor: float, shift_factor: float | None = None
) -> AutoencoderKL:
    # SD3's VAE drops the quant convs and adds a shift; sd15/sdxl keep them.
    flow = shift_factor is not None
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_CHANNELS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_CHANNELS),
        block_out_channels=VAE_CHANNELS,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=VAE_GROUPS,
        sample_size=LATENT_SIZE * 8,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=not flow,
        use_post_quant_conv=not flow,
    )


def _sd15() -> StableDiffusionPipeline:
    tokenizer = _clip_tokenizer()
    unet = _seeded(
        1,
        lambda: UNet2DConditionModel(
            sample_size=LATENT_SIZE,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=CLIP_HIDDEN,
            attention_head_dim=8,
            norm_num_groups=8,
        ),
    )
    text_encoder = _seeded(2, lambda: CLIPTextModel(_clip_config(len(tokenizer), "quick_gelu")))
    vae = _seeded(3, lambda: _vae(latent_channels=4, scaling_factor=0.18215))
    # SD 1.5's own scheduler config (PNDM with PLMS only).
    scheduler = PNDMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        skip_prk_steps=True,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _sdxl() -> StableDiffusionXLPipeline:
    tokenizer = _clip_tokenizer()
    time_embed_dim = 8
    unet = _seeded(
        11,
        lambda: UNet2DConditionModel(
            sample_size=LATENT_SIZE,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            # The two encoders' hidden states are concatenated for cross-attention.
            cross_attention_dim=2 * CLIP_HIDDEN,
            addition_embed_type="text_time",
            addition_time_embed_dim=time_embed_dim,
            # Six micro-conditioning ids (original size, crop, target size) plus the pooled text.
            projection_class_embeddings_input_dim=6 * time_embed_dim + CLIP_PROJECTION,
            norm_num_groups=8,
        ),
    )
    text_encoder = _seeded(12, lambda: CLIPTextModel(_clip_config(len(tokenizer), "quick_gelu")))
    text_encoder_2 = _seeded(
        13, lambda: CLIPTextModelWithProjection(_clip_config(len(tokenizer), "gelu"))
    )
    vae = _seeded(14, lambda: _vae(latent_channels=4, scaling_factor=0.13025))
    # SDXL base's own scheduler config.
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=_clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )


def _sd3() -> StableDiffusion3Pipeline:
    tokenizer = _clip_tokenizer()
    tokenizer_3 = _t5_tokenizer()
    transformer = _seeded(
        21,
        lambda: SD3Transformer2DModel(
            sample_size=LATENT_SIZE,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            # Context tokens are CLIP states zero-padded to T5's width, then T5 states.
            joint_attention_dim=T5_HIDDEN,
            # Pooled prompt is the two CLIP projections concatenated.
            pooled_projection_dim=2 * CLIP_PROJECTION,
        ),
    )
    text_encoder = _seeded(
        22, lambda: CLIPTextModelWithProjection(_clip_config(len(tokenizer), "quick_gelu"))
    )
    text_encoder_2 = _seeded(
        23, lambda: CLIPTextModelWithProjection(_clip_config(len(tokenizer), "gelu"))
    )
    t5_config = T5Config(
        vocab_size=len(tokenizer_3),
        d_model=T5_HIDDEN,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer_3.pad_token_id,
        eos_token_id=tokenizer_3.eos_token_id,
    )
    text_encoder_3 = _seeded(24, lambda: T5EncoderModel(t5_config))
    vae = _seeded(25, lambda: _vae(latent_channels=16, scaling_factor=1.5035, shift_factor=0.0609))
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


_BUILDERS: Final[dict[str, Callable[[], DiffusionPipeline]]] = {
    "sd15": _sd15,
    "sdxl": _sdxl,
    "sd3": _sd3,
}
