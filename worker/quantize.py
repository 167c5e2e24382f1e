"""torchao weight quantization of one pipeline component, or the reason it cannot run here."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

from worker.device import DeviceInfo


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
    if scheme in ("int4", "fp8") and info.backend not in ("cuda", "rocm"):
        return f"{scheme} needs a CUDA device (torchao kernels); this is {info.backend}"
    if scheme == "fp8" and info.backend == "cuda":
        major, minor = info.capability or (0, 0)
        if (major, minor) < (8, 9):
            return f"fp8 needs compute capability 8.9+; {info.name} is {major}.{minor}"
    if scheme == "int4" and info.backend == "rocm":
        return "int4 tinygemm kernels are not built for ROCm"
    return None


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
        "fp8": Float8WeightOnlyConfig,
    }
    return configs[scheme](set_inductor_config=False)


def try_scheme(scheme: str, torch_device: str) -> str | None:
    """Quantize a small linear layer on the real device and run it: None when that works, else
    why not (int4 needs a kernel package kiln does not install, fp8 a recent card...)."""
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


def quantize_component(module: torch.nn.Module, scheme: str, info: DeviceInfo) -> str | None:
    """Quantize module's linear weights in place; return None when applied, else the skip reason."""
    reason = unsupported_reason(scheme, info)
    if reason is not None:
        return reason
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
