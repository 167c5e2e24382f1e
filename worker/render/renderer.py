"""Run one job from payload to result, in numbered steps: admit, validate, answer from the store,
read its inputs, choose a rung (or take the request's pins), load, generate under the ladder's
out-of-memory rules, confirm the lease, save with the generation details inside each image.
Every path out of render() leaves exactly one timing record, created here and handed to the
record listener; the result is built from that record (TimingRecord.result).

Where a job runs (memory, rung, measurements, eviction) is the renderer's Planner's
(worker.render.placement); what one job carries through the steps is its JobRun
(worker.render.job_run), built once here and handed down whole.

Over 400 lines because the nine steps of one job and their helpers read in order, here."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from typing import Any

import torch
from PIL import Image

from api_client.errors import short
from api_client.manifest import Manifest
from api_client.resolve import check_servable, check_upscaler, resolve_request
from api_client.schema import Attempt, RenderRequest, RenderResult, Rung, request_digest
from worker.crashes import crash_point
from worker.errors import FatalWorkerError, JobStopped, LeaseLost, OutOfMemory, device_lost
from worker.files import output
from worker.files.output import EncodedImage
from worker.files.store import Store, open_store
from worker.memory import device as dev
from worker.memory.device import DeviceInfo
from worker.memory.faults import FaultPlan
from worker.memory.ladder import GB, Ladder, RungMemory, is_oom
from worker.pipelines import control, reference, step_cache
from worker.pipelines.compile import graphs_compiled
from worker.pipelines.compile_cache import CompileCache, CompileRun, compile_key
from worker.pipelines.families import cfg_active
from worker.pipelines.loading import load_pipeline, place_again, place_read
from worker.pipelines.prefetch import Prefetcher
from worker.pipelines.reference import ReferenceAdapter
from worker.pipelines.resident import LoadedPipeline, PipelineCache, Rendered
from worker.pipelines.switches import compile_fell_back
from worker.pipelines.upscale import LoadedUpscaler, Upscalers, load_upscaler, upscale
from worker.render.context import JobContext
from worker.render.generate import HiresUpscaler, apply_loras, generate
from worker.render.inputs import InputReader
from worker.render.job_run import JobRun, RungPlan
from worker.render.passes import DecodeRules
from worker.render.placement import Planner
from worker.render.timings import Stopwatch, TimingRecord, emit
from worker.settings import Settings, WebhookTarget, check_target, parse_targets

log = logging.getLogger(__name__)
RecordListener = Callable[[TimingRecord], None]


class Renderer:
    """Owns the device, the resident pipelines, its planner and the read-ahead for one worker
    process, and renders one job at a time (render)."""

    def __init__(
        self,
        settings: Settings,
        manifests: dict[str, Manifest],
        info: DeviceInfo | None = None,
        *,
        worker_name: str = "local",
        on_record: RecordListener | None = None,
        faults: FaultPlan | None = None,
        webhook_targets: Mapping[str, WebhookTarget] | None = None,
        upcoming: Callable[[], str | None] | None = None,
        compile_cache: CompileCache | None = None,
    ) -> None:
        self.settings = settings
        # Parsed once by the composition root (worker/serve.py); a test or bench parses its own.
        self.webhook_targets = (
            parse_targets(settings.webhooks) if webhook_targets is None else webhook_targets
        )
        self.manifests = manifests
        self.info = info or dev.probe(settings)
        self.worker_name = worker_name
        self.on_record = on_record  # gets every job's record once it is final
        self.cache = PipelineCache(self.info, int(settings.ram_cache_gb * GB))
        self.planner = Planner(settings, manifests, self.info, self.cache, RungMemory())
        self.inputs = InputReader(settings)
        self.upscalers = Upscalers()  # upscaler models, beside the pipeline cache (small)
        self.faults = FaultPlan.parse(settings.faults) if faults is None else faults
        # Reads the next job's model into the RAM cache while a job renders; `upcoming` says
        # which model that is (a queue worker's lane order; worker.pipelines.prefetch).
        self.prefetcher = Prefetcher(self.cache, manifests, self.info, settings, upcoming)
        self.profiling = False  # label phases for torch.profiler (`kiln profile`)
        # Compiled code shared with the fleet through Redis (worker/serve.py gives it one);
        # without it jobs still say how long they compiled and whether from the local cache.
        self.compile_cache = compile_cache or CompileCache(None, 0, 0)

    @property
    def store(self) -> Store:
        """Where this job's files go (KILN_OUTPUT_URL); follows a change of settings."""
        return open_store(self.settings)

    def cannot_fit(self) -> str | None:
        """Why this worker must take no job now (the planner's word), or None."""
        return self.planner.cannot_fit()

    def render(self, payload: Any, ctx: JobContext) -> RenderResult:
        scope = torch.profiler.record_function if self.profiling else None
        watch = Stopwatch(lambda: dev.synchronize(self.info), scope)
        started_at = datetime.now(timezone.utc)
        record = TimingRecord(
            job_id=ctx.job_id,
            worker=self.worker_name,
            device=self.info.torch_device,
            simulated_device=self.info.simulated,
            model=_requested_model(payload),  # so a refused job still counts against its model
        )
        lost = False
        try:
            # 1. Admit: a job refused by its runner, or cancelled while it waited, loads nothing.
            ctx.admit()
            # 2. Validate against the manifest: never trust the queue.
            request = self.validate(payload)
            record.describe(request)
            # 3. Answer from the store a job whose files were completed before a crash. Its
            #    record is this worker's, with the render's phases from result.json: the worker
            #    that rendered it died before committing the job's end, so it published none.
            digest = request_digest(request)
            done = self.store.finished_result(ctx.job_id, digest)
            if done is not None:
                record = TimingRecord.from_result(done, answered_by=self.worker_name)
                return done
            # 4. An img2img, inpaint or controlled job's inputs, read and checked (sha256,
            #    format, size) and preprocessed before anything is loaded or evicted for it.
            manifest = self.manifests[request.model]
            inputs = self.inputs.read(request, manifest, self.store)
            job = JobRun(ctx, request, manifest, inputs, watch, record, started_at, digest)
            _checkpoint(ctx, "before loading")
            loaded: Rendered
            if self.manifests[request.model].family_row.tiles:
                # 5-7. An upscaler: resident or loaded, run in tiles that halve on OOM.
                images, loaded = self._upscale(job)
            else:
                # 5-7. A rung, a load, a generate under the ladder's out-of-memory rules.
                images, loaded = self._diffuse(job)
            _checkpoint(ctx, "after decode")
            # 8. Encode (a video model's frames into one video), with the generation details
            #    inside each file; then confirm this run still holds the job (a stalled worker's
            #    lease may have lapsed) before writing.
            video = manifest.family_row.video
            with watch.phase("video_encode" if video else "image_encode"):
                encode = output.encode_video if video else output.encode_images
                encoded = encode(
                    images,
                    request,
                    loaded,
                    inputs.digests,
                    self.info.torch_device,
                    record.step_cache,
                )
            ctx.confirm()
            # 9. Save the images, then result.json last, as the mark of a complete job.
            result = self._save(job, encoded)
            record.status = "done"
            return result
        except BaseException as exc:  # errors, stops, a job timeout (a BaseException by design)
            lost = isinstance(exc, LeaseLost)
            fatal = _ended(record, exc, ctx.job_id)
            if fatal is not None:
                raise fatal from exc
            raise
        finally:
            self._close(ctx, watch, record, lost)

    def publish(self, record: TimingRecord, observed: bool = False) -> None:
        """The job's one record: the log line, the timings file, the listener unless observed."""
        emit(record, self.settings.timings_log)
        if not observed:
            self.observe(record)

    def observe(self, record: TimingRecord) -> None:
        if self.on_record is not None:  # metrics and the timing fit, without the log line
            self.on_record(record)

    def validate(self, payload: Any) -> RenderRequest:
        request = RenderRequest.parse(payload)
        check_target(request, self.webhook_targets)
        resolved = resolve_request(request, check_servable(request, self.manifests))
        check_upscaler(resolved, self.manifests)
        return resolved

    # -- 5-7. a diffusion pipeline's job -------------------------------------------------------

    def _diffuse(self, job: JobRun) -> tuple[list[Image.Image], LoadedPipeline]:
        """A rung: the request's pin (a replay's, a pinned ladder that never descends), else the
        planner's; the load; the generate. A cancel or a lost lease is taken at every phase
        boundary as well as at every denoising step."""
        plan = self._plan(job)
        with _named_pin(job.request, job.manifest.id, job.record.attempts):
            # 6. Load: the resident pipeline if it serves the job, else a load.
            crash_point("load")
            loaded = self._ensure_loaded(job, plan.choice.rung)
            _checkpoint(job.ctx, "after loading")
            self.prefetcher.after_load(job.manifest.id, job.ctx.job_id)
            # 7. Generate: encode, denoise, decode under the ladder's out-of-memory rules.
            images, loaded = self._generate(job, loaded)
        self.planner.remember(job.request, plan.choice, job.record.attempts, loaded.rung)
        return images, loaded

    def _upscale(self, job: JobRun) -> tuple[list[Image.Image], LoadedUpscaler]:
        """Mode upscale: the upscaler resident or loaded, the image through it in tiles."""
        record = job.record
        loaded, read = self._upscaler(job.request.model, job.watch)
        if read:
            record.cold, record.load_source = True, "disk"
        record.ran_on(loaded)
        _checkpoint(job.ctx, "after loading")
        with job.watch.phase("upscale"):
            job.ctx.progress("upscale", 0, 1)
            image = job.inputs.sources["image"]
            images = upscale(loaded, [image], record.attempts, self.faults, self.info)
        return images, loaded

    def _upscaler(self, model_id: str, watch: Stopwatch) -> tuple[LoadedUpscaler, bool]:
        """An upscaler from this renderer's resident ones, else read and placed (the load);
        and whether it was read now."""
        loaded = self.upscalers.get(model_id)
        if loaded is not None:
            return loaded, False
        with watch.phase("load"):
            crash_point("load")
            manifest = self.manifests[model_id]
            loaded = load_upscaler(manifest, self.info, self.settings.models_dir, self.faults)
        self.upscalers.put(loaded)
        return loaded, True

    def _hires_upscaler(self, job: JobRun) -> HiresUpscaler | None:
        """A hires pass's upscaler model as generate calls it: run until the images are at least
        the hires size (a 2x model twice for 4x), then resized to it (Lanczos), as A1111's hires
        fix does. None for latent upscaling or no hires pass."""
        hires = job.request.hires
        if hires is None or hires.upscaler in (None, "latent"):
            return None
        model_id = hires.upscaler

        def run(images: list[Image.Image], size: tuple[int, int]) -> list[Image.Image]:
            loaded, _read = self._upscaler(model_id, job.watch)
            with job.watch.phase("upscale"):
                while images[0].width < size[0] or images[0].height < size[1]:
                    images = upscale(loaded, images, job.record.attempts, self.faults, self.info)
            return [
                i if i.size == size else i.resize(size, Image.Resampling.LANCZOS) for i in images
            ]

        return run

    # -- 5. the rung ----------------------------------------------------------------------------

    def _plan(self, job: JobRun) -> RungPlan:
        """The job's rung, ladder and step cache, kept on the job; a compile pin its rung cannot
        honour, or a step cache this worker switched off, fails here."""
        request, manifest, record = job.request, job.manifest, job.record
        cache = step_cache.decide(manifest, self.settings, request)
        ladder = Ladder(manifest.id, request.rung or self.settings.memory_mode, record.attempts)
        choice = self.planner.choose_rung(manifest, request)
        record.rung_reason = choice.reason
        record.planned_from = "measured" if choice.measured else "declared"
        job.planned = RungPlan(choice, ladder, cache)
        return job.planned

    # -- 6. load --------------------------------------------------------------------------------

    def _ensure_loaded(self, job: JobRun, rung: Rung) -> LoadedPipeline:
        """The resident pipeline at this rung and compile state (the request's pin, else this
        worker's), else a load under the ladder's loading rules."""
        manifest, record = job.manifest, job.record
        resident = self.cache.get(manifest.id)
        if resident is not None and self.planner.serves(resident, rung, job.pin):
            return resident
        record.cold = True

        def load(at: Rung) -> LoadedPipeline:
            # Its read ahead, if one is in flight, then its RAM copy, before making room: the
            # pipelines evicted for it go into the RAM cache too, and must not push it out.
            self.prefetcher.wait_for(manifest.id)
            kept = self.cache.ram.take(manifest.id)
            self.planner.make_room(manifest, at, job.request)
            # What a partial load splits its blocks by: memory now, and full's measured need.
            room = (self.planner.usable_gb(reclaim=False), job.plan.choice.full_need_gb)
            pin = job.pin
            if kept is not None and (not kept.placed or self.planner.serves(kept, at, pin)):
                record.load_source = "ram"
                if not kept.placed:  # read ahead, never placed: any rung's first placement
                    return place_read(kept, at, self.info, self.settings, self.faults, pin, *room)
                return place_again(kept, self.info, self.faults)
            if kept is not None:  # kept at another rung or compile state: not this job's
                self.cache.release(kept)
            record.load_source = "disk"
            return load_pipeline(manifest, at, self.info, self.settings, self.faults, pin, *room)

        with job.watch.phase("load"):
            if resident is not None:
                self.cache.evict(manifest.id, to_ram=False)
            loaded = job.plan.ladder.load(rung, load, reclaim=lambda: self.planner.free(keep=None))
        self.cache.put(loaded)
        return loaded

    # -- 7. generate ----------------------------------------------------------------------------

    def _generate(
        self, job: JobRun, loaded: LoadedPipeline
    ) -> tuple[list[Image.Image], LoadedPipeline]:
        """Tries on the pipeline under the ladder's generating rules; out of memory in decode
        keeps the latents (Ladder.decode: tiled, then a rung lower). Returns the images and the
        pipeline that decoded them."""
        reclaim = functools.partial(self._reclaim, job)
        reload = functools.partial(self._reload, job)
        ladder = job.plan.ladder
        decode = functools.partial(ladder.decode, reclaim=reclaim, reload=reload)
        return ladder.generate(
            loaded,
            run=lambda on: self._attempt(job, on, decode),
            reclaim=reclaim,
            reload=reload,
            phase=lambda: job.watch.current,
        )

    def _reclaim(self, job: JobRun) -> None:
        """After an OOM while generating: every other pipeline out, memory back (load time)."""
        with job.watch.phase("load"):
            self.planner.free(keep=job.manifest.id)

    def _reload(self, job: JobRun, rung: Rung) -> LoadedPipeline:
        """After a second OOM while generating: the model again, one rung lower."""
        with job.watch.phase("load"):
            self.cache.evict(job.manifest.id, to_ram=False)
        return self._ensure_loaded(job, rung)

    def _attempt(
        self, job: JobRun, loaded: LoadedPipeline, decode: DecodeRules
    ) -> tuple[list[Image.Image], LoadedPipeline]:
        """One try on this pipeline; a compiled forward that fails once falls back to eager.
        Returns the pipeline that decoded: a lower rung's when decode descended."""
        request, watch, record = job.request, job.watch, job.record
        while True:
            record.ran_on(loaded)
            ran_before, graphs_before = bool(loaded.warm_shapes), graphs_compiled()
            cfg = cfg_active(loaded.manifest.family, request.guidance or 0.0, request.true_cfg)
            size = (request.width or 0, request.height or 0)
            loras = apply_loras(loaded, job, self.info.streams)
            controls = job.inputs.controls
            beside = []
            if controls:  # the ControlNets are the load's: read once, kept with the pipeline
                with watch.phase("load"):
                    beside = control.attach(loaded, controls, self.info, self.settings.models_dir)
            self._reference(job, loaded)  # read before the job's memory is measured, as those
            mode = control.mode_key(request.mode or "txt2img", controls, bool(request.reference))
            novelty = loaded.novelty(*size, request.num_images, cfg, mode, loras)
            start, reads = dev.allocated_bytes(self.info), self.prefetcher.mark()
            # A job that uses no adapter runs the denoiser without its LoRA slots.
            slots = loaded.adapters.bypassed() if loaded.adapters else nullcontext()
            compiling = self._compile_start(job, loaded, cfg, mode, loras)
            try:
                with slots:
                    images, decoded = generate(
                        loaded,
                        job,
                        info=self.info,
                        faults=self.faults,
                        store=self.store,
                        decode=decode,
                        controlnets=beside,
                        references=functools.partial(self._reference, job),
                        upscaler=self._hires_upscaler(job),
                    )
            except Exception as exc:
                if not compile_fell_back(loaded, exc):
                    raise
                note = "torch.compile failed at the first forward; retrying eager"
                record.attempts.append(
                    Attempt(rung=loaded.rung, outcome="error", phase=watch.current, detail=note)
                )
                continue
            built = graphs_compiled() - graphs_before
            with watch.phase("denoise") if compiling.key else nullcontext():
                self.compile_cache.finish(compiling)
            record.compile_s = round(record.compile_s + compiling.seconds, 3)
            record.compile_source = compiling.source or record.compile_source
            loaded.adapter_sets.add(loras)
            # Not where a decode retried a rung lower (two pipelines), nor on a CPU beside a
            # read ahead (it grows the resident set a CPU job's peak is taken from).
            beside_read = self.info.torch_device == "cpu" and not self.prefetcher.quiet(reads)
            if decoded is loaded and not beside_read:
                self.planner.measure(loaded, request, record.peak_memory_bytes, start)
            if loaded.compiled and ran_before and built:
                loaded.recompiles += built
                record.recompile_causes.append(f"{novelty}: {built} graph(s)")
            record.recompiles = loaded.recompiles
            return images, decoded

    def _reference(self, job: JobRun, loaded: LoadedPipeline) -> ReferenceAdapter | None:
        """The job's IP-Adapter on this pipeline: read at the first job with a reference and
        kept with the pipeline (the load's, as a ControlNet's read is)."""
        if job.request.reference is None:
            return None
        if isinstance(loaded.reference, ReferenceAdapter):
            return loaded.reference
        with job.watch.phase("load"):
            return reference.attach(loaded, self.info, self.settings.models_dir)

    def _compile_start(
        self, job: JobRun, loaded: LoadedPipeline, cfg: bool, mode: str, loras: frozenset[str]
    ) -> CompileRun:
        """A compiled pipeline's compile accounting for this try, with the fleet's code for its
        key unpacked first (compile work, so charged to denoise, where the compile runs)."""
        if not loaded.compiled:
            return self.compile_cache.start(None)
        shape = (job.request.width or 0, job.request.height or 0, job.request.num_images)
        device = self.info.torch_device
        key = compile_key(loaded, device, shape, cfg=cfg, mode=mode, adapters=bool(loras))
        with job.watch.phase("denoise"):
            return self.compile_cache.start(key)

    # -- 9. save ---------------------------------------------------------------------------------

    def _save(self, job: JobRun, encoded: list[EncodedImage]) -> RenderResult:
        """The images into the store, then the result built from the record, as result.json."""
        ctx, record = job.ctx, job.record
        with job.watch.phase("save"):
            files = self.store.save_images(ctx.job_id, encoded)
        crash_point("save")
        _checkpoint(ctx, "after saving its images")
        record.timings = job.watch.timings(ctx.queue_wait_s)
        stored = list(zip(files, encoded, strict=True))
        images = [entry for entry, made in stored if not made.frames]
        videos = [made.as_video(entry) for entry, made in stored if made.frames]
        result = record.result(images, job.started_at, job.digest, videos)
        self.store.write_result(result)
        return result

    def _close(self, ctx: JobContext, watch: Stopwatch, record: TimingRecord, lost: bool) -> None:
        """Every way out: the files of a job that did not finish removed, then its one record.
        A lost job's files are the names its new owner writes, so they are left to it."""
        self.store.close_job(ctx.job_id, keep=record.status == "done" or lost)
        if record.answered_from == "render":
            record.timings = watch.timings(ctx.queue_wait_s)
        # A done job's record waits for the job's end to be committed when a queue runs it.
        if record.status != "done" or not ctx.hold_done_record(record):
            self.publish(record)


def _checkpoint(ctx: JobContext, where: str) -> None:
    if ctx.stop_requested():
        raise JobStopped(f"job {ctx.job_id} stopped on request {where}")


@contextmanager
def _named_pin(request: RenderRequest, model_id: str, attempts: list[Attempt]) -> Iterator[None]:
    """Out of memory on a rung the request pins fails as a KILN_MEMORY_MODE pin does, but says
    the request pinned it (the ladder's words name the setting, which is not what to change)."""
    try:
        yield
    except OutOfMemory as exc:
        if request.rung is None:
            raise
        tried = ", ".join(f"{a.rung}:{a.outcome}@{a.phase or '-'}" for a in attempts)
        raise OutOfMemory(
            f"model {model_id} ran out of memory at rung {request.rung}, which the request pins"
            f" (rung={request.rung}, as a replay does; a pinned rung never descends);"
            f" attempts: {tried}"
        ) from exc


def _requested_model(payload: Any) -> str | None:
    """The model a raw payload names, if it names one; for records of jobs that fail early."""
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, str):
        return None
    # Bounded and encodable: it goes into the timing log and onto stdout, whatever it was.
    return str(short(model.encode("utf-8", "backslashreplace").decode()))


def _ended(record: TimingRecord, exc: BaseException, job_id: str) -> FatalWorkerError | None:
    """The record of a job that ends in exc: stopped (a cancel, a shutdown, a lost lease) or
    failed; the FatalWorkerError to raise instead when the device is lost."""
    if isinstance(exc, JobStopped):
        record.status, record.error = "stopped", str(exc)
        return None
    fatal = _fatal(exc, job_id)
    failure = fatal or exc
    record.status, record.error = "failed", f"{type(failure).__name__}: {failure}"
    return fatal


def _fatal(exc: BaseException, job_id: str) -> FatalWorkerError | None:
    """A device-lost error ends this worker, not just the job (no later job could succeed)."""
    if isinstance(exc, FatalWorkerError):
        return exc
    if device_lost(exc) and not is_oom(exc):
        return FatalWorkerError(f"the device was lost during job {job_id}: {exc}")
    return None
