"""The device kiln renders on: backend, total and free memory, and which dtypes it runs well."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from worker.settings import Settings

Backend = Literal["cuda", "rocm", "mps", "cpu"]
GiB = 1024**3


@dataclass(frozen=True)
class DeviceInfo:
    backend: Backend
    torch_device: str  # what .to() takes: "cuda:0", "mps", "cpu"
    name: str
    total_bytes: int
    free_bytes: int  # as measured, before reserve and budget
    bf16: bool
    fp16: bool

    @property
    def accelerator(self) -> bool:
        return self.backend != "cpu"


def pick_torch_device(setting: str) -> str:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        return "cuda:0"
    if setting == "mps" or (setting == "auto" and torch.backends.mps.is_available()):
        return "mps"
    return "cpu"


def prepare_backend() -> None:
    """ROCm gates fused SDPA kernels behind this flag; it must be set before the first SDPA call."""
    if torch.version.hip is not None:
        os.environ.setdefault("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL", "1")


def probe(settings: Settings) -> DeviceInfo:
    prepare_backend()
    device = pick_torch_device(settings.device)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("KILN_DEVICE=cuda but torch sees no CUDA device")
        index = torch.device(device).index or 0
        free, total = torch.cuda.mem_get_info(index)
        props = torch.cuda.get_device_properties(index)
        return DeviceInfo(
            backend="rocm" if torch.version.hip is not None else "cuda",
            torch_device=device,
            name=props.name,
            total_bytes=total,
            free_bytes=free,
            bf16=torch.cuda.is_bf16_supported(),
            fp16=True,
        )
    if device == "mps":
        total = _host_total_bytes()
        return DeviceInfo("mps", "mps", "Apple MPS", total, _host_available_bytes(), bf16=True, fp16=True)
    return DeviceInfo(
        "cpu", "cpu", _cpu_name(), _host_total_bytes(), _host_available_bytes(), bf16=False, fp16=False
    )


def free_bytes(info: DeviceInfo) -> int:
    """Free memory now: on CUDA, mem_get_info plus what torch holds reserved but not allocated."""
    if info.torch_device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(info.torch_device)
        reserved_idle = torch.cuda.memory_reserved(info.torch_device) - torch.cuda.memory_allocated(
            info.torch_device
        )
        return int(free + max(reserved_idle, 0))
    return _host_available_bytes()


def allocated_bytes(info: DeviceInfo) -> int:
    if info.torch_device.startswith("cuda"):
        return int(torch.cuda.memory_allocated(info.torch_device))
    if info.backend == "mps":
        return int(torch.mps.current_allocated_memory())
    return _process_rss_bytes()


def reset_peak(info: DeviceInfo) -> None:
    if info.torch_device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(info.torch_device)


def peak_bytes(info: DeviceInfo) -> int | None:
    """Peak device memory since reset_peak; None where torch does not track it (CPU)."""
    if info.torch_device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(info.torch_device))
    return None


def synchronize(info: DeviceInfo) -> None:
    """Phase boundaries wait for queued GPU work, so a phase is charged for its own kernels."""
    if info.torch_device.startswith("cuda"):
        torch.cuda.synchronize(info.torch_device)
    elif info.backend == "mps":
        torch.mps.synchronize()


def empty_cache(info: DeviceInfo) -> None:
    if info.torch_device.startswith("cuda"):
        torch.cuda.empty_cache()
    elif info.backend == "mps":
        torch.mps.empty_cache()


def _meminfo() -> dict[str, int]:
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


def _host_total_bytes() -> int:
    return _meminfo().get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _host_available_bytes() -> int:
    return _meminfo().get("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _process_rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "cpu"
