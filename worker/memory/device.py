"""The device kiln renders on: backend, total and free memory, and which dtypes it runs well."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass
from typing import Literal

import psutil
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
    bf16: bool  # native: emulated bf16 (T4, V100) is slower than fp16 and does not count
    fp16: bool
    fp8: bool = False
    capability: tuple[int, int] | None = None  # CUDA compute capability; None off CUDA/ROCm
    streams: bool = False  # copy streams for group offload's prefetch
    compile_default: bool = False  # KILN_COMPILE=auto compiles at the full rung
    # A device profile's name when decisions are made as that card (KILN_DEVICE_PROFILE): then
    # backend and the fields above describe the profile, torch_device the real device.
    simulated: str | None = None

    @property
    def accelerator(self) -> bool:
        """Decisions: whether to decide as an accelerator (also true for a simulated card)."""
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
    """The real device, or with KILN_DEVICE_PROFILE a profile's decisions on the real device."""
    real = probe_real(settings)
    if settings.device_profile is None:
        return real
    return simulate(settings.device_profile, real)


def simulate(value: str, real: DeviceInfo) -> DeviceInfo:
    """Decide as the profiled card would; torch_device stays the real one, so every torch.cuda
    call (keyed off torch_device) still goes to the device that holds the tensors."""
    from worker.profiles import GIB, parse_profile

    profile, free_gib = parse_profile(value)
    total = int(profile.total_gib * GIB)
    return DeviceInfo(
        backend=profile.backend,
        torch_device=real.torch_device,
        name=profile.card,
        total_bytes=total,
        free_bytes=int((free_gib if free_gib is not None else profile.free_gib) * GIB),
        bf16=profile.bf16,
        fp16=profile.fp16,
        fp8=profile.fp8,
        capability=profile.capability,
        streams=profile.streams,
        compile_default=profile.compile_default,
        simulated=profile.name,
    )


def probe_real(settings: Settings) -> DeviceInfo:
    prepare_backend()
    device = pick_torch_device(settings.device)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("KILN_DEVICE=cuda but torch sees no CUDA device")
        index = torch.device(device).index or 0
        _free, total = torch.cuda.mem_get_info(index)
        props = torch.cuda.get_device_properties(index)
        capability = (int(props.major), int(props.minor))
        return DeviceInfo(
            backend="rocm" if torch.version.hip is not None else "cuda",
            torch_device=device,
            name=props.name,
            total_bytes=total,
            free_bytes=_cuda_free_bytes(device),
            # Native only: with emulation counted, a T4 would get slow bf16 instead of fp16.
            bf16=torch.cuda.is_bf16_supported(including_emulation=False),
            fp16=True,
            # fp8 tensor cores: Ada/Hopper (sm89+), CDNA3 (gfx942, which HIP reports as 9.4)
            fp8=capability >= ((9, 4) if torch.version.hip is not None else (8, 9)),
            capability=capability,
            streams=True,
            compile_default=True,
        )
    if device == "mps":
        # MPS shares host memory; bf16 arrived with macOS 14.
        bf16 = bool(torch.backends.mps.is_macos_or_newer(14, 0))
        total = _host_total_bytes()
        return DeviceInfo(
            "mps",
            "mps",
            "Apple MPS",
            total,
            _host_available_bytes(),
            bf16=bf16,
            fp16=True,
            compile_default=True,
        )
    return DeviceInfo(
        "cpu",
        "cpu",
        _cpu_name(),
        _host_total_bytes(),
        _host_available_bytes(),
        bf16=False,
        fp16=False,
    )


def free_bytes(info: DeviceInfo) -> int:
    """Free memory now: on CUDA, mem_get_info plus what torch holds reserved but not allocated.

    A simulated card's free memory is its profile's, fixed; what kiln holds resident is counted
    by the caller (Renderer.usable_gb)."""
    if info.simulated is not None:
        return info.free_bytes
    if info.torch_device.startswith("cuda"):
        return _cuda_free_bytes(info.torch_device)
    return _host_available_bytes()


def _cuda_free_bytes(device: str) -> int:
    # Blocks torch's caching allocator holds but no tensor uses are free to kiln, though the
    # driver counts them as taken.
    free, _total = torch.cuda.mem_get_info(device)
    reserved_idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(reserved_idle, 0))


def allocated_bytes(info: DeviceInfo) -> int:
    """Device memory held in tensors; on CPU torch keeps no count, so the resident set size."""
    if info.torch_device.startswith("cuda"):
        return int(torch.cuda.memory_allocated(info.torch_device))
    if info.torch_device == "mps":
        return int(torch.mps.current_allocated_memory())
    return _process_rss_bytes()


def reset_peak(info: DeviceInfo) -> None:
    if info.torch_device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(info.torch_device)
    elif info.torch_device == "cpu":
        _reset_host_peak()


def peak_bytes(info: DeviceInfo) -> int | None:
    """Peak device memory since reset_peak (CPU: the process's peak resident set, as allocated
    is its resident set); None where neither is tracked (MPS, a kernel without clear_refs)."""
    if info.torch_device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(info.torch_device))
    if info.torch_device == "cpu":
        return _host_peak_bytes()
    return None


_host_peak_reset = False  # whether VmHWM counts from the last reset_peak, not from process start


def _reset_host_peak() -> None:
    # Linux resets VmHWM, the resident set's high-water mark, on a 5 written to clear_refs.
    global _host_peak_reset
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        _host_peak_reset = True
    except OSError:
        _host_peak_reset = False


def _host_peak_bytes() -> int | None:
    if not _host_peak_reset:
        return None
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def synchronize(info: DeviceInfo) -> None:
    """Phase boundaries wait for queued GPU work, so a phase is charged for its own kernels."""
    if info.torch_device.startswith("cuda"):
        torch.cuda.synchronize(info.torch_device)
    elif info.torch_device == "mps":
        torch.mps.synchronize()


def empty_cache(info: DeviceInfo) -> None:
    if info.torch_device.startswith("cuda"):
        torch.cuda.empty_cache()
    elif info.torch_device == "mps":
        torch.mps.empty_cache()
    else:
        _trim_host_heap()


def sdpa_backends(info: DeviceInfo) -> dict[str, bool]:
    """Which fused attention kernels torch may pick for scaled_dot_product_attention here."""
    if not info.torch_device.startswith("cuda"):
        return {"math": True}
    return {
        "flash": bool(torch.backends.cuda.flash_sdp_enabled()),
        "mem_efficient": bool(torch.backends.cuda.mem_efficient_sdp_enabled()),
        "cudnn": bool(torch.backends.cuda.cudnn_sdp_enabled()),
        "math": bool(torch.backends.cuda.math_sdp_enabled()),
    }


def _trim_host_heap() -> None:
    # glibc keeps freed small blocks in its arenas, so without a trim an evicted CPU pipeline
    # would still count against the process's resident size and free memory would look lower.
    if not sys.platform.startswith("linux"):
        return
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        return


def _host_total_bytes() -> int:
    return int(psutil.virtual_memory().total)


def _host_available_bytes() -> int:
    # psutil on every OS: macOS has no SC_AVPHYS_PAGES (os.sysconf raised there), and counting
    # free pages alone would leave out the inactive memory the OS hands back on demand.
    return int(psutil.virtual_memory().available)


def _process_rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "cpu"
