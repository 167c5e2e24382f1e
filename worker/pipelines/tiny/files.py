"""The tiny pipelines' weights as self-hosters' files hold them, converted from the same tensors,
so a test can hold each loader to the pixels of the diffusers-layout pipeline it came from:

- <tiny-sd15>/loras/tiny-sd15-lora-kohya.safetensors: the `detail` LoRA in kohya / A1111 key
  names (lora_unet_<module path, dots as underscores>.lora_down/.lora_up/.alpha);
- tiny-sd15.safetensors beside <tiny-sd15>: the whole pipeline in one LDM-layout file;
- tiny-sdxl.safetensors beside <tiny-sdxl>: the whole pipeline in one SGM-layout file;
- tiny-sd3.safetensors beside <tiny-sd3>: the whole pipeline in one file, SD3's layout;
- <tiny-flux>/tiny-flux-transformer-Q8_0.gguf: the transformer in diffusers' names, Q8_0;
- <tiny-flux>/tiny-flux-transformer.safetensors: the transformer in BFL's layout, as stored;
- <tiny-flux>/tiny-flux-transformer-fp8-e4m3.safetensors: the same in float8 e4m3.

diffusers ships the original-to-diffusers direction only; the layouts' tables here are the
inverse, ported from diffusers' scripts/convert_diffusers_to_original_stable_diffusion.py and
convert_diffusers_to_original_sdxl.py, and for SD3 and FLUX.1 read backwards from
diffusers.loaders.single_file_utils' converters. Over 400 lines because each layout's table is
one such inverse, and they read best side by side."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import load_file, save_file

KOHYA_LORA: Final = "tiny-sd15-lora-kohya.safetensors"
KOHYA_FROM: Final = "detail"  # the tiny PEFT LoRA the kohya file is converted from
GGUF_TRANSFORMER: Final = "tiny-flux-transformer-Q8_0.gguf"
BFL_TRANSFORMER: Final = "tiny-flux-transformer.safetensors"
FP8_TRANSFORMER: Final = "tiny-flux-transformer-fp8-e4m3.safetensors"


def save_model_files(directory: Path, lora_weight_name: str) -> None:
    """Write a tiny pipeline's files as self-hosters hold them into its directory, converted
    from what save_pretrained and the LoRA builder wrote there (never the pipeline in memory,
    which the LoRA builder leaves wrapped)."""
    index = json.loads((directory / "model_index.json").read_text(encoding="utf-8"))
    pipeline = index["_class_name"]
    if pipeline == "StableDiffusionPipeline":
        peft_file = directory / "loras" / KOHYA_FROM / lora_weight_name
        kohya_lora(peft_file, directory / "loras" / KOHYA_LORA)
    if pipeline == "FluxPipeline":
        gguf_transformer(directory / "transformer", directory / GGUF_TRANSFORMER)
        save_file(bfl_flux_file(directory), directory / BFL_TRANSFORMER)
        save_file(bfl_flux_fp8_file(directory), directory / FP8_TRANSFORMER)
    if pipeline in SINGLE_FILES:
        # Beside the pipeline's directory, not in it (a tiny pipeline stays under 10 MB): written
        # under a dot name and renamed, so a reader never sees half a file.
        name, layout = SINGLE_FILES[pipeline]
        part = directory.parent / f".{name}.{os.getpid()}.part"
        try:
            save_file(layout(directory), part)
            os.replace(part, directory.parent / name)
        finally:
            part.unlink(missing_ok=True)


def kohya_lora(peft_file: Path, out: Path) -> None:
    """A diffusers / PEFT LoRA of a UNet (unet.<module>.lora_A/lora_B.weight) in kohya's key
    names: lora_unet_<module with dots as underscores>.lora_down (A), .lora_up (B) and .alpha,
    set to the rank so that kohya's scale alpha/rank is PEFT's lora_alpha/r (both 1 here)."""
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(peft_file).items():
        module, _, part = key.removeprefix("unet.").rpartition(".lora_")
        name = "lora_unet_" + module.replace(".", "_")
        if part == "A.weight":
            tensors[f"{name}.lora_down.weight"] = tensor
            tensors[f"{name}.alpha"] = torch.tensor(float(tensor.shape[0]))
        elif part == "B.weight":
            tensors[f"{name}.lora_up.weight"] = tensor
        else:
            raise ValueError(f"{peft_file}: {key} is no lora_A / lora_B weight of a UNet")
    save_file(tensors, out, metadata={"ss_network_module": "networks.lora"})


def _weights(directory: Path, component: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A saved component's tensors and config."""
    folder = directory / component
    weights = next(folder.glob("*.safetensors"))
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return load_file(weights), config


def ldm_file(directory: Path) -> dict[str, torch.Tensor]:
    """An SD1.5 pipeline in one LDM-layout file: the UNet under model.diffusion_model., the
    VAE under first_stage_model., CLIP-L under cond_stage_model.transformer."""
    unet, unet_config = _weights(directory, "unet")
    vae, vae_config = _weights(directory, "vae")
    text, _ = _weights(directory, "text_encoder")
    return {
        **_prefixed("model.diffusion_model.", unet_to_ldm(unet, unet_config)),
        **_prefixed("first_stage_model.", vae_to_ldm(vae, vae_config)),
        **_prefixed("cond_stage_model.transformer.", _text_model(text)),
    }


def ldm_openclip_file(directory: Path) -> dict[str, torch.Tensor]:
    """An SD 2.x pipeline in one LDM-layout file: as SD1.5's, with its OpenCLIP-H text encoder
    under cond_stage_model.model. (q, k and v in one in_proj). OpenCLIP's text_projection, which
    SD 2.x never uses (its diffusers text encoder has none), is written as the identity: diffusers
    reads the encoder's width from its rows (convert_open_clip_checkpoint)."""
    unet, unet_config = _weights(directory, "unet")
    vae, vae_config = _weights(directory, "vae")
    text = _text_model(_weights(directory, "text_encoder")[0])
    width = text["text_model.final_layer_norm.weight"].shape[0]
    text["text_projection.weight"] = torch.eye(width)
    return {
        **_prefixed("model.diffusion_model.", unet_to_ldm(unet, unet_config)),
        **_prefixed("first_stage_model.", vae_to_ldm(vae, vae_config)),
        **_prefixed("cond_stage_model.model.", clip_to_openclip(text)),
    }


def sgm_file(directory: Path) -> dict[str, torch.Tensor]:
    """An SDXL pipeline in one SGM-layout file: as LDM's, with CLIP-L under
    conditioner.embedders.0.transformer. and OpenCLIP-G under conditioner.embedders.1.model."""
    unet, unet_config = _weights(directory, "unet")
    vae, vae_config = _weights(directory, "vae")
    text, _ = _weights(directory, "text_encoder")
    text_2, _ = _weights(directory, "text_encoder_2")
    return {
        **_prefixed("model.diffusion_model.", unet_to_ldm(unet, unet_config)),
        **_prefixed("first_stage_model.", vae_to_ldm(vae, vae_config)),
        **_prefixed("conditioner.embedders.0.transformer.", _text_model(text)),
        **_prefixed("conditioner.embedders.1.model.", clip_to_openclip(text_2)),
    }


def _text_model(text: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CLIP text model's keys as the original files hold them, under text_model. (transformers
    5.6+ saves a CLIPTextModel flattened, without it); a projection beside it, as it is."""
    kept = ("text_model.", "text_projection.")
    return {k if k.startswith(kept) else f"text_model.{k}": v for k, v in text.items()}


def _prefixed(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v.contiguous().clone() for k, v in tensors.items()}


def _renamed(
    tensors: dict[str, torch.Tensor], prefixes: dict[str, str], inner: dict[str, str]
) -> dict[str, torch.Tensor]:
    """Each key's longest matching diffusers prefix replaced by its original one; inner renames
    (a resnet's layers) apply inside the prefixes whose original name they are listed for."""
    out = {}
    for key, tensor in tensors.items():
        prefix = max((p for p in prefixes if key.startswith(p)), key=len, default="")
        rest = key[len(prefix) :]
        if ".resnets." in prefix:
            for new, old in inner.items():
                rest = rest.replace(new, old)
        out[prefixes.get(prefix, "") + rest] = tensor
    return out


UNET_LAYERS = {
    "time_embedding.linear_1.": "time_embed.0.",
    "time_embedding.linear_2.": "time_embed.2.",
    "add_embedding.linear_1.": "label_emb.0.0.",
    "add_embedding.linear_2.": "label_emb.0.2.",
    "conv_in.": "input_blocks.0.0.",
    "conv_norm_out.": "out.0.",
    "conv_out.": "out.2.",
    "mid_block.resnets.0.": "middle_block.0.",
    "mid_block.attentions.0.": "middle_block.1.",
    "mid_block.resnets.1.": "middle_block.2.",
}
UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}


def unet_to_ldm(unet: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A diffusers UNet2DConditionModel's keys in the original (LDM / SGM) names: input_blocks
    count each down block's resnets and its downsampler, output_blocks each up block's resnets,
    the upsampler after the attention where the block has one."""
    per = config["layers_per_block"] + 1
    prefixes = dict(UNET_LAYERS)
    for i in range(len(config["block_out_channels"])):
        for j in range(per - 1):
            prefixes[f"down_blocks.{i}.resnets.{j}."] = f"input_blocks.{1 + i * per + j}.0."
            prefixes[f"down_blocks.{i}.attentions.{j}."] = f"input_blocks.{1 + i * per + j}.1."
        prefixes[f"down_blocks.{i}.downsamplers.0.conv."] = f"input_blocks.{(i + 1) * per}.0.op."
        attention = any(k.startswith(f"up_blocks.{i}.attentions.") for k in unet)
        for j in range(per):
            prefixes[f"up_blocks.{i}.resnets.{j}."] = f"output_blocks.{i * per + j}.0."
            prefixes[f"up_blocks.{i}.attentions.{j}."] = f"output_blocks.{i * per + j}.1."
        where = f"output_blocks.{i * per + per - 1}.{2 if attention else 1}.conv."
        prefixes[f"up_blocks.{i}.upsamplers.0.conv."] = where
    return _renamed(unet, prefixes, UNET_RESNET)


def vae_to_ldm(vae: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An AutoencoderKL's keys in LDM's names: the decoder's up blocks numbered the other way,
    the mid attention's linear layers as 1x1 convolutions."""
    count = len(config["block_out_channels"])
    prefixes = {
        "encoder.conv_norm_out.": "encoder.norm_out.",
        "decoder.conv_norm_out.": "decoder.norm_out.",
    }
    for i in range(count):
        for j in range(config["layers_per_block"] + 1):
            prefixes[f"encoder.down_blocks.{i}.resnets.{j}."] = f"encoder.down.{i}.block.{j}."
            prefixes[f"decoder.up_blocks.{i}.resnets.{j}."] = (
                f"decoder.up.{count - 1 - i}.block.{j}."
            )
        prefixes[f"encoder.down_blocks.{i}.downsamplers.0.conv."] = (
            f"encoder.down.{i}.downsample.conv."
        )
        prefixes[f"decoder.up_blocks.{i}.upsamplers.0.conv."] = (
            f"decoder.up.{count - 1 - i}.upsample.conv."
        )
    for part in ("encoder", "decoder"):
        for k in range(2):
            prefixes[f"{part}.mid_block.resnets.{k}."] = f"{part}.mid.block_{k + 1}."
        prefixes[f"{part}.mid_block.attentions.0."] = f"{part}.mid.attn_1."
    out = _renamed(vae, prefixes, {"conv_shortcut": "nin_shortcut"})
    attention = {
        "group_norm.": "norm.",
        "to_q.": "q.",
        "to_k.": "k.",
        "to_v.": "v.",
        "to_out.0.": "proj_out.",
    }
    for key in [k for k in out if ".mid.attn_1." in k]:
        head, _, tail = key.partition(".mid.attn_1.")
        for new, old in attention.items():
            tail = tail.replace(new, old, 1) if tail.startswith(new) else tail
        tensor = out.pop(key)
        out[f"{head}.mid.attn_1.{tail}"] = tensor[:, :, None, None] if tensor.ndim == 2 else tensor
    return out


OPENCLIP = {
    "text_model.encoder.layers.": "transformer.resblocks.",
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    ".fc1.": ".c_fc.",
    ".fc2.": ".c_proj.",
    ".self_attn.out_proj.": ".attn.out_proj.",
}


def clip_to_openclip(text: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers CLIPTextModelWithProjection in OpenCLIP's names, as SGM holds SDXL's second
    text encoder: q, k and v in one in_proj, the projection transposed."""
    out: dict[str, torch.Tensor] = {
        "token_embedding.weight": text["text_model.embeddings.token_embedding.weight"],
        "positional_embedding": text["text_model.embeddings.position_embedding.weight"],
        "ln_final.weight": text["text_model.final_layer_norm.weight"],
        "ln_final.bias": text["text_model.final_layer_norm.bias"],
        "text_projection": text["text_projection.weight"].T,
    }
    for key, tensor in text.items():
        if not key.startswith("text_model.encoder.layers.") or ".self_attn.k_proj." in key:
            continue
        if ".self_attn.v_proj." in key:
            continue
        if ".self_attn.q_proj." in key:
            kind = key.rpartition(".")[2]
            stem = key.partition(".self_attn.")[0]
            parts = [text[f"{stem}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
            key, tensor = f"{stem}.attn.in_proj_{kind}", torch.cat(parts)
        for new, old in OPENCLIP.items():
            key = key.replace(new, old)
        out[key] = tensor
    return out


def gguf_transformer(folder: Path, out: Path) -> None:
    """A FluxTransformer2DModel as city96's GGUF files hold one: its 2-D weights in Q8_0 (blocks
    of 32 along a row), biases and norms in F32. The keys are diffusers' own, not BFL's:
    diffusers' BFL converter splits the single blocks' fused linear1 at FLUX.1's width (3072,
    hard-coded), so a tiny BFL-layout transformer could not be read back; a file in diffusers'
    names is loaded as it is (single_file_model._should_convert_state_dict_to_diffusers)."""
    import gguf

    quant = gguf.GGMLQuantizationType.Q8_0
    writer = gguf.GGUFWriter(str(out), "flux")
    for name, tensor in sorted(load_file(next(folder.glob("*.safetensors"))).items()):
        array = tensor.float().numpy()
        if array.ndim == 2 and array.shape[-1] % 32 == 0:
            writer.add_tensor(name, gguf.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def sd3_file(directory: Path) -> dict[str, torch.Tensor]:
    """An SD3 pipeline in one file as stabilityai's sd3.5_medium.safetensors holds it: the MMDiT
    under model.diffusion_model. (SD3's own names), the VAE under first_stage_model. (LDM's), the
    text encoders under text_encoders.clip_l / clip_g / t5xxl.transformer. (transformers')."""
    transformer, transformer_config = _weights(directory, "transformer")
    vae, vae_config = _weights(directory, "vae")
    encoders = {
        "clip_l": _text_model(_weights(directory, "text_encoder")[0]),
        "clip_g": _text_model(_weights(directory, "text_encoder_2")[0]),
        "t5xxl": _t5_embeddings(_weights(directory, "text_encoder_3")[0]),
    }
    tensors = {
        **_prefixed("model.diffusion_model.", mmdit_to_sd3(transformer, transformer_config)),
        **_prefixed("first_stage_model.", vae_to_ldm(vae, vae_config)),
    }
    for name, encoder in encoders.items():
        tensors.update(_prefixed(f"text_encoders.{name}.transformer.", encoder))
    return tensors


def _t5_embeddings(t5: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """T5's token embedding under both its names, as SD3's files hold it (transformers saves
    the tied encoder.embed_tokens once, as shared; diffusers' T5 reader ties nothing)."""
    return {"encoder.embed_tokens.weight": t5["shared.weight"], **t5}


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """The original AdaLayerNormContinuous splits its projection (shift, scale), diffusers'
    (scale, shift): diffusers' converters swap the halves, which is its own inverse."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first])


def _fuse(
    tensors: dict[str, torch.Tensor], parts: tuple[str, ...], into: str
) -> dict[str, torch.Tensor]:
    """One original layer's weight and bias from diffusers' separate layers (q, k, v, ...),
    concatenated along the output rows in the order given."""
    fused = {}
    for kind in ("weight", "bias"):
        if f"{parts[0]}.{kind}" in tensors:
            fused[f"{into}.{kind}"] = torch.cat([tensors[f"{p}.{kind}"] for p in parts])
    return fused


def _layers(
    tensors: dict[str, torch.Tensor], names: dict[str, str], prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Each listed diffusers layer (under prefix) that the model has, under its original name:
    its weight, bias or RMSNorm scale."""
    out = {}
    for new, old in names.items():
        for key in (k for k in tensors if k.startswith(f"{prefix}{new}.")):
            out[old + key[len(prefix + new) :]] = tensors[key]
    return out


SD3_LAYERS: Final = {
    "pos_embed.proj": "x_embedder.proj",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "context_embedder": "context_embedder",
    "proj_out": "final_layer.linear",
}
SD3_BLOCK: Final = {
    "attn.norm_q": "x_block.attn.ln_q",
    "attn.norm_k": "x_block.attn.ln_k",
    "attn.norm_added_q": "context_block.attn.ln_q",
    "attn.norm_added_k": "context_block.attn.ln_k",
    "attn.to_out.0": "x_block.attn.proj",
    "attn.to_add_out": "context_block.attn.proj",
    "attn2.norm_q": "x_block.attn2.ln_q",
    "attn2.norm_k": "x_block.attn2.ln_k",
    "attn2.to_out.0": "x_block.attn2.proj",
    "norm1.linear": "x_block.adaLN_modulation.1",
    "ff.net.0.proj": "x_block.mlp.fc1",
    "ff.net.2": "x_block.mlp.fc2",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
}


def mmdit_to_sd3(mmdit: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An SD3Transformer2DModel in SD3's original names (joint_blocks.N.x_block / context_block,
    q, k and v in one qkv), the inverse of diffusers' convert_sd3_transformer_checkpoint_to_
    diffusers: the last block's context modulation and the final one have their halves swapped."""
    out = {"pos_embed": mmdit["pos_embed.pos_embed"], **_layers(mmdit, SD3_LAYERS)}
    out["final_layer.adaLN_modulation.1.weight"] = _swap_halves(mmdit["norm_out.linear.weight"])
    out["final_layer.adaLN_modulation.1.bias"] = _swap_halves(mmdit["norm_out.linear.bias"])
    last = config["num_layers"] - 1
    for i in range(config["num_layers"]):
        block, joint = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        fused = {
            "x_block.attn.qkv": tuple(f"{block}attn.to_{p}" for p in "qkv"),
            "context_block.attn.qkv": tuple(f"{block}attn.add_{p}_proj" for p in "qkv"),
            "x_block.attn2.qkv": tuple(f"{block}attn2.to_{p}" for p in "qkv"),
        }
        for into, parts in fused.items():
            if f"{parts[0]}.weight" in mmdit:
                out.update(_fuse(mmdit, parts, joint + into))
        names = {k: joint + v for k, v in SD3_BLOCK.items()}
        out.update(_layers(mmdit, names, block))
        context = {
            f"{joint}context_block.adaLN_modulation.1.{kind}": mmdit[
                f"{block}norm1_context.linear.{kind}"
            ]
            for kind in ("weight", "bias")
        }
        if i == last:
            context = {k: _swap_halves(v) for k, v in context.items()}
        out.update(context)
    return out


def bfl_flux_file(directory: Path) -> dict[str, torch.Tensor]:
    """tiny-flux's transformer as BFL's flux1-dev.safetensors holds FLUX.1's, stored as saved."""
    transformer, config = _weights(directory, "transformer")
    return flux_to_bfl(transformer, config)


def bfl_flux_fp8_file(directory: Path) -> dict[str, torch.Tensor]:
    """The same in float8 e4m3, as ComfyUI's fp8 FLUX.1 files hold it (a plain cast, no
    per-tensor scales): the layers' 2-D weights in float8_e4m3fn, biases and norms in bf16."""
    return {
        k: v.to(torch.float8_e4m3fn if v.ndim == 2 else torch.bfloat16)
        for k, v in bfl_flux_file(directory).items()
    }


FLUX_LAYERS: Final = {
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "context_embedder": "txt_in",
    "x_embedder": "img_in",
    "proj_out": "final_layer.linear",
}
FLUX_DOUBLE: Final = {
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
}
FLUX_SINGLE: Final = {
    "norm.linear": "modulation.lin",
    "attn.norm_q": "norm.query_norm",
    "attn.norm_k": "norm.key_norm",
    "proj_out": "linear2",
}


def flux_to_bfl(flux: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A FluxTransformer2DModel in BFL's names (double_blocks, single_blocks, img_in, txt_in,
    ...), the inverse of diffusers' convert_flux_transformer_checkpoint_to_diffusers: q, k and v
    in one qkv, a single block's q, k, v and MLP input in one linear1, RMSNorm weights as
    .scale, the final modulation's halves swapped."""
    out = _layers(flux, FLUX_LAYERS)
    out["final_layer.adaLN_modulation.1.weight"] = _swap_halves(flux["norm_out.linear.weight"])
    out["final_layer.adaLN_modulation.1.bias"] = _swap_halves(flux["norm_out.linear.bias"])
    for i in range(config["num_layers"]):
        block, double = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for side, layer in (("img", "to_{}"), ("txt", "add_{}_proj")):
            layers = tuple(f"{block}attn.{layer.format(p)}" for p in "qkv")
            out.update(_fuse(flux, layers, f"{double}{side}_attn.qkv"))
        out.update(_layers(flux, {k: double + v for k, v in FLUX_DOUBLE.items()}, block))
    for i in range(config["num_single_layers"]):
        block, single = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        parts = (*(f"{block}attn.to_{p}" for p in "qkv"), f"{block}proj_mlp")
        out.update(_fuse(flux, parts, f"{single}linear1"))
        out.update(_layers(flux, {k: single + v for k, v in FLUX_SINGLE.items()}, block))
    return {_norm_scale(k): v for k, v in out.items()}


def _norm_scale(key: str) -> str:
    """BFL's RMSNorm holds its weight as .scale."""
    return key.removesuffix(".weight") + ".scale" if key.endswith("_norm.weight") else key


SINGLE_FILES: Final = {
    "StableDiffusionPipeline": ("tiny-sd15.safetensors", ldm_file),
    "StableDiffusionXLPipeline": ("tiny-sdxl.safetensors", sgm_file),
    "StableDiffusion3Pipeline": ("tiny-sd3.safetensors", sd3_file),
}
