"""Reading a pipeline's weights as the manifest names them: a diffusers layout (from_pretrained,
safetensors only), one checkpoint file in the original layout (from_single_file with the
manifest's `config` for what the file lacks), and components from their own file (safetensors,
or city96's GGUF through diffusers' GGUF quantizer). Never a pickle: a .ckpt, .pt, .pth or .bin
checkpoint, component or LoRA is refused here as at `kiln manifests check`
(api_client.model_files)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from api_client.manifest import Manifest
from api_client.model_files import ComponentFile, is_single_file, refuse_pickle
from worker.manifest import weights_source


class _NoEmptyFp32List(logging.Filter):
    """from_single_file casts each model with .to(dtype), and diffusers then warns that the
    modules to keep in float32 are [] (none) on every load: noise in a worker's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32: []" not in record.getMessage()


logging.getLogger("diffusers.models.modeling_utils").addFilter(_NoEmptyFp32List())


def refuse_pickles(manifest: Manifest) -> None:
    """PickleRefused for a checkpoint, component or LoRA of manifest that is a pickle: the load
    checks again what the manifest's validation checked (a manifest may come from anywhere)."""
    where = f"model {manifest.id}: "
    try:
        refuse_pickle("source", manifest.source)
        for name, spec in manifest.components.items():
            refuse_pickle(f"components.{name}.file", spec.file)
        for name, lora in manifest.loras.items():
            refuse_pickle(f"loras.{name}.source", lora.source)
            refuse_pickle(f"loras.{name}.weight_name", lora.weight_name)
    except ValueError as exc:
        raise type(exc)(where + str(exc)) from None


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_or_local_file(name: str, models_dir: Path, revision: str | None, what: str) -> Path:
    """A file a manifest names: a path (absolute, or under models_dir), else owner/repo/path on
    the hub, from the cache (never fetched while HF_HUB_OFFLINE is set)."""
    path = Path(name).expanduser()
    path = path if path.is_absolute() else models_dir / path
    if path.is_file():
        return path
    parts = name.split("/")
    if Path(name).is_absolute() or len(parts) < 3:
        raise FileNotFoundError(
            f"{what} {name!r} is no file at {path}, nor owner/repo/file on the hub"
        )
    from huggingface_hub import hf_hub_download

    repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
    return Path(hf_hub_download(repo, filename, revision=revision, local_files_only=offline()))


def hub_file_parts(name: str, models_dir: Path) -> tuple[str, str] | None:
    """(repo, file in it) for a file a manifest names on the hub; None for one on this disk."""
    path = Path(name).expanduser()
    if (path if path.is_absolute() else models_dir / path).is_file():
        return None
    parts = name.split("/")
    if Path(name).is_absolute() or len(parts) < 3:
        return None
    return "/".join(parts[:2]), "/".join(parts[2:])


@dataclass
class ReadWeights:
    """A pipeline as read, and what its component files hold (`{transformer: gguf-Q8_0}`)."""

    pipe: Any
    quantized: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def read_weights(
    pipeline_cls: Any, manifest: Manifest, models_dir: Path, kwargs: dict[str, Any]
) -> ReadWeights:
    """The manifest's pipeline on the host: its components from their own files first, then
    the pipeline around them, from one checkpoint file or a diffusers layout."""
    # 1. Never a pickle.
    refuse_pickles(manifest)
    dtype = kwargs["dtype"]
    read = ReadWeights(pipe=None)
    # 2. Components from their own files, handed to the pipeline's loader ready-made.
    for name, spec in manifest.components.items():
        kwargs[name], held = read_component(pipeline_cls, manifest, name, spec, models_dir, dtype)
        if held is not None:
            read.quantized[name] = held
        read.notes.append(f"{name} from {spec.file} ({held or 'as stored'})")
    # 3. The pipeline: one checkpoint file (with its config), or a diffusers layout.
    if is_single_file(manifest.source):
        path = hub_or_local_file(
            manifest.source, models_dir, manifest.revision, f"model {manifest.id}: source"
        )
        config = weights_source(manifest, models_dir, manifest.config).location
        single = {k: v for k, v in kwargs.items() if k not in ("use_safetensors", "revision")}
        if "text_encoder_2" not in single:
            single.update(_second_clip(path, config, dtype))
        read.pipe = pipeline_cls.from_single_file(
            str(path), config=config, local_files_only=offline(), **single
        )
        _as_from_pretrained(read.pipe)
        read.notes.append(f"one checkpoint file {path.name}, configs from {manifest.config}")
        return read
    source = weights_source(manifest, models_dir)
    if manifest.variant and not source.local:
        kwargs["variant"] = manifest.variant
    read.pipe = pipeline_cls.from_pretrained(source.location, **kwargs)
    return read


SGM_OPEN_CLIP = "conditioner.embedders.1.model."
SD3_CLIP_G = "text_encoders.clip_g.transformer."


def _second_clip(path: Path, config: str, dtype: torch.dtype) -> dict[str, Any]:
    """An SGM file's second text encoder (OpenCLIP-G) or an SD3 file's (CLIP-G), read through
    diffusers' converter for it: diffusers picks a CLIP converter by the encoders' widths, and
    takes CLIP-L's for a model whose two encoders are equally wide (the tiny sdxl's and sd3's).
    {} for other files."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        prefix = next((p for p in (SGM_OPEN_CLIP, SD3_CLIP_G) if _has_prefix(handle, p)), None)
        if prefix is None:
            return {}
        tensors = {k: handle.get_tensor(k) for k in handle.keys() if k.startswith(prefix)}  # noqa: SIM118
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_open_clip_checkpoint,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    text_config = CLIPTextConfig.from_pretrained(
        config, subfolder="text_encoder_2", local_files_only=offline()
    )
    model = CLIPTextModelWithProjection(text_config)
    if prefix == SGM_OPEN_CLIP:
        state = convert_open_clip_checkpoint(model, tensors, prefix=prefix)
    else:
        state = convert_ldm_clip_checkpoint(tensors, prefix)
    model.load_state_dict(state, strict=True)
    encoder: torch.nn.Module = model
    return {"text_encoder_2": encoder.to(dtype=dtype).eval()}


def _has_prefix(handle: Any, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in handle.keys())  # noqa: SIM118


def _as_from_pretrained(pipe: Any) -> None:
    """What from_pretrained leaves and from_single_file does not: every module in eval mode
    (diffusers' T5 reader leaves SD3's T5 training, its dropout on: a prompt's embeddings
    differed run to run), and a T5's token embedding tied (SD3's files hold it twice, shared and
    encoder.embed_tokens; loaded untied it is two tensors, T5-XXL's 32128 x 4096 each)."""
    from transformers import PreTrainedModel

    for component in pipe.components.values():
        if isinstance(component, PreTrainedModel):
            component.tie_weights()
        if isinstance(component, torch.nn.Module):
            component.eval()


def read_component(
    pipeline_cls: Any,
    manifest: Manifest,
    name: str,
    spec: ComponentFile,
    models_dir: Path,
    dtype: torch.dtype,
) -> tuple[Any, str | None]:
    """One component from its own file, as its class's from_single_file reads it (the config
    from the manifest's source or config); and, for GGUF, what its weights are (gguf-Q8_0)."""
    import diffusers

    where = f"model {manifest.id}: components.{name}.file"
    path = hub_or_local_file(spec.file, models_dir, spec.revision, where)
    config_source = manifest.config if is_single_file(manifest.source) else manifest.source
    config = weights_source(manifest, models_dir, config_source).location
    component_cls = getattr(diffusers, _component_class(pipeline_cls, name), None)
    if component_cls is None or not hasattr(component_cls, "from_single_file"):
        raise ValueError(f"{where}: diffusers reads no {name} of this pipeline from one file")
    options: dict[str, Any] = {
        "config": config,
        "subfolder": name,
        "torch_dtype": dtype,
        "local_files_only": offline(),
    }
    checkpoint: Any = str(path)
    held: str | None
    if spec.gguf:
        from diffusers import GGUFQuantizationConfig

        options["quantization_config"] = GGUFQuantizationConfig(compute_dtype=dtype)
        held = f"gguf-{gguf_kind(path)}"
    else:
        held = fp8_kind(path, where)
    if held is not None and name in manifest.quantize:
        raise ValueError(f"{where}: holds {held} weights; drop {name} from quantize")
    if component_cls is diffusers.FluxTransformer2DModel:
        settings = component_cls.load_config(config, subfolder=name, local_files_only=offline())
        checkpoint = bfl_flux_at_width(path, settings)
    model = component_cls.from_single_file(checkpoint, **options)
    if held in FP8_STORAGE:
        # Stored as the file holds it, each layer cast up to the worker's dtype as it runs (what
        # ComfyUI does where the card has no fp8 math): resident at the file's size.
        model.enable_layerwise_casting(storage_dtype=FP8_STORAGE[held], compute_dtype=dtype)
    return model, held


def _component_class(pipeline_cls: Any, name: str) -> str:
    """The class name a pipeline's component is (FluxPipeline's transformer:
    FluxTransformer2DModel), from the pipeline's __init__ annotations."""
    import inspect

    annotation = inspect.signature(pipeline_cls.__init__).parameters[name].annotation
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return str(text).split("|")[0].strip().strip("'\"")


def gguf_kind(path: Path) -> str:
    """The quantization most of a GGUF file's weights hold (Q8_0, Q4_K, ...), from its header."""
    from collections import Counter

    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(path))
    kinds = Counter(
        GGMLQuantizationType(t.tensor_type).name
        for t in reader.tensors
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    )
    return kinds.most_common(1)[0][0] if kinds else "F16"


# What a safetensors component's float8 weights are called in the record, and held as.
FP8_STORAGE: dict[str, torch.dtype] = {
    "fp8-e4m3": torch.float8_e4m3fn,
    "fp8-e5m2": torch.float8_e5m2,
}
_FP8_HEADER = {"F8_E4M3": "fp8-e4m3", "F8_E5M2": "fp8-e5m2"}


def fp8_kind(path: Path, where: str) -> str | None:
    """fp8-e4m3 (or -e5m2) for a safetensors file whose 2-D weights are mostly float8, as
    ComfyUI's fp8 checkpoints are (a plain cast); None for bf16, fp16 or fp32. ComfyUI's
    "scaled" fp8 files, with a scale_weight a layer, are refused: diffusers would load their
    weights without the scales."""
    from collections import Counter

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        names = list(handle.keys())
        kinds = Counter(
            handle.get_slice(k).get_dtype()
            for k in names
            if len(handle.get_slice(k).get_shape()) == 2
        )
    if any(k.endswith(".scale_weight") or k == "scaled_fp8" for k in names):
        raise ValueError(
            f"{where}: {path.name} is a scaled fp8 file (a scale_weight a layer), which diffusers"
            " does not read; use a plain float8_e4m3fn file or the bf16 one"
        )
    kind = kinds.most_common(1)[0][0] if kinds else None
    return _FP8_HEADER.get(kind or "")


# diffusers' BFL converter splits each single block's fused linear1 into q, k, v and the MLP's
# input at FLUX.1's width, hard-coded (single_file_utils.py, convert_flux_transformer_checkpoint_
# to_diffusers: inner_dim = 3072, split_size = (inner_dim, inner_dim, inner_dim, mlp_hidden_dim)).
FLUX1_WIDTH = 3072
FLUX1_LINEAR1_ROWS = 3 * FLUX1_WIDTH + 4 * FLUX1_WIDTH


def bfl_flux_at_width(path: Path, config: dict[str, Any]) -> Any:
    """A FLUX.1 transformer file as from_single_file takes it: the path itself at FLUX.1's width;
    at another (a tiny one), a BFL-layout file converted by diffusers' converter save for the
    single blocks' linear1, which is split here at the config's width and handed to the
    converter as an empty stand-in of FLUX.1's rows."""
    width = int(config["num_attention_heads"] * config["attention_head_dim"])
    if width == FLUX1_WIDTH:
        return str(path)
    from diffusers.loaders.single_file_utils import (
        convert_flux_transformer_checkpoint_to_diffusers,
        load_single_file_checkpoint,
    )

    checkpoint = load_single_file_checkpoint(str(path), local_files_only=True)
    checkpoint = {k.removeprefix("model.diffusion_model."): v for k, v in checkpoint.items()}
    if not any(k.startswith("double_blocks.") for k in checkpoint):
        return checkpoint  # in diffusers' names already
    pieces: dict[str, torch.Tensor] = {}
    for key in [k for k in checkpoint if k.startswith("single_blocks.") and ".linear1." in k]:
        block, kind = f"single_transformer_blocks.{key.split('.')[1]}.", key.rpartition(".")[2]
        fused = checkpoint[key]
        sizes = (width, width, width, fused.shape[0] - 3 * width)
        names = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
        pieces.update(
            dict(zip((f"{block}{n}.{kind}" for n in names), fused.split(sizes), strict=True))
        )
        stand_in = (FLUX1_LINEAR1_ROWS, 0) if fused.ndim == 2 else (FLUX1_LINEAR1_ROWS,)
        checkpoint[key] = torch.empty(stand_in)
    converted: dict[str, torch.Tensor] = convert_flux_transformer_checkpoint_to_diffusers(
        checkpoint
    )
    converted.update(pieces)
    return converted


def lora_layers_in_compute_dtype(denoiser: torch.nn.Module, dtype: torch.dtype) -> None:
    """A denoiser held in fp8 (layerwise casting) with LoRA layers made after the casting: PEFT
    makes each LoRA layer in its base layer's dtype, float8 here, and no hook casts it (diffusers
    hooks the layers it found when the casting was enabled), so its matmul fails ("mul not
    implemented for Float8_e4m3fn"). They are made the worker's dtype; nothing for others."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not any(p.dtype in FP8_STORAGE.values() for p in denoiser.parameters()):
        return
    for module in denoiser.modules():
        if isinstance(module, BaseTunerLayer):
            for layers in (module.lora_A, module.lora_B):
                layers.to(dtype)
