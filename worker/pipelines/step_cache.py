"""Step caches: diffusers' First Block Cache on the resident denoiser, for the jobs that use one.

Per job, decide() says whether it runs: the request's true or false, else the step_cache switch
(the manifest's optimizations over KILN_STEP_CACHE) against the manifest's step_cache and its
min_steps. A job that uses it enables the cache on the denoiser for its denoise and removes it
after (StepCache), so every job starts from a clean denoiser, cached or not.

Under compile. The cache's hooks replace each block's forward with Python that decides, each
step, whether to run the block at all; the decision is a torch.compiler.disable'd function. A
regional compile of each block's whole call (compile_repeated_blocks) inlines the hooks and
fails ("Skip inlining torch.compiler.disable()d function"). So for a model that declares a step
cache kiln compiles each repeated block's own forward (worker.pipelines.compile), and the hooks
wrap the compiled forwards from outside: the decision stays eager, the blocks stay compiled, one
graph per block class serves every instance, and jobs with and without the cache run the same
graphs: no recompile when the switch flips (tests/test_step_cache.py).

Cache contexts. The hooks keep one state per context ("cond", "uncond"), which the pipeline names
around each denoiser pass. FluxPipeline, Flux2KleinPipeline and the Qwen-Image pipelines do;
FLUX.1's img2img, inpaint and Kontext pipelines do not (diffusers#12760). For those kiln names
it from a hook on the denoiser: a step's first pass is "cond", its second (true CFG) "uncond".
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch

from api_client.manifest import NO_STEP_CACHE, Manifest, StepCacheSpec
from api_client.schema import RenderRequest, StepCacheReport
from worker.errors import PinRefused
from worker.settings import Settings

PASSES = ("cond", "uncond")  # a step's denoiser passes, in the order the pipelines run them


@dataclass(frozen=True)
class StepCacheDecision:
    """Whether this job runs its model's step cache (spec set), and why, as a settings note."""

    kind: Literal["applied", "skipped"]
    reason: str
    spec: StepCacheSpec | None = None


def decide(manifest: Manifest, settings: Settings, request: RenderRequest) -> StepCacheDecision:
    """The step cache for one job. A request's true is a pin: a worker whose switch is off
    refuses the job naming why (PinRefused), as it does a compile pin it cannot honour."""
    spec, asked = manifest.step_cache, request.step_cache
    if spec is None:
        why = NO_STEP_CACHE.get(manifest.family, f"model {manifest.id} declares no step_cache")
        return StepCacheDecision("skipped", why)
    if asked is False:
        return StepCacheDecision("skipped", "the request asks for every step (step_cache: false)")
    value = manifest.optimizations.get("step_cache", settings.step_cache)
    if value == "off" and asked:
        raise PinRefused(
            f"model {manifest.id}: the request asks for a step cache (step_cache: true), but"
            " this worker's step_cache switch is off (KILN_STEP_CACHE=off or the manifest)"
        )
    if value == "off":
        return StepCacheDecision("skipped", "switched off")
    applied = f"{spec.kind}, threshold {spec.threshold:g}"
    if asked:
        return StepCacheDecision("applied", f"{applied}: asked for (step_cache: true)", spec)
    if value == "on":
        return StepCacheDecision("applied", f"{applied}: switched on", spec)
    steps, least = int(request.steps or 0), spec.auto_min_steps
    if steps < least:
        why = f"auto: {steps} steps, under min_steps {least}: few steps have little to reuse"
        return StepCacheDecision("skipped", why)
    why = f"{applied}: auto, {steps} steps >= min_steps {least}"
    return StepCacheDecision("applied", why, spec)


_NAMES_CONTEXTS: dict[type, bool] = {}


def names_its_contexts(pipeline_class: type) -> bool:
    """Whether the pipeline's own call names the cache context around each denoiser pass."""
    if pipeline_class not in _NAMES_CONTEXTS:
        try:
            source = inspect.getsource(pipeline_class.__call__)
        except (OSError, TypeError):
            source = ""
        _NAMES_CONTEXTS[pipeline_class] = "cache_context(" in source
    return _NAMES_CONTEXTS[pipeline_class]


class StepCache(AbstractContextManager["StepCache"]):
    """One job's First Block Cache on the denoiser: enabled on entry, counted while it runs,
    removed on exit (whatever ends the denoise). step_ended() is called at each step's end, so
    the passes of the next step are named in order where the pipeline names none."""

    def __init__(self, denoiser: torch.nn.Module, spec: StepCacheSpec, pipe: Any) -> None:
        self.denoiser, self.spec = denoiser, spec
        self.name_passes = not names_its_contexts(type(pipe))
        self.decisions: Counter[tuple[str, bool]] = Counter()
        self._passes = 0
        self._open: AbstractContextManager[Any] | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> StepCache:
        from diffusers.hooks import FirstBlockCacheConfig

        self.denoiser.enable_cache(FirstBlockCacheConfig(threshold=self.spec.threshold))  # type: ignore[operator]
        try:
            self._count(_head_hook(self.denoiser))
            if self.name_passes:
                self._handles = [
                    self.denoiser.register_forward_pre_hook(self._enter_pass),
                    self.denoiser.register_forward_hook(self._leave_pass, always_call=True),
                ]
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._remove()

    def step_ended(self) -> None:
        self._passes = 0

    def report(self) -> StepCacheReport:
        """Decisions in the first pass of each step (the conditional one)."""
        return StepCacheReport(
            kind=self.spec.kind,
            params=self.spec.params,
            steps_computed=self.decisions[(PASSES[0], True)],
            steps_reused=self.decisions[(PASSES[0], False)],
        )

    def _count(self, head: Any) -> None:
        """Wrap the head block's decision (eager: the hooks sit outside compiled code)."""
        decide: Callable[[torch.Tensor], bool] = head._should_compute_remaining_blocks
        manager = head.state_manager

        def counted(residual: torch.Tensor) -> bool:
            compute = decide(residual)
            self.decisions[(manager.context.name, compute)] += 1
            return compute

        head._should_compute_remaining_blocks = counted

    def _enter_pass(self, _module: torch.nn.Module, _args: Any) -> None:
        name = PASSES[min(self._passes, len(PASSES) - 1)]
        self._passes += 1
        self._open = self.denoiser.cache_context(name)  # type: ignore[operator]
        self._open.__enter__()

    def _leave_pass(self, _module: torch.nn.Module, _args: Any, _output: Any) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if getattr(self.denoiser, "_cache_config", None) is not None:
            self.denoiser.disable_cache()  # type: ignore[operator]


def _head_hook(denoiser: torch.nn.Module) -> Any:
    """The First Block Cache hook on the denoiser's first block: the one that decides."""
    from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

    for module in denoiser.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook(_FBC_LEADER_BLOCK_HOOK) if registry is not None else None
        if hook is not None:
            return hook
    raise RuntimeError(f"{type(denoiser).__name__}: enable_cache placed no first-block hook")
