"""torchao weight quantization of one pipeline component, or the reason it cannot run here."""

from __future__ import annotations

import importlib.metadata

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
    """Why this stack cannot run scheme on this device, or None if it can."""
    if scheme in ("int4", "fp8") and not info.torch_device.startswith("cuda"):
        return f"{scheme} needs a CUDA device (torchao kernels); this is {info.backend}"
    if scheme == "fp8" and info.backend == "cuda":
        major, minor = torch.cuda.get_device_capability(info.torch_device)
        if (major, minor) < (8, 9):
            return f"fp8 needs compute capability 8.9+; {info.name} is {major}.{minor}"
    if scheme == "int4" and info.backend == "rocm":
        return "int4 tinygemm kernels are not built for ROCm"
    return None


def quantize_component(module: torch.nn.Module, scheme: str, info: DeviceInfo) -> str | None:
    """Quantize module's linear weights in place; return None when applied, else the skip reason."""
    reason = unsupported_reason(scheme, info)
    if reason is not None:
        return reason
    try:
        from torchao.quantization import (
            Float8WeightOnlyConfig,
            Int4WeightOnlyConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
            quantize_,
        )
    except ImportError as exc:
        return f"torchao is not importable: {exc}"
    configs = {
        "int8": Int8WeightOnlyConfig,
        "int8_dynamic": Int8DynamicActivationInt8WeightConfig,
        "int4": Int4WeightOnlyConfig,
        "fp8": Float8WeightOnlyConfig,
    }
    try:
        quantize_(module, configs[scheme]())
    except Exception as exc:  # a scheme torchao refuses is reported, not fatal
        return f"torchao refused {scheme}: {type(exc).__name__}: {exc}"
    return None
