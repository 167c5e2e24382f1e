"""Run one request: validate, pick a rung, load or reuse the pipeline, encode/denoise/decode with
a stopwatch, walk down the memory ladder on out-of-memory, save, and leave one timing record."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

import torch
from PIL import Image

from api_client.manifest import Manifest, check_servable, resolve_request
from api_client.schema import Attempt, RenderRequest, RenderResult, request_digest
from worker import device as dev
from worker import output
from worker.compile import graphs_compiled
from worker.device import DeviceInfo
from worker.families import decode_preview, family_of
from worker.faults import FaultPlan
from worker.ladder import (
    GB,
    Rung,
    RungChoice,
    RungMemory,
    choose_rung,
    is_oom,
    lower_rung,
    oom_detail,
    pick_rung,
    planning_gb,
    rung_need_gb,
    usable_gb,
)
from worker.pipelines import (
    LoadedPipeline,
    PipelineCache,
    choose_dtype,
    compile_fell_back,
    load_pipeline,
    preview_steps,
    release_memory,
)
from worker.settings import Settings
from worker.timings import Stopwatch, TimingRecord, emit

log = logging.getLogger(__name__)


class JobContext(Protocol):
    """What a render needs from whoever runs it (the RQ worker, a benchmark, a test)."""

    job_id: str
    queue_wait_s: float

    def progress(self, phase: str, step: int, steps: int, preview: str | None = None) -> None: ...

    def stop_requested(self) -> bool: ...


@dataclass
class LocalContext:
    """A context with no queue behind it: no progress reporting, never stopped."""

    job_id: str
    queue_wait_s: float = 0.0

    def progress(self, phase: str, step: int, steps: int, preview: str | None = None) -> None:
        return None

    def stop_requested(self) -> bool:
        return False


def requested_model(payload: Any) -> str | None:
    """The model a raw payload names, if it names one; for records of jobs that fail early."""
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) else None


class JobStopped(Exception):
    """A cancel was honoured at a step boundary; the job ends as stopped and is not retried."""


class OutOfMemory(RuntimeError):
    """The ladder ran out of rungs or retries; the message names model and rung."""


class Renderer:
    """Owns the device, the resident pipelines and the ladder's memory for one worker process."""

    def __init__(
        self,
        settings: Settings,
        manifests: dict[str, Manifest],
        info: DeviceInfo | None = None,
        worker_name: str = "local",
    ) -> None:
        self.settings = settings
        self.manifests = manifests
        self.info = info or dev.probe(settings)
        self.worker_name = worker_name
        self.cache = PipelineCache(self.info)
        self.rungs = RungMemory()
        self.faults = FaultPlan.parse(settings.faults)
        self.last_record: TimingRecord | None = None
        self.profiling = False  # label phases for torch.profiler (`kiln profile`)

    def render(self, payload: Any, ctx: JobContext) -> RenderResult:
        scope = torch.profiler.record_function if self.profiling else None
        watch = Stopwatch(lambda: dev.synchronize(self.info), scope)
        started_at = datetime.now(timezone.utc)
        record = TimingRecord(
            job_id=ctx.job_id,
            worker=self.worker_name,
            device=self.info.torch_device,
            simulated_device=self.info.simulated,
            model=requested_model(payload),  # so a refused request still counts against its model
        )
        try:
            # 1. Validate against the manifest: never trust the queue.
            request = self.validate(payload)
            record.model = request.model
            record.steps, record.width, record.height = request.steps, request.width, request.height
            record.num_images = request.num_images
            # 2. A job whose files were completed before a crash is answered from disk.
            digest = request_digest(request)
            done = output.finished_result(self.settings.output_dir, ctx.job_id, digest)
            if done is not None:
                record.status, record.cold, record.rung = "done", False, done.rung
                return done
            # 3. Generate on the ladder: rung choice, load, encode/denoise/decode, OOM descent.
            images, loaded = self._render_on_ladder(request, ctx, watch, record)
            # 4. Encode and save; result.json last, as the mark of a complete job.
            with watch.phase("image_encode"):
                encoded = [output.encode_image(image, request.output_format) for image in images]
            with watch.phase("save"):
                files = output.save_images(self.settings.output_dir, ctx.job_id, encoded)
            result = self._result(request, ctx, loaded, record, files, watch, started_at)
            output.write_result(self.settings.output_dir, result, digest)
            record.status = "done"
            return result
        except JobStopped as exc:
            record.status, record.error = "stopped", str(exc)
            raise
        except BaseException as exc:  # errors, and a job timeout (a BaseException by design)
            record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            record.timings = watch.timings(ctx.queue_wait_s)
            self.last_record = record
            emit(record, self.settings.timings_log)

    def validate(self, payload: Any) -> RenderRequest:
        request = RenderRequest.parse(payload)
        return resolve_request(request, check_servable(request, self.manifests))

    # -- the ladder -----------------------------------------------------------------------------

    def _render_on_ladder(
        self, request: RenderRequest, ctx: JobContext, watch: Stopwatch, record: TimingRecord
    ) -> tuple[list[Image.Image], LoadedPipeline]:
        manifest = self.manifests[request.model]
        choice = self._choose_rung(manifest, request)
        record.rung_reason = choice.reason
        loaded = self._ensure_loaded(manifest, choice.rung, watch, record)
        retried = descended = False
        while True:
            record.rung, record.dtype = loaded.rung, loaded.dtype_name
            record.compiled = loaded.compiled
            record.settings, record.quantized = loaded.settings, loaded.quantized
            ran_before, graphs_before = bool(loaded.warm_shapes), graphs_compiled()
            failure: str | None = None
            try:
                images = self._generate(loaded, request, ctx, watch, record)
            except Exception as exc:
                if compile_fell_back(loaded, exc):
                    note = "torch.compile failed at the first forward; retrying eager"
                    record.attempts.append(
                        Attempt(rung=loaded.rung, outcome="error", phase=watch.current, detail=note)
                    )
                    continue
                if not is_oom(exc):
                    raise
                failure = oom_detail(exc)
            if failure is None:
                if loaded.compiled and ran_before:
                    loaded.recompiles += graphs_compiled() - graphs_before
                record.recompiles = loaded.recompiles
                record.attempts.append(Attempt(rung=loaded.rung, outcome="ok"))
                size = (request.width or 0, request.height or 0)
                pushed_down = any(
                    a.outcome == "oom" and a.rung != loaded.rung for a in record.attempts
                )
                self.rungs.remember(
                    manifest.id,
                    *size,
                    loaded.rung,
                    pushed_down=pushed_down,
                    usable_gb=choice.usable_gb or 0.0,
                )
                return images, loaded
            record.attempts.append(
                Attempt(rung=loaded.rung, outcome="oom", phase=watch.current, detail=failure)
            )
            # Outside the except block: the exception and its frames are gone, so memory frees.
            with watch.phase("load"):
                self._reclaim(keep=manifest.id)
            if not retried:
                retried = True
                continue
            lower = lower_rung(loaded.rung)
            if self.pinned or descended or lower is None:
                raise OutOfMemory(self._oom_message(manifest, loaded.rung, "generating", record))
            descended = True
            with watch.phase("load"):
                self.cache.evict(manifest.id)
            loaded = self._ensure_loaded(manifest, lower, watch, record)

    @property
    def pinned(self) -> bool:
        return self.settings.memory_mode != "auto"

    def _choose_rung(self, manifest: Manifest, request: RenderRequest) -> RungChoice:
        if self.settings.memory_mode != "auto":
            return pick_rung(
                manifest, self.usable_gb(exclude=manifest.id), self.settings.memory_mode
            )
        # Counting this model's own resident bytes as reclaimable: what it could have reloaded.
        fp32 = self.info.accelerator and choose_dtype(manifest, self.info)[0] == torch.float32
        room = planning_gb(self.usable_gb(), fp32)
        # On a plain CPU the rungs save no memory and host memory drifts: no reason to forget.
        grown = room if self.info.accelerator else None
        size = (request.width or 0, request.height or 0)
        ceiling = self.rungs.get(manifest.id, *size, usable_gb=grown)
        return choose_rung(
            manifest, self.cache.get(manifest.id), ceiling, self.rungs.ceilings(manifest.id), room
        )

    def usable_gb(self, exclude: str | None = None, reclaim: bool = True) -> float:
        """Free memory now plus (reclaim) what evicting the other resident pipelines would free."""
        free = dev.free_bytes(self.info)
        if self.info.simulated is not None:  # a profile's free memory is before kiln loaded
            free = max(free - self.cache.resident_bytes(), 0)
        return usable_gb(
            free_bytes=free,
            reclaimable_bytes=self.cache.resident_bytes(exclude=exclude) if reclaim else 0,
            reserve_gb=self.settings.vram_reserve_gb,
            budget_gb=self.settings.vram_budget_gb,
            in_use_bytes=self.cache.resident_bytes(),
        )

    def _ensure_loaded(
        self, manifest: Manifest, rung: Rung, watch: Stopwatch, record: TimingRecord
    ) -> LoadedPipeline:
        """The resident pipeline at this rung, else load it; OOM while loading descends (auto)."""
        resident = self.cache.get(manifest.id)
        if resident is not None and resident.rung == rung:
            return resident
        record.cold = True
        retried = False
        while True:
            failure: str | None = None
            with watch.phase("load"):
                if resident is not None:
                    self.cache.evict(manifest.id)
                    resident = None
                self._make_room(manifest, rung)
                try:
                    loaded = load_pipeline(manifest, rung, self.info, self.settings, self.faults)
                except Exception as exc:
                    if not is_oom(exc):
                        raise
                    failure = oom_detail(exc)
            if failure is None:
                self.cache.put(loaded)
                return loaded
            record.attempts.append(Attempt(rung=rung, outcome="oom", phase="load", detail=failure))
            # The half-built pipeline died with the exception; collect it and free every other.
            with watch.phase("load"):
                self._reclaim(keep=None)
            if self.pinned:
                if retried:
                    raise OutOfMemory(self._oom_message(manifest, rung, "loading", record))
                retried = True
                continue
            lower = lower_rung(rung)
            if lower is None:
                raise OutOfMemory(self._oom_message(manifest, rung, "loading", record))
            rung = lower

    def _make_room(self, manifest: Manifest, rung: Rung) -> None:
        """Evict least recently used pipelines until this rung's estimate fits."""
        need = int(rung_need_gb(manifest, rung) * GB)
        free_now = int(self.usable_gb(reclaim=False) * GB)
        evicted = self.cache.evict_lru_until(need, free_now, keep=manifest.id)
        if evicted:
            log.info("evicted %s to make room for %s at %s", evicted, manifest.id, rung)

    def _reclaim(self, keep: str | None) -> None:
        """After an OOM: collect garbage, empty the allocator cache, evict every other pipeline."""
        self.cache.evict_others(keep=keep)
        release_memory(self.info)

    def _oom_message(self, manifest: Manifest, rung: Rung, when: str, record: TimingRecord) -> str:
        if self.pinned:
            how = f"pinned by KILN_MEMORY_MODE={self.settings.memory_mode}"
        else:
            how = "no lower rung left" if lower_rung(rung) is None else "descended once already"
        tried = ", ".join(f"{a.rung}:{a.outcome}@{a.phase or '-'}" for a in record.attempts)
        return (
            f"model {manifest.id} ran out of memory while {when} at rung {rung} ({how}); "
            f"no retries left; attempts: {tried}"
        )

    # -- one attempt ------------------------------------------------------------------------------

    @torch.inference_mode()
    def _generate(
        self,
        loaded: LoadedPipeline,
        request: RenderRequest,
        ctx: JobContext,
        watch: Stopwatch,
        record: TimingRecord,
    ) -> list[Image.Image]:
        pipe, rung = loaded.pipe, loaded.rung
        family = family_of(loaded.manifest.family)
        steps, guidance = int(request.steps or 1), float(request.guidance or 0.0)
        count, seed = request.num_images, int(request.seed or 0)
        shape = (request.width or 0, request.height or 0, count)
        record.cold = record.cold or shape not in loaded.warm_shapes
        # Generators live on the CPU so a seed gives the same image on every device.
        generators = [torch.Generator("cpu").manual_seed(seed + i) for i in range(count)]
        dev.reset_peak(self.info)

        # 1. Text encode
        with watch.phase("text_encode"):
            ctx.progress("text_encode", 0, steps)
            self.faults.check("text_encode", rung)
            embeds = family.encode(
                pipe, request.prompt, request.negative_prompt, count, guidance > 1.0
            )

        # 2. Denoise to latents; the step callback reports progress (with a TAESD preview at
        #    each quarter when previews are on) and honours a stop request.
        previews = preview_steps(steps) if loaded.preview_vae is not None else set()

        def on_step(
            _pipe: Any, step: int, _timestep: Any, tensors: dict[str, Any]
        ) -> dict[str, Any]:
            preview = None
            if step + 1 in previews:
                preview = self._preview(loaded, tensors["latents"], ctx, record)
            ctx.progress("denoise", step + 1, steps, preview)
            if ctx.stop_requested():
                raise JobStopped(f"job {ctx.job_id} stopped at step {step + 1}/{steps} on request")
            return tensors

        with watch.phase("denoise"):
            ctx.progress("denoise", 0, steps)
            self.faults.check("denoise", rung)
            latents = pipe(
                **embeds,
                num_inference_steps=steps,
                guidance_scale=guidance,
                width=request.width,
                height=request.height,
                generator=generators,
                output_type="latent",
                callback_on_step_end=on_step,
            ).images

        # 3. Decode latents to pixels
        with watch.phase("decode"):
            ctx.progress("decode", steps, steps)
            self.faults.check("decode", rung)
            images = family.decode(pipe, latents)
        loaded.warm_shapes.add(shape)
        record.peak_memory_bytes = dev.peak_bytes(self.info)
        record.per_step_s = watch.seconds.get("denoise", 0.0) / steps
        return images

    def _preview(
        self, loaded: LoadedPipeline, latents: torch.Tensor, ctx: JobContext, record: TimingRecord
    ) -> str | None:
        """Decode and save a preview; a preview that fails is logged and skipped, never fatal."""
        try:
            image = decode_preview(loaded.pipe, loaded.preview_vae, latents)
            path = output.save_preview(self.settings.output_dir, ctx.job_id, image)
        except Exception as exc:
            log.warning("preview failed for job %s: %s", ctx.job_id, exc)
            return None
        record.previews += 1
        return path

    def _result(
        self,
        request: RenderRequest,
        ctx: JobContext,
        loaded: LoadedPipeline,
        record: TimingRecord,
        files: list[Any],
        watch: Stopwatch,
        started_at: datetime,
    ) -> RenderResult:
        return RenderResult(
            job_id=ctx.job_id,
            model=request.model,
            images=files,
            seed=int(request.seed or 0),
            steps=int(request.steps or 0),
            guidance=float(request.guidance or 0.0),
            width=int(request.width or 0),
            height=int(request.height or 0),
            rung=loaded.rung,
            device=self.info.torch_device,
            simulated_device=self.info.simulated,
            dtype=loaded.dtype_name,
            compiled=loaded.compiled,
            quantized=dict(loaded.quantized),
            attempts=list(record.attempts),
            settings=loaded.settings,
            timings=watch.timings(ctx.queue_wait_s),
            worker=self.worker_name,
            started_at=started_at,
            finished_at=datetime.now(timezone.utc),
        )
