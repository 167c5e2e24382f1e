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
            single.update(_sgm_open_clip(path, config, dtype))
        read.pipe = pipeline_cls.from_single_file(
            str(path), config=config, local_files_only=offline(), **single
        )
        read.notes.append(f"one checkpoint file {path.name}, configs from {manifest.config}")
        return read
    source = weights_source(manifest, models_dir)
    if manifest.variant and not source.local:
        kwargs["variant"] = manifest.variant
    read.pipe = pipeline_cls.from_pretrained(source.location, **kwargs)
    return read


SGM_OPEN_CLIP = "conditioner.embedders.1.model."


def _sgm_open_clip(path: Path, config: str, dtype: torch.dtype) -> dict[str, Any]:
    """An SGM file's second text encoder (OpenCLIP-G), read through diffusers' OpenCLIP
    converter: diffusers picks a CLIP converter by the encoders' widths, and takes CLIP-L's for
    a model whose two encoders are equally wide (the tiny sdxl's). {} for other files."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        names = [k for k in handle.keys() if k.startswith(SGM_OPEN_CLIP)]  # noqa: SIM118
        if not names:
            return {}
        tensors = {k: handle.get_tensor(k) for k in names}
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    text_config = CLIPTextConfig.from_pretrained(
        config, subfolder="text_encoder_2", local_files_only=offline()
    )
    model = CLIPTextModelWithProjection(text_config)
    state = convert_open_clip_checkpoint(model, tensors, prefix=SGM_OPEN_CLIP)
    model.load_state_dict(state, strict=True)
    encoder: torch.nn.Module = model
    return {"text_encoder_2": encoder.to(dtype=dtype).eval()}


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
    held = None
    if spec.gguf:
        from diffusers import GGUFQuantizationConfig

        options["quantization_config"] = GGUFQuantizationConfig(compute_dtype=dtype)
        held = f"gguf-{gguf_kind(path)}"
    return component_cls.from_single_file(str(path), **options), held


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
