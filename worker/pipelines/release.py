"""How a pipeline's weights leave the device: offload hooks off, the models beside it dropped,
the allocator's memory given back; or, for the RAM cache, the whole pipeline moved to the host.
PipelineCache (worker.pipelines.resident) calls these as it evicts."""

from __future__ import annotations

import gc
import logging
from typing import Any, Protocol

import torch

from worker.memory import device as dev
from worker.memory.device import DeviceInfo

log = logging.getLogger(__name__)


class Loaded(Protocol):
    """What leaves the device (worker.pipelines.resident.LoadedPipeline)."""

    pipe: Any
    mode_pipes: dict[str, Any]
    controlnets: dict[str, torch.nn.Module]
    reference: torch.nn.Module | None

    @property
    def beside(self) -> list[torch.nn.Module]: ...


def free(loaded: Loaded) -> None:
    """Drop every reference kiln holds to the weights so the allocator can take them back.

    Offload hooks reference their modules (accelerate's hooks and diffusers' group-offload
    registries), so they come off first; the pipeline is not copied back to the host, which
    would cost a full transfer and host memory just to throw the weights away.
    """
    pipe = loaded.pipe
    loaded.pipe = None
    loaded.mode_pipes.clear()  # views of the same modules: dropping them frees nothing else
    drop_beside(loaded)
    if pipe is None:
        return
    remove_hooks(pipe)
    del pipe


def remove_hooks(pipe: Any) -> None:
    """Every offload hook off the pipeline's modules, so they can be placed (or freed) anew."""
    try:
        pipe.remove_all_hooks()
    except Exception:
        log.debug("remove_all_hooks failed", exc_info=True)
    for component in list(pipe.components.values()):
        if isinstance(component, torch.nn.Module):
            _remove_group_offload(component)


def to_host(loaded: Loaded) -> None:
    """Hooks off, every module on the host: what the RAM cache keeps. Its ControlNets and
    IP-Adapter are dropped (read again by the next job that names one), with the control
    pipelines built on them: the cache's bound counts the pipeline alone."""
    remove_hooks(loaded.pipe)
    loaded.pipe.to("cpu")
    drop_beside(loaded)
    loaded.mode_pipes = {k: v for k, v in loaded.mode_pipes.items() if "+control" not in k}


def drop_beside(loaded: Loaded) -> None:
    """The ControlNets and IP-Adapter dropped, hooks off (a later job reads them again)."""
    for module in loaded.beside:
        _remove_group_offload(module)
    loaded.controlnets.clear()
    loaded.reference = None


# diffusers hooks that are the weights' own, not a placement's: an fp8 component's layerwise
# casting (diffusers refuses to take it off: "does not support deinitialization") and PEFT's
# beside it. They stay through every rung change and eviction.
KEPT_HOOKS = ("layerwise_casting", "peft_autocast_disable")


def _remove_group_offload(module: torch.nn.Module) -> None:
    from diffusers.hooks import HookRegistry

    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        if isinstance(registry, HookRegistry):
            for name in [n for n in registry.hooks if n not in KEPT_HOOKS]:
                registry.remove_hook(name, recurse=False)


def release_memory(info: DeviceInfo) -> None:
    gc.collect()
    dev.empty_cache(info)
