"""torch.compile of the denoiser: regional where the model declares repeated blocks, with a
persistent Inductor cache so a restarted worker does not pay a cold compile again."""

from __future__ import annotations

import importlib
import os

import torch

from worker.settings import Settings

# torch.compile's dynamic=: None marks a dimension dynamic after it first changes (one recompile
# per compiled graph, then no more for new sizes). True, dynamic from the first compile, saved
# that recompile but did not measure better over three sizes (bench/RESULTS.md); the bench sets it.
DYNAMIC: bool | None = None
COMPILED_FORWARD = "_kiln_compiled_forward"  # marks a block whose own forward kiln compiled


def use_persistent_cache(settings: Settings) -> None:
    """TORCHINDUCTOR_CACHE_DIR keeps its usual meaning; kiln only sets a default. Called before
    torchao is imported (worker/serve.py): that import fixes torch's default in the environment."""
    settings.inductor_cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(settings.inductor_cache_dir))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")


def compile_available() -> str | None:
    """Why torch.compile cannot run in this process, or None when it can."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    try:
        importlib.import_module("torch._dynamo")
        importlib.import_module("torch._inductor.config")
    except Exception as exc:  # any import failure means no compile here
        return f"Inductor is not importable: {type(exc).__name__}: {exc}"
    return None


def compile_denoiser(
    denoiser: torch.nn.Module, settings: Settings, method: str = "auto", step_cache: bool = False
) -> str:
    """Wrap the denoiser for torch.compile (lazy: graphs are built at the first forward).

    regional (auto's choice where the denoiser declares repeated blocks) compiles one graph
    per block class, reused by every instance: on the tiny UNet, three sizes' compile took 29 s
    against 157 s whole (bench/RESULTS.md). whole compiles the denoiser as one graph. A model
    with a step cache has each block's own forward compiled instead of its whole call, so the
    cache's hooks wrap compiled code from outside (worker.pipelines.step_cache)."""
    use_persistent_cache(settings)
    blocks = getattr(denoiser, "_repeated_blocks", None)
    name = type(denoiser).__name__
    if method == "regional" and not blocks:
        raise ValueError(f"compile_method regional, but {name} declares no repeated blocks")
    if blocks and method != "whole" and step_cache:
        for module in denoiser.modules():
            if type(module).__name__ in blocks:
                module.forward = torch.compile(module.forward, fullgraph=True, dynamic=DYNAMIC)
                setattr(module, COMPILED_FORWARD, True)
        return (
            f"regional forwards: torch.compile of each repeated {', '.join(blocks)} block's"
            " forward, the step cache's hooks outside them"
        )
    if blocks and method != "whole":
        denoiser.compile_repeated_blocks(fullgraph=True, dynamic=DYNAMIC)  # type: ignore[operator]
        return f"regional: torch.compile of {name}'s repeated {', '.join(blocks)} blocks"
    denoiser.compile(dynamic=DYNAMIC)
    why = "compile_method whole" if blocks else "no repeated blocks declared"
    return f"whole {name}: torch.compile ({why})"


def uncompile_denoiser(denoiser: torch.nn.Module) -> None:
    """Back to eager: nn.Module.compile() only sets _compiled_call_impl; clearing it undoes it,
    and a compiled forward set on a block (step cache models) goes back to the class's."""
    for module in denoiser.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
        if module.__dict__.pop(COMPILED_FORWARD, False):
            del module.forward  # the class's forward again


def graphs_compiled() -> int:
    """Graphs Dynamo has built in this process; the growth across a warm job is its recompiles."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def is_compile_failure(exc: BaseException) -> bool:
    """A Dynamo or Inductor error: lazy compilation surfaces at the first forward, not at wrap."""
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:
        return False
    return isinstance(exc, TorchDynamoException)
