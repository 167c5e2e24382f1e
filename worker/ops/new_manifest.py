"""`kiln manifests new FILE`: a manifest written from a downloaded model file. Reads the file's
header only (a safetensors file's JSON header, a GGUF file's tensor table through the `gguf`
package's reader; never a pickle), tells its family from tensor names and shapes, and writes
`<out>/<id>.yaml` with the family's defaults (from the shipped manifests of that family) and the
sizes the file implies, checked like any manifest.

What a file is, by its tensor names:
- LDM (sd15, sd2): model.diffusion_model.input_blocks..., first_stage_model..., and
  cond_stage_model.transformer.text_model... (CLIP-L: sd15) or cond_stage_model.model...
  (OpenCLIP-H: sd2); the cross-attention width confirms it (768 / 1024);
- SGM (sdxl): conditioner.embedders.1... (the second text encoder);
- SD3: model.diffusion_model.joint_blocks...;
- BFL (flux): double_blocks... with or without model.diffusion_model.; alone it is the
  transformer, a component file (GGUF or safetensors) over the family's diffusers repo; so is
  a transformer in diffusers' names (single_transformer_blocks..., x_embedder)."""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api_client.families import FAMILIES, family_row
from api_client.manifest import Manifest, ManifestInvalid, load_manifest_dir, load_manifest_file
from api_client.model_files import refuse_pickle

# A real file over a tiny template (sd15 ships no real manifest): the tiny pipelines render at a
# quarter of their family's native size.
TINY_SCALE = 4
TINY_PARAMS = 20_000_000  # a denoiser below this is a tiny test model's
# Tensor-name prefix -> component, per layout (the first that matches).
COMPONENTS = {
    "model.diffusion_model.": "denoiser",
    "first_stage_model.": "vae",
    "cond_stage_model.": "text_encoder",
    "conditioner.embedders.0.": "text_encoder",
    "conditioner.embedders.1.": "text_encoder_2",
    "text_encoders.clip_l.": "text_encoder",
    "text_encoders.clip_g.": "text_encoder_2",
    "text_encoders.t5xxl.": "text_encoder_3",
}
# What a GGUF tensor's bytes are per element where the header gives no byte count.
_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1}


class NewManifestError(ValueError):
    """A file kiln cannot write a manifest for; the message says why and what to pass."""


@dataclass
class FileHeader:
    """A model file's tensors as its header lists them: name -> (shape, bytes)."""

    path: Path
    tensors: dict[str, tuple[tuple[int, ...], int]]
    # What most weights are held as: GGUF's type (Q8_0, Q4_K, ...) or fp8 (fp8-e4m3).
    quant: str | None = None
    sizes: dict[str, float] = field(default_factory=dict)  # component -> GB as stored


def read_header(path: Path) -> FileHeader:
    """The tensor names, shapes and sizes of a .safetensors or .gguf file; never unpickles."""
    refuse_pickle("FILE", str(path))
    if path.suffix.lower() == ".gguf":
        return _gguf_header(path)
    if path.suffix.lower() != ".safetensors":
        raise NewManifestError(f"FILE {str(path)!r}: must be a .safetensors or .gguf file")
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > 100_000_000:
            raise NewManifestError(f"FILE {str(path)!r}: no safetensors header ({length} bytes)")
        header = json.loads(handle.read(length))
    entries = {name: info for name, info in header.items() if name != "__metadata__"}
    tensors = {
        name: (tuple(info["shape"]), info["data_offsets"][1] - info["data_offsets"][0])
        for name, info in entries.items()
    }
    # An fp8 checkpoint (ComfyUI's) holds its weight matrices in float8: what the file holds,
    # as a GGUF file's type is, so the manifest quantizes it no further.
    kinds = Counter(info["dtype"] for info in entries.values() if len(info["shape"]) == 2)
    held = kinds.most_common(1)[0][0] if kinds else None
    return FileHeader(path, tensors, {"F8_E4M3": "fp8-e4m3", "F8_E5M2": "fp8-e5m2"}.get(held or ""))


def _gguf_header(path: Path) -> FileHeader:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors: dict[str, tuple[tuple[int, ...], int]] = {}
    kinds: Counter[str] = Counter()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        # gguf lists shapes innermost first; torch's order is the reverse.
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        size = int(tensor.n_bytes) or int(tensor.n_elements) * _BYTES.get(kind, 2)
        tensors[tensor.name] = (shape, size)
        if kind not in ("F32", "F16", "BF16"):
            kinds[kind] += 1
    quant = kinds.most_common(1)[0][0] if kinds else None
    return FileHeader(path, tensors, quant)


def tell_family(header: FileHeader) -> tuple[str, bool]:
    """(family, whether the file is a whole pipeline rather than one component); or
    NewManifestError saying which families it could be and asking for --family."""
    names = header.tensors

    def has(prefix: str) -> bool:
        return any(n.startswith(prefix) for n in names)

    if has("conditioner.embedders.1."):
        return "sdxl", True
    if has("model.diffusion_model.joint_blocks."):
        return "sd3", True
    if has("double_blocks.") or has("model.diffusion_model.double_blocks."):
        return "flux", has("first_stage_model.")
    if has("single_transformer_blocks.") and "x_embedder.weight" in names:
        return "flux", False  # a FluxTransformer2DModel in diffusers' own names
    if has("model.diffusion_model.input_blocks."):
        clip_l = has("cond_stage_model.transformer.")
        open_clip = has("cond_stage_model.model.")
        width = _cross_attention_width(names)
        if clip_l and width != 1024:
            return "sd15", True
        if open_clip and width != 768:
            return "sd2", True
        raise NewManifestError(
            f"FILE {header.path.name}: an LDM UNet (sd15 or sd2) whose text encoder and"
            f" cross-attention width ({width}) do not tell which: pass --family sd15 or sd2"
        )
    raise NewManifestError(
        f"FILE {header.path.name}: its tensor names match none of sd15, sd2 (LDM), sdxl (SGM),"
        f" sd3 or flux (BFL) (first: {next(iter(names), 'none')}); pass --family"
    )


def _cross_attention_width(names: dict[str, tuple[tuple[int, ...], int]]) -> int | None:
    for name, (shape, _) in names.items():
        if name.endswith("attn2.to_k.weight") and len(shape) == 2:
            return shape[1]
    return None


def component_sizes(header: FileHeader, denoiser: str, whole: bool) -> dict[str, float]:
    """GB each component of the file holds as stored (a component file: all of it the
    denoiser's)."""
    sizes: dict[str, float] = {}
    for name, (_, size) in header.tensors.items():
        part = next((c for p, c in COMPONENTS.items() if name.startswith(p)), None)
        part = denoiser if part in (None, "denoiser") or not whole else part
        sizes[part] = sizes.get(part, 0.0) + size / 1e9
    return sizes


def new_manifest(
    path: Path,
    manifest_dirs: Any,
    models_dir: Path,
    out: Path,
    *,
    model_id: str | None = None,
    family: str | None = None,
    config: str | None = None,
) -> Path:
    """Write and check `<out>/<id>.yaml` for the model file at path; its path."""
    # 1. The file's header, and what it is.
    header = read_header(path)
    try:
        told, whole = tell_family(header)
    except NewManifestError:
        if family is None:
            raise
        told, whole = family, any(n.startswith("first_stage_model.") for n in header.tensors)
    family = family or told
    # 2. The family's defaults, and the sizes this file implies.
    tiny = sum(_params(s) for s in header.tensors.values()) < TINY_PARAMS
    template = _template(manifest_dirs, family, tiny, _guided(header))
    from worker.pipelines.families import spec_for

    denoiser = spec_for(template).denoiser
    sizes = component_sizes(header, denoiser, whole)
    data = _fields(template, header, sizes, denoiser, whole, tiny)
    model_id = model_id or re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-._")
    data["id"] = model_id
    # 3. Where its weights are: the file (under KILN_MODELS_DIR when it is there), and the
    # diffusers repo or directory with what the file lacks.
    where = str(path.resolve())
    if path.resolve().is_relative_to(models_dir.resolve()):
        where = str(path.resolve().relative_to(models_dir.resolve()))
    repo = config or template.config or template.source
    if whole:
        data["source"], data["config"] = where, repo
    else:
        data["source"] = repo
        data["components"] = {
            denoiser: {"file": where, "gb": max(round(sizes[denoiser], 4), 0.0001)}
        }
    # 4. Written beside, checked, then put in place.
    return _write_checked(out, model_id, path, header, data)


def _params(entry: tuple[tuple[int, ...], int]) -> int:
    count = 1
    for n in entry[0]:
        count *= n
    return count


def _guided(header: FileHeader) -> bool | None:
    """Whether a FLUX.1-style transformer embeds guidance (dev) or not (schnell); None for a
    file whose denoiser has no such switch."""
    names = header.tensors
    if not any(n.startswith(("time_in.", "time_text_embed.")) for n in names):
        return None
    return any("guidance_in." in n or "guidance_embedder." in n for n in names)


def _template(manifest_dirs: Any, family: str, tiny: bool, guided: bool | None) -> Manifest:
    """The shipped manifest of the family whose defaults the file takes: its tiny one for a tiny
    file; else the first real one by id that is no edit model (and embeds guidance as the file
    does), else the tiny one."""
    if family not in FAMILIES:
        raise NewManifestError(f"--family {family!r}: must be one of {', '.join(FAMILIES)}")
    manifests, _ = load_manifest_dir(manifest_dirs)
    row = family_row(family)
    mine = [m for _, m in sorted(manifests.items()) if m.family_row is row]
    tinies = [m for m in mine if m.id.startswith("tiny-") and "edit" not in m.modes]
    real = [m for m in mine if m not in tinies and "edit" not in m.modes and not m.benchmark_only]
    if guided is not None:
        real = [m for m in real if (m.guidance.default > 0) is guided]
    found = (tinies if tiny else real + tinies) or real + tinies
    if not found or row.weights_files:
        raise NewManifestError(f"--family {family}: no shipped manifest to take defaults from")
    return found[0]


def _fields(
    template: Manifest,
    header: FileHeader,
    sizes: dict[str, float],
    denoiser: str,
    whole: bool,
    tiny: bool,
) -> dict[str, Any]:
    """The template's request-side defaults; the memory figures from the file's sizes."""
    keep = {"family", "dtype", "scheduler", "steps", "guidance", "true_cfg", "resolutions"}
    keep |= {"max_sequence_length", "modes", "compile", "compile_method", "optimizations"}
    data = template.model_dump(mode="json", include=keep, exclude_none=True)
    if template.id.startswith("tiny-") and not tiny:
        data["resolutions"] = [[w * TINY_SCALE, h * TINY_SCALE] for w, h in template.resolutions]
    parts = dict(template.component_gb)
    for part, gb in sizes.items():
        parts[part] = max(round(gb, 4), 0.0001)
    if parts:
        data["component_gb"] = parts
    if not whole and header.quant is None and template.quantize:
        data["quantize"] = {c: s for c, s in template.quantize.items() if c in parts}
    if header.quant is not None and template.quantize:  # a GGUF file is what it holds
        data["quantize"] = {c: s for c, s in template.quantize.items() if c != denoiser}
    total = sum(parts.values()) if parts else sum(sizes.values())
    largest = max(parts.values()) if parts else total
    data["min_vram_gb"] = round(max(0.1, total * 1.3), 2)  # weights, plus a third for the work
    data["rung_vram_gb"] = {
        "model_offload": round(max(0.05, largest * 1.3), 2),
        "group_offload": round(max(0.02, largest * 0.3), 2),
    }
    return {k: data[k] for k in ("family", *sorted(set(data) - {"family"})) if data[k] != {}}


def _write_checked(
    out: Path, model_id: str, path: Path, header: FileHeader, data: dict[str, Any]
) -> Path:
    import tempfile

    import yaml

    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{model_id}.yaml"
    if target.exists():
        raise NewManifestError(f"{target} exists; pass another --id or --out")
    what = f" ({header.quant})" if header.quant else ""
    text = f"# Written by `kiln manifests new {path.name}`{what}: check its defaults.\n"
    ordered = {"id": data.pop("id"), "family": data.pop("family"), **data}
    text += yaml.safe_dump(ordered, sort_keys=False, default_flow_style=None, width=100)
    # Checked under its own name (the id must equal the file stem) before it is put in place.
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        draft = Path(scratch) / target.name
        draft.write_text(text, encoding="utf-8")
        try:
            load_manifest_file(draft)
        except ManifestInvalid as exc:
            raise NewManifestError(str(exc)) from None
        draft.rename(target)
    return target
