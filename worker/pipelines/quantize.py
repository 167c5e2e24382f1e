"""torchao weight quantization: which of a manifest's schemes a card gets for each component,
and the quantization of one component, or the reason it cannot run here."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Any

import torch

from api_client.manifest import Manifest
from worker.memory.device import DeviceInfo


def torchao_version() -> str | None:
    """The installed torchao's version if it imports, else None."""
    try:
        import torchao
    except ImportError:
        return None
    return str(getattr(torchao, "__version__", None) or importlib.metadata.version("torchao"))


def weight_summary(module: torch.nn.Module) -> tuple[set[str], int]:
    """Linear weight tensor types in module, and the bytes its parameters hold (quantized too)."""
    kinds: set[str] = set()
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear):
            kinds.add(type(sub.weight).__name__)
    return kinds, sum(_tensor_bytes(p) for p in module.parameters())


def _tensor_bytes(tensor: torch.Tensor) -> int:
    # A torchao weight is a wrapper subclass; its storage lives in the inner tensors it flattens to.
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor.numel() * tensor.element_size()
    names, _ctx = flatten()
    return sum(_tensor_bytes(getattr(tensor, name)) for name in names)


def unsupported_reason(scheme: str, info: DeviceInfo) -> str | None:
    """Why the card (real or simulated) cannot run scheme, or None if its hardware can.

    Decided from DeviceInfo alone, never from torch.cuda: under KILN_DEVICE_PROFILE the
    decisions are the profiled card's while the tensors stay on the real device."""
    if scheme in ("int4", "float8") and info.backend not in ("cuda", "rocm"):
        return f"{scheme} needs a CUDA or ROCm device (torchao kernels); this is {info.backend}"
    if scheme == "float8" and not info.fp8:
        major, minor = info.capability or (0, 0)
        return (
            f"float8 needs fp8 math (compute capability 8.9+, or MI300); {info.name} is"
            f" {major}.{minor}"
        )
    if scheme == "int4" and info.backend == "rocm":
        return "int4 tinygemm kernels are not built for ROCm"
    return None


@dataclass(frozen=True)
class SchemePick:
    """The scheme a component gets on a card (None: none of the manifest's), and why."""

    scheme: str | None
    reason: str


def pick_scheme(schemes: list[str], info: DeviceInfo) -> SchemePick:
    """The first of the manifest's schemes, in its order of preference, that the card runs."""
    passed: list[str] = []
    for scheme in schemes:
        why = unsupported_reason(scheme, info)
        if why is None:
            over = f" (over {'; '.join(passed)})" if passed else ""
            return SchemePick(scheme, f"torchao {scheme} on {info.name}{over}")
        passed.append(f"{scheme}: {why}")
    return SchemePick(None, "; ".join(passed))


def pick_schemes(manifest: Manifest, info: DeviceInfo) -> dict[str, SchemePick]:
    """Every component the manifest quantizes, with the scheme this card gives it."""
    return {c: pick_scheme(list(schemes), info) for c, schemes in manifest.quantize.items()}


def scheme_config(scheme: str) -> Any:
    """The torchao config for scheme. set_inductor_config=False: by default torchao rewrites
    global Inductor settings (coordinate descent tuning, fused int mm) for the whole process,
    which would change every other model's compile in this worker."""
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
    )

    configs = {
        "int8": Int8WeightOnlyConfig,
        "int8_dynamic": Int8DynamicActivationInt8WeightConfig,
        "int4": Int4WeightOnlyConfig,
        "float8": Float8WeightOnlyConfig,
    }
    return configs[scheme](set_inductor_config=False)


def try_scheme(scheme: str, torch_device: str) -> str | None:
    """Quantize a small linear layer on the real device and run it: None when that works, else
    why not (int4 needs a kernel package kiln does not install, float8 a recent card...)."""
    try:
        from torchao.quantization import quantize_
    except ImportError as exc:
        return f"torchao is not importable: {exc}"
    dtype = torch.float32 if torch_device == "cpu" else torch.bfloat16
    layer = torch.nn.Sequential(torch.nn.Linear(256, 256, dtype=dtype)).to(torch_device)
    try:
        quantize_(layer, scheme_config(scheme))
        with torch.inference_mode():
            layer(torch.randn(2, 256, dtype=dtype, device=torch_device))
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"{type(exc).__name__}: {first}"
    return None


def quantize_component(module: torch.nn.Module, scheme: str) -> str | None:
    """Quantize module's linear weights in place (a scheme pick_scheme chose for this card);
    None when applied, else why torchao would not."""
    try:
        from torchao.quantization import quantize_

        config = scheme_config(scheme)
    except ImportError as exc:
        return f"torchao is not importable: {exc}"
    try:
        quantize_(module, config)
    except Exception as exc:  # a scheme torchao refuses is reported, not fatal
        return f"torchao refused {scheme}: {type(exc).__name__}: {exc}"
    return None
