"""Step caches on the resident denoiser, for the jobs that use one: diffusers' First Block Cache
(`first_block`) and MagCache (`magcache`), both hooks on the transformer's blocks.

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
graphs: no recompile when the switch flips (tests/test_step_cache.py). TaylorSeer, the third
kind diffusers ships, hooks the attention modules inside each block, inside the graphs; measured
on tiny-flux it fails the same way under these compiled forwards, so kiln does not offer it.

Cache contexts. The hooks keep one state per context ("cond", "uncond"), which the pipeline names
around each denoiser pass. FluxPipeline, Flux2KleinPipeline, the Qwen-Image and Wan pipelines do;
FLUX.1's img2img, inpaint and Kontext pipelines do not (diffusers#12760). For those kiln names
it from a hook on the denoiser: a step's first pass is "cond", its second (true CFG) "uncond".
The LTX-Video pipelines batch CFG's two halves into one pass, which they name "cond_uncond".
"""

from __future__ import annotations

import inspect
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch

from api_client.manifest import Manifest
from api_client.schema import RenderRequest, StepCacheReport
from api_client.step_caches import StepCacheSpec, partway_refusal
from worker.errors import PinRefused
from worker.pipelines.switches import switch
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
        why = manifest.family_row.no_step_cache or f"model {manifest.id} declares no step_cache"
        return StepCacheDecision("skipped", why)
    if asked is False:
        return StepCacheDecision("skipped", "the request asks for every step (step_cache: false)")
    value = switch(manifest, settings, "step_cache")
    if value == "off" and asked:
        raise PinRefused(
            f"model {manifest.id}: the request asks for a step cache (step_cache: true), but"
            " this worker's step_cache switch is off (KILN_STEP_CACHE=off or the manifest)"
        )
    if value == "off":
        return StepCacheDecision("skipped", "switched off")
    part_way = partway_refusal(spec, request.mode)
    if part_way is not None:  # a request's true is refused at submit (resolve_request)
        return StepCacheDecision("skipped", part_way)
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
    """One job's step cache on the denoiser: enabled on entry, counted while it runs, removed on
    exit (whatever ends the denoise). step_ended() is called at each step's end, so the passes
    of the next step are named in order where the pipeline names none.

    Counted from outside the cache, the same way for every kind: a hook on the denoiser counts
    its passes per context, and the last block, which every kind skips when it reuses a step,
    counts the passes that computed."""

    def __init__(
        self, denoiser: torch.nn.Module, spec: StepCacheSpec, pipe: Any, steps: int
    ) -> None:
        self.denoiser, self.spec, self.steps = denoiser, spec, steps
        self.name_passes = not names_its_contexts(type(pipe))
        self.passes: Counter[str] = Counter()  # denoiser passes per context
        self.computed: Counter[str] = Counter()  # of those, the ones that ran every block
        self._step_passes = 0
        self._context = PASSES[0]
        self._lead = ""  # the context of each step's first pass: "cond", or LTX's "cond_uncond"
        self._open: AbstractContextManager[Any] | None = None
        self._handles: list[Any] = []
        self._tail: torch.nn.Module | None = None
        self._tail_forward: Any = None  # the tail block's own forward attribute, if it had one
        self._manager: Any = None

    def __enter__(self) -> StepCache:
        try:
            self._count_tail()
            self.denoiser.enable_cache(_config(self.spec, self.steps))  # type: ignore[operator]
            self._manager = _state_manager(self.denoiser)
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
        self._step_passes = 0

    def report(self) -> StepCacheReport:
        """The first pass of each step (the conditional one, or a batched CFG's only one): its
        steps computed and reused."""
        lead = self._lead or PASSES[0]
        return StepCacheReport(
            kind=self.spec.kind,
            params=self.spec.params,
            steps_computed=self.computed[lead],
            steps_reused=self.passes[lead] - self.computed[lead],
        )

    def _count_tail(self) -> None:
        """Wrap the last repeated block's forward (compiled or not) before the cache's hooks
        wrap it: it runs only in passes that computed."""
        names = set(getattr(self.denoiser, "_repeated_blocks", ()))
        blocks = [m for m in self.denoiser.modules() if type(m).__name__ in names]
        if not blocks:
            raise RuntimeError(f"{type(self.denoiser).__name__} declares no repeated blocks")
        tail = self._tail = blocks[-1]
        self._tail_forward = vars(tail).get("forward")
        inner = tail.forward

        def ran(*args: Any, **kwargs: Any) -> Any:
            self.computed[self._context] += 1
            return inner(*args, **kwargs)

        tail.forward = ran

    def _enter_pass(self, _module: torch.nn.Module, _args: Any) -> None:
        if self.name_passes:
            name = PASSES[min(self._step_passes, len(PASSES) - 1)]
            self._step_passes += 1
            self._open = self.denoiser.cache_context(name)  # type: ignore[operator]
            self._open.__enter__()
        else:  # the pipeline named it around this call
            context = getattr(self._manager, "_context", None)
            name = getattr(context, "name", PASSES[0])
        self._context = name
        self._lead = self._lead or name
        self.passes[name] += 1

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
        if self._tail is not None:
            if self._tail_forward is not None:
                self._tail.forward = self._tail_forward
            else:
                del self._tail.forward  # the class's forward again
            self._tail = None


def _config(spec: StepCacheSpec, steps: int) -> Any:
    """diffusers' config for this kind, for a job of this many denoiser steps."""
    if spec.kind == "first_block":
        from diffusers.hooks import FirstBlockCacheConfig

        return FirstBlockCacheConfig(threshold=spec.threshold)
    from diffusers.hooks import MagCacheConfig

    if isinstance(spec.mag_ratios, str):  # named: diffusers' FLUX.1-dev calibration, "flux"
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        ratios: Any = FLUX_MAG_RATIOS
    else:
        ratios = torch.tensor(spec.mag_ratios)
    return MagCacheConfig(
        threshold=spec.threshold,
        max_skip_steps=spec.max_skip_steps,
        retention_ratio=spec.retention_ratio,
        num_inference_steps=steps,  # the ratios are interpolated to the job's steps
        mag_ratios=ratios,
    )


def _state_manager(denoiser: torch.nn.Module) -> Any:
    """The cache hooks' shared state manager: where a pipeline's own context name is read."""
    for module in denoiser.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for hook in getattr(registry, "hooks", {}).values():
            if getattr(hook, "state_manager", None) is not None:
                return hook.state_manager
    raise RuntimeError(f"{type(denoiser).__name__}: enable_cache placed no stateful hook")
