"""Device profiles: the cards kiln can decide as (KILN_DEVICE_PROFILE), so every GPU branch of
the decision code runs in the tests while tensors stay on the real device.

A profile is data only (no torch import): settings validates names against it, and
worker.memory.device turns one into the DeviceInfo the rest of the worker decides with. Memory is
the datasheet capacity in GiB (1024**3 bytes, how the vendors' GB count HBM/GDDR); what a running
worker sees is less by `overhead_gib`: the CUDA/HIP context, library workspaces, and what the
driver keeps back (ECC, reserved). The overheads are kiln's assumption, not measurements, unless
the source line says otherwise; `bench/gpu_check.py` compares a profile with the card it runs on.

A profile name may carry the free memory to simulate: `t4:9.5` is a T4 with 9.5 GiB free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ProfileBackend = Literal["cuda", "rocm", "mps"]
GIB = 1024**3


@dataclass(frozen=True)
class DeviceProfile:
    """What one card offers kiln's decisions, and where each number comes from."""

    name: str
    card: str  # the name a real probe would report
    backend: ProfileBackend
    total_gib: float  # datasheet capacity
    overhead_gib: float  # context, workspaces, driver reserve: total minus this is free at start
    bf16: bool  # native bf16 math (emulation does not count: it is slower than fp16)
    fp16: bool
    fp8: bool  # native fp8 tensor-core math
    capability: tuple[int, int] | None  # CUDA compute capability (HIP reports gfx9.4 as 9.4)
    streams: bool  # copy streams for group offload's prefetch
    compile_default: bool  # KILN_COMPILE=auto compiles at the full rung on this card
    source: str

    @property
    def free_gib(self) -> float:
        return self.total_gib - self.overhead_gib


PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile(
            name="t4",
            card="Tesla T4 (simulated)",
            backend="cuda",
            total_gib=16.0,
            overhead_gib=1.0,
            bf16=False,
            fp16=True,
            fp8=False,
            capability=(7, 5),
            streams=True,
            compile_default=True,
            source=(
                "NVIDIA T4 Tensor Core GPU datasheet (Turing, 16 GB GDDR6, FP16 tensor cores, no"
                " BF16 or FP8 math; bf16 on sm75 is emulated); compute capability 7.5 from NVIDIA's"
                " CUDA GPUs list; 1 GiB overhead assumed (ECC on by default on T4)"
            ),
        ),
        DeviceProfile(
            name="l4",
            card="NVIDIA L4 (simulated)",
            backend="cuda",
            total_gib=24.0,
            overhead_gib=1.0,
            bf16=True,
            fp16=True,
            fp8=True,
            capability=(8, 9),
            streams=True,
            compile_default=True,
            source=(
                "NVIDIA L4 Tensor Core GPU datasheet (Ada Lovelace, 24 GB GDDR6, FP8/BF16/FP16"
                " tensor cores); compute capability 8.9 from NVIDIA's CUDA GPUs list;"
                " 1 GiB overhead assumed"
            ),
        ),
        DeviceProfile(
            name="a100",
            card="NVIDIA A100-SXM4-80GB (simulated)",
            backend="cuda",
            total_gib=80.0,
            overhead_gib=1.0,
            bf16=True,
            fp16=True,
            fp8=False,
            capability=(8, 0),
            streams=True,
            compile_default=True,
            source=(
                "NVIDIA A100 Tensor Core GPU datasheet (Ampere, 80 GB HBM2e SXM4, BF16/FP16 tensor"
                " cores, no FP8); compute capability 8.0 from NVIDIA's CUDA GPUs list;"
                " 1 GiB overhead assumed"
            ),
        ),
        DeviceProfile(
            name="h100",
            card="NVIDIA H100 80GB HBM3 (simulated)",
            backend="cuda",
            total_gib=80.0,
            overhead_gib=1.0,
            bf16=True,
            fp16=True,
            fp8=True,
            capability=(9, 0),
            streams=True,
            compile_default=True,
            source=(
                "NVIDIA H100 Tensor Core GPU datasheet (Hopper, 80 GB HBM3 SXM5, FP8/BF16/FP16"
                " tensor cores); compute capability 9.0 from NVIDIA's CUDA GPUs list;"
                " 1 GiB overhead assumed"
            ),
        ),
        DeviceProfile(
            name="h200",
            card="NVIDIA H200 (simulated)",
            backend="cuda",
            total_gib=141.0,
            overhead_gib=1.5,
            bf16=True,
            fp16=True,
            fp8=True,
            capability=(9, 0),
            streams=True,
            compile_default=True,
            source=(
                "NVIDIA H200 Tensor Core GPU datasheet (Hopper, 141 GB HBM3e, FP8/BF16/FP16 tensor"
                " cores); compute capability 9.0 (same GH100 die as H100); 1.5 GiB overhead"
                " assumed; bench/gpu_check.py prints what a real H200 reports beside it"
            ),
        ),
        DeviceProfile(
            name="mi300",
            card="AMD Instinct MI300X (simulated)",
            backend="rocm",
            total_gib=192.0,
            overhead_gib=2.0,
            bf16=True,
            fp16=True,
            fp8=True,
            capability=(9, 4),
            streams=True,
            compile_default=True,
            source=(
                "AMD Instinct MI300X accelerator datasheet (CDNA 3, 192 GB HBM3, FP8/BF16/FP16"
                " matrix cores); gfx942, which torch on ROCm reports as capability 9.4;"
                " 2 GiB overhead assumed"
            ),
        ),
        DeviceProfile(
            name="mps",
            card="Apple M2 Max, 32 GB unified memory (simulated)",
            backend="mps",
            total_gib=32.0,
            overhead_gib=8.0,
            bf16=True,
            fp16=True,
            fp8=False,
            capability=None,
            streams=False,
            compile_default=True,
            source=(
                "Apple M2 Max technical specifications (32 GB unified memory configuration);"
                " bf16 as kiln's own MPS probe decides it (macOS 14+); 8 GiB kept for macOS and"
                " Metal's working-set limit is kiln's assumption; MPS has no copy streams for"
                " group offload in diffusers"
            ),
        ),
    )
}


def profile_for(card_name: str) -> str | None:
    """The profile of a card by the name torch reports for it (bench/gpu_check.py compares)."""
    upper = card_name.upper()
    for key, name in (("T4", "t4"), ("L4", "l4"), ("A100", "a100"), ("H100", "h100")):
        if key in upper:
            return name
    if "H200" in upper:
        return "h200"
    return "mi300" if "MI300" in upper else None


def parse_profile(value: str) -> tuple[DeviceProfile, float | None]:
    """`name` or `name:FREE_GIB` -> (profile, free GiB override); ValueError teaches the grammar."""
    name, _, free = value.strip().lower().partition(":")
    profile = PROFILES.get(name)
    if profile is None:
        raise ValueError(
            f"unknown device profile {name!r}; expected one of {', '.join(PROFILES)}"
            " (optionally NAME:FREE_GIB, e.g. t4:9.5)"
        )
    if not free:
        return profile, None
    try:
        free_gib = float(free)
    except ValueError:
        raise ValueError(
            f"device profile {value!r}: free memory {free!r} is not a number of GiB"
        ) from None
    if not 0 < free_gib <= profile.total_gib:
        raise ValueError(
            f"device profile {value!r}: free memory must be in (0, {profile.total_gib}] GiB"
        )
    return profile, free_gib
