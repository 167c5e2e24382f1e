"""Model files as self-hosters have them, as a manifest names them (no torch here): a checkpoint
that is one file (`source` plus `config`), a component from its own file (`components`), and the
rule that no checkpoint, component or LoRA is ever a pickle. The worker's side is
worker.pipelines.single_file."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

# What a Python pickle is saved as: torch.load runs whatever code such a file carries.
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
# A checkpoint in one file: safetensors (LDM, SGM, SD3's or BFL's layout) for a whole pipeline;
# a component may also be city96's GGUF.
SINGLE_FILE_SUFFIXES = (".safetensors",)
COMPONENT_SUFFIXES = (".safetensors", ".gguf")


class PickleRefused(ValueError):
    """A checkpoint, component or LoRA that is a pickle: never loaded."""


def pickle_refusal(field: str, name: str) -> str | None:
    """Why the file named in field is never loaded (a pickle), or None."""
    suffix = next((s for s in PICKLE_SUFFIXES if name.lower().endswith(s)), None)
    if suffix is None:
        return None
    return (
        f"{field} {name!r} is a pickle ({suffix}): loading one runs whatever code it carries"
        " (arbitrary code on load), so kiln never does; convert it to safetensors (load it once"
        " where you trust it and save its state dict with safetensors.torch.save_file) and name"
        " the .safetensors file"
    )


def refuse_pickle(field: str, name: str) -> None:
    """PickleRefused naming field, the file and what to do, for a pickle."""
    why = pickle_refusal(field, name)
    if why is not None:
        raise PickleRefused(why)


def is_single_file(source: str) -> bool:
    """Whether a pipeline's source names one checkpoint file rather than a diffusers layout."""
    return source.lower().endswith(SINGLE_FILE_SUFFIXES)


class ComponentFile(BaseModel):
    """One component from its own file: `components: {transformer: {file, gb}}`. file: a path
    under KILN_MODELS_DIR (or absolute), or owner/repo/path/file on the hub; safetensors (bf16,
    fp16, or fp8 e4m3 as ComfyUI ships it: held in fp8, each layer cast up to the worker's dtype
    as it runs) or GGUF (city96's; diffusers' GGUF quantizer computes in the worker's dtype).
    gb: its size as held."""

    model_config = ConfigDict(extra="forbid")

    file: str = Field(min_length=1)
    gb: float = Field(gt=0)
    revision: str | None = None

    @property
    def gguf(self) -> bool:
        return self.file.lower().endswith(".gguf")


def check_components(components: dict[str, ComponentFile]) -> dict[str, ComponentFile]:
    """Each component's file is safetensors or GGUF, never a pickle."""
    for name, spec in components.items():
        refuse_pickle(f"components.{name}.file", spec.file)
        if not spec.file.lower().endswith(COMPONENT_SUFFIXES):
            raise ValueError(
                f"components.{name}.file {spec.file!r}: must be a .safetensors or .gguf file"
            )
    return components


def weights_refusal(
    source: str,
    config: str | None,
    one_file_family: bool,
    components: dict[str, ComponentFile],
    quantize: Mapping[str, object],
) -> str | None:
    """Why a manifest's weights do not go together, or None: the source and its config, and
    quantize against the components' own files."""
    return source_refusal(source, config, one_file_family) or gguf_quantize_refusal(
        components, quantize
    )


def source_refusal(source: str, config: str | None, one_file_family: bool) -> str | None:
    """Why a pipeline's source and config do not go together, or None: a single file needs the
    config it lacks, a diffusers layout takes none; a pickle is never a source."""
    if one_file_family:
        return None  # an upscaler's one file keeps its own loader (spandrel)
    why = pickle_refusal("source", source)
    if why is not None:
        return why
    if is_single_file(source) and config is None:
        return (
            f"source {source!r} is one checkpoint file: config must name the diffusers repo or"
            " local directory that holds the configs and tokenizers it lacks"
        )
    if config is not None and not is_single_file(source):
        return f"config {config!r} is for a source that is one .safetensors file"
    return None


def gguf_quantize_refusal(
    components: dict[str, ComponentFile], quantize: Mapping[str, object]
) -> str | None:
    """Why quantize may not name a component read from a GGUF file (already quantized: torchao
    would not run on it), or None."""
    both = sorted(name for name, spec in components.items() if spec.gguf and name in quantize)
    if not both:
        return None
    return (
        f"quantize names {', '.join(both)}, read from a GGUF file (components.{both[0]}.file):"
        " a GGUF component is what its file holds; drop it from quantize"
    )
