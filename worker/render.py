"""Run one job from payload to result, in numbered steps: admit, validate, answer from disk,
choose a rung (or take the request's pins), load, generate under the ladder's out-of-memory
rules, save with the generation details inside each image. Every path out of
render() leaves exactly one timing record, created here and handed to the record listener.

Over 300 lines because the steps' helpers (rung choice, load, reload, one attempt, the result)
are the callbacks the Ladder runs, and read best beside the steps that hand them over."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import torch
from PIL import Image
from redis import Redis

from api_client.connection import connect
from api_client.errors import short
from api_client.manifest import Manifest, check_servable, resolve_request
from api_client.schema import Attempt, RenderRequest, RenderResult, Rung, request_digest
from worker import device as dev
from worker import output
from worker.adapters import AdapterRefused
from worker.compile import graphs_compiled
from worker.context import JobContext
from worker.details import ImageDetails, InputDigest, LoraWeight, kiln_version
from worker.device import DeviceInfo
from worker.errors import (
    FatalWorkerError,
    JobStopped,
    LeaseLost,
    OutOfMemory,
    PinRefused,
    device_lost,
)
from worker.families import cfg_active
from worker.faults import FaultPlan
from worker.generate import DecodeRules, generate
from worker.ladder import (
    GB,
    Fit,
    Ladder,
    RungChoice,
    RungMemory,
    choose_rung,
    is_oom,
    pick_rung,
    rung_need_gb,
    usable_gb,
)
from worker.loading import choose_dtype, fit_for, load_pipeline, place_again
from worker.peaks import Peak, PeakBook, Shape, card_kind, component_bytes, lowest_need_gb
from worker.resident import DTYPE_NAMES, LoadedPipeline, PipelineCache, release_memory
from worker.settings import Settings
from worker.store import Store, open_store
from worker.switches import compile_fell_back, compile_plan
from worker.timings import Stopwatch, TimingRecord, emit
from worker.webhooks import check_target

log = logging.getLogger(__name__)
RecordListener = Callable[[TimingRecord], None]


class Renderer:
    """Owns the device, the resident pipelines and the ladder's memory for one worker process."""

    def __init__(
        self,
        settings: Settings,
        manifests: dict[str, Manifest],
        info: DeviceInfo | None = None,
        *,
        worker_name: str = "local",
        on_record: RecordListener | None = None,
    ) -> None:
        self.settings = settings
        self.manifests = manifests
        self.info = info or dev.probe(settings)
        self.worker_name = worker_name
        self.on_record = on_record  # gets every job's record once it is final
        self.cache = PipelineCache(self.info, int(settings.ram_cache_gb * GB))
        self.rungs = RungMemory()
        self.faults = FaultPlan.parse(settings.faults)
        self.profiling = False  # label phases for torch.profiler (`kiln profile`)

    @property
    def store(self) -> Store:
        """Where this job's files go (KILN_OUTPUT_URL); follows a change of settings."""
        return open_store(self.settings)

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
            # 0. A job refused by its runner, or cancelled while it waited, never loads a model.
            ctx.admit()
            # 1. Validate against the manifest: never trust the queue.
            request = self.validate(payload)
            _describe(record, request)
            # 2. A job whose files were completed before a crash is answered from the store. Its
            #    record is this worker's, with the render's phases from result.json: the worker
            #    that rendered it died before committing the job's end, so it published none.
            digest = request_digest(request)
            done = self.store.finished_result(ctx.job_id, digest)
            if done is not None:
                record = TimingRecord.from_result(done, answered_by=self.worker_name)
                record.status = "done"
                return done
            # 2b. An img2img or inpaint job's inputs, read and checked (sha256, format, size)
            #     before anything is loaded or evicted for it.
            sources, inputs = self._read_inputs(request)
            # 3. Choose a rung and have the pipeline resident there; a rung the request pins (a
            #    replay's) is a pinned ladder, which never descends. A cancel or a lost lease is
            #    taken at every phase boundary as well as at every denoising step.
            _checkpoint(ctx, "before loading")
            manifest, pin = self.manifests[request.model], request.compile
            ladder = Ladder(manifest.id, request.rung or self.settings.memory_mode, record.attempts)
            choice = self._choose_rung(manifest, request)
            record.rung_reason = choice.reason
            record.planned_from = "measured" if choice.measured else "declared"
            with _named_pin(request, manifest.id, record.attempts):
                loaded = self._ensure_loaded(manifest, choice.rung, pin, ladder, watch, record)
                _checkpoint(ctx, "after loading")
                # 4. Encode, denoise, decode; out of memory follows the ladder's rules, and one
                #    in decode keeps the latents (Ladder.decode: tiled, then a rung lower).
                reclaim = functools.partial(self._reclaim, watch, keep=manifest.id)
                reload = functools.partial(
                    self._reload, manifest, pin=pin, ladder=ladder, watch=watch, record=record
                )
                decode = functools.partial(ladder.decode, reclaim=reclaim, reload=reload)
                images, loaded = ladder.generate(
                    loaded,
                    run=lambda on: self._attempt(on, request, ctx, watch, record, sources, decode),
                    reclaim=reclaim,
                    reload=reload,
                    phase=lambda: watch.current,
                )
            # A rung an OOM pushed this size down to is a ceiling for the next jobs at it, and
            # a floor under that rung's need for every worker on this card kind.
            pushed_down = any(a.outcome == "oom" and a.rung != loaded.rung for a in record.attempts)
            if pushed_down and choice.usable_gb is not None:
                self._measure_oom(request, record, choice.usable_gb)
            size = (request.width or 0, request.height or 0)
            self.rungs.remember(
                manifest.id,
                *size,
                loaded.rung,
                pushed_down=pushed_down,
                usable_gb=choice.usable_gb or 0.0,
            )
            _checkpoint(ctx, "after decode")
            # 5. Encode, with the generation details inside each file, and save; result.json
            #    last, as the mark of a complete job. Nothing is written unless this run still
            #    holds the job (a stalled worker's may have lapsed).
            with watch.phase("image_encode"):
                details = [self._details(request, loaded, i, inputs) for i in range(len(images))]
                encoded = [
                    output.encode_image(image, request.output_format, about)
                    for image, about in zip(images, details, strict=True)
                ]
            ctx.confirm()
            with watch.phase("save"):
                files = self.store.save_images(ctx.job_id, encoded)
            _checkpoint(ctx, "after saving its images")
            result = self._result(request, ctx, loaded, record, files, watch, started_at, digest)
            self.store.write_result(result)
            record.status = "done"
            return result
        except JobStopped as exc:
            record.status, record.error = "stopped", str(exc)
            lost = isinstance(exc, LeaseLost)
            raise
        except BaseException as exc:  # errors, and a job timeout (a BaseException by design)
            fatal = _fatal(exc, ctx.job_id)
            failure = fatal or exc
            record.status, record.error = "failed", f"{type(failure).__name__}: {failure}"
            if fatal is not None:
                raise fatal from exc
            raise
        finally:
            # Files begun by an attempt that did not finish are removed; a lost job's files are
            # the names its new owner writes, so they are left to it.
            self.store.close_job(ctx.job_id, keep=record.status == "done" or lost)
            if record.answered_from == "render":
                record.timings = watch.timings(ctx.queue_wait_s)
            # A done job's record waits for the job's end to be committed when a queue runs it.
            if record.status != "done" or not ctx.hold_done_record(record):
                self.publish(record)

    def publish(self, record: TimingRecord) -> None:
        """The job's one record: the log line, the timings file, then the record listener."""
        emit(record, self.settings.timings_log)
        if self.on_record is not None:
            self.on_record(record)

    def validate(self, payload: Any) -> RenderRequest:
        request = RenderRequest.parse(payload)
        check_target(request, self.settings)
        return resolve_request(request, check_servable(request, self.manifests))

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

    # -- steps 3 and 4 ------------------------------------------------------------------------

    def _choose_rung(self, manifest: Manifest, request: RenderRequest) -> RungChoice:
        """The request's pinned rung, else the worker's choice; a compile pin that rung cannot
        honour fails here, before anything is loaded or evicted."""
        choice = self._pinned_rung(manifest, request.rung) if request.rung else None
        choice = choice or self._worker_rung(manifest, request)
        compile_plan(manifest, choice.rung, self.info, self.settings, request.compile)
        return choice

    def _pinned_rung(self, manifest: Manifest, rung: Rung) -> RungChoice:
        mode = self.settings.memory_mode
        if mode not in ("auto", rung):
            raise PinRefused(
                f"model {manifest.id}: the request pins rung {rung}, but this worker is pinned"
                f" to {mode} (KILN_MEMORY_MODE={mode})"
            )
        return RungChoice(rung, f"pinned by the request (rung={rung})")

    def _worker_rung(self, manifest: Manifest, request: RenderRequest) -> RungChoice:
        fit = fit_for(manifest, self.info, self.settings)
        # What this card kind measured for the job's shape replaces the manifest's figures.
        fit = dataclasses.replace(fit, measured=self.peaks.needs_gb(self._shape(request, fit)))
        if self.settings.memory_mode != "auto":
            return pick_rung(
                manifest, self.usable_gb(exclude=manifest.id), self.settings.memory_mode, fit
            )
        # Counting this model's own resident bytes as reclaimable: what it could have reloaded.
        room = self.usable_gb()
        # On a plain CPU the rungs save no memory and host memory drifts: no reason to forget.
        grown = room if self.info.accelerator else None
        size = (request.width or 0, request.height or 0)
        ceiling = self.rungs.get(manifest.id, *size, usable_gb=grown)
        ceilings = self.rungs.ceilings(manifest.id)
        choice = choose_rung(manifest, self.cache.get(manifest.id), ceiling, ceilings, room, fit)
        return dataclasses.replace(choice, measured=choice.rung in fit.measured)

    def cannot_fit(self) -> str | None:
        """Why this worker must take no job now: every served model's measured need at the
        lowest rung is above the memory it could have (evicting everything); None otherwise,
        and while any model's need is only the manifest's estimate (that one is tried)."""
        room = self.usable_gb()
        over = []
        for manifest in self.manifests.values():
            if manifest.benchmark_only:
                continue
            need = lowest_need_gb(self.peaks, manifest.id)
            if need is None or need <= room:
                return None
            over.append(f"{manifest.id} needs {need:.2f} GB")
        if not over:
            return None
        return f"waiting for memory: {room:.2f} GB usable, and {'; '.join(over)} at its lowest rung"

    def _shape(self, request: RenderRequest, fit: Fit) -> Shape:
        """What a job's memory depends on besides its rung (worker.peaks)."""
        manifest = self.manifests[request.model]
        return Shape(
            model=manifest.id,
            width=request.width or 0,
            height=request.height or 0,
            dtype=DTYPE_NAMES[choose_dtype(manifest, self.info)[0]],
            quantized=tuple(sorted(fit.quantized.items())),
            mode=request.mode or "txt2img",
        )

    @functools.cached_property
    def peaks(self) -> PeakBook:
        """This card kind's measurements, read from Redis at the first job that plans a rung."""
        try:
            connection: Redis | None = self._redis
        except Exception as exc:  # no Redis: this process's own measurements only
            log.warning("peaks: no Redis (%s)", exc)
            connection = None
        book = PeakBook(connection, card_kind(self.info.name, self.info.simulated))
        book.read()
        return book

    def _measure_oom(self, request: RenderRequest, record: TimingRecord, usable: float) -> None:
        fit = fit_for(self.manifests[request.model], self.info, self.settings)
        shape = self._shape(request, fit)
        for rung in {a.rung for a in record.attempts if a.outcome == "oom"}:
            self.peaks.observe_oom(shape, rung, usable)

    def _measure(
        self, loaded: LoadedPipeline, request: RenderRequest, record: TimingRecord, start: int
    ) -> None:
        """After a job: its pipeline's bytes at this rung and what the job added, into the book."""
        if record.peak_memory_bytes is None:
            return
        weights, largest = component_bytes(loaded.pipe)
        fit = fit_for(loaded.manifest, self.info, self.settings)
        measured = Peak(
            resident_bytes=loaded.device_bytes,
            working_bytes=max(record.peak_memory_bytes - start, 0),
            weights_bytes=weights,
            largest_bytes=largest,
        )
        self.peaks.observe(self._shape(request, fit), loaded.rung, measured)

    def _ensure_loaded(
        self,
        manifest: Manifest,
        rung: Rung,
        pin: bool | None,
        ladder: Ladder,
        watch: Stopwatch,
        record: TimingRecord,
    ) -> LoadedPipeline:
        """The resident pipeline at this rung and compile state (the request's pin, else this
        worker's), else a load under the ladder's loading rules."""
        resident = self.cache.get(manifest.id)
        if resident is not None and self._serves(resident, rung, pin):
            return resident
        record.cold = True

        def load(at: Rung) -> LoadedPipeline:
            self._make_room(manifest, at)
            kept = self.cache.ram.take(manifest.id)
            if kept is not None and self._serves(kept, at, pin):
                record.load_source = "ram"
                return place_again(kept, self.info, self.faults)
            if kept is not None:  # kept at another rung or compile state: not this job's
                self.cache.release(kept)
            record.load_source = "disk"
            room = self.usable_gb(reclaim=False)  # what a partial load splits its blocks by
            return load_pipeline(manifest, at, self.info, self.settings, self.faults, pin, room)

        with watch.phase("load"):
            if resident is not None:
                self.cache.evict(manifest.id, to_ram=False)
            loaded = ladder.load(rung, load, reclaim=lambda: self._free(keep=None))
        self.cache.put(loaded)
        return loaded

    def _serves(self, resident: LoadedPipeline, rung: Rung, pin: bool | None) -> bool:
        """Whether the resident pipeline renders this job as asked. Compile state is part of it,
        since it changes pixels: a pinned job takes a pipeline in its pinned state, and a job
        without a pin one in the state this worker's policy loads, so a pipeline a replay
        loaded eager does not stay eager for the jobs after it. Otherwise: reload."""
        if resident.rung != rung:
            return False
        if pin is not None:
            return resident.compiled == pin
        if resident.compile_pin is None:
            return True
        policy = compile_plan(resident.manifest, rung, self.info, self.settings)
        return resident.compiled == policy.compile

    def _reload(
        self,
        manifest: Manifest,
        rung: Rung,
        pin: bool | None,
        ladder: Ladder,
        watch: Stopwatch,
        record: TimingRecord,
    ) -> LoadedPipeline:
        """After a second OOM while generating: the model again, one rung lower."""
        with watch.phase("load"):
            self.cache.evict(manifest.id, to_ram=False)
        return self._ensure_loaded(manifest, rung, pin, ladder, watch, record)

    def _attempt(
        self,
        loaded: LoadedPipeline,
        request: RenderRequest,
        ctx: JobContext,
        watch: Stopwatch,
        record: TimingRecord,
        sources: dict[str, Image.Image],
        decode: DecodeRules,
    ) -> tuple[list[Image.Image], LoadedPipeline]:
        """One try on this pipeline; a compiled forward that fails once falls back to eager.
        Returns the pipeline that decoded: a lower rung's when decode descended."""
        while True:
            record.rung, record.dtype = loaded.rung, loaded.dtype_name
            record.compiled, record.settings = loaded.compiled, loaded.settings
            record.quantized = loaded.quantized
            record.scheduler = type(loaded.pipe.scheduler).__name__
            ran_before, graphs_before = bool(loaded.warm_shapes), graphs_compiled()
            cfg = cfg_active(loaded.manifest.family, request.guidance or 0.0, request.true_cfg)
            size = (request.width or 0, request.height or 0)
            loras = self._apply_loras(loaded, request, watch, record)
            mode = request.mode or "txt2img"
            novelty = loaded.novelty(*size, request.num_images, cfg, mode, loras)
            start = dev.allocated_bytes(self.info)
            try:
                images, decoded = generate(
                    loaded,
                    request,
                    ctx,
                    watch,
                    record,
                    info=self.info,
                    faults=self.faults,
                    store=self.store,
                    sources=sources,
                    decode=decode,
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
            loaded.adapter_sets.add(loras)
            if decoded is loaded:  # a decode retried a rung lower measured two pipelines
                self._measure(loaded, request, record, start)
            if loaded.compiled and ran_before and built:
                loaded.recompiles += built
                record.recompile_causes.append(f"{novelty}: {built} graph(s)")
            record.recompiles = loaded.recompiles
            return images, decoded

    def _apply_loras(
        self, loaded: LoadedPipeline, request: RenderRequest, watch: Stopwatch, record: TimingRecord
    ) -> frozenset[str]:
        """The request's adapters into the pipeline's slots at their weights (the load phase:
        it is the adapters' load), every slot the job does not use at 0."""
        choices = request.loras or []
        record.loras = list(choices)
        slots = loaded.adapters
        if slots is None:
            if choices:  # the manifest allowed none, and resolve_request said so at submit
                raise AdapterRefused(f"model {loaded.manifest.id}: this pipeline has no adapters")
            return frozenset()
        if choices and loaded.rung in ("partial", "group_offload") and self.info.streams:
            raise AdapterRefused(
                f"model {loaded.manifest.id}: loras at rung {loaded.rung} with CUDA streams:"
                " the offload keeps pinned copies of the weights it streams, which a hotswap"
                " would not reach; pin rung model_offload (KILN_MEMORY_MODE) to serve loras on"
                " this card"
            )
        if slots.differs(choices):
            with watch.phase("load"):
                slots.apply(choices)
        return frozenset(c.name for c in choices)

    def _make_room(self, manifest: Manifest, rung: Rung) -> None:
        """Evict least recently used pipelines until this rung's estimate fits."""
        need = int(rung_need_gb(manifest, rung, fit_for(manifest, self.info, self.settings)) * GB)
        free_now = int(self.usable_gb(reclaim=False) * GB)
        evicted = self.cache.evict_beyond(self.settings.max_resident, keep=manifest.id)
        evicted += self.cache.evict_lru_until(need, free_now, keep=manifest.id)
        if evicted:
            log.info("evicted %s to make room for %s at %s", evicted, manifest.id, rung)

    def _free(self, keep: str | None) -> None:
        """After an OOM: evict every other pipeline, collect garbage, empty the allocator cache."""
        self.cache.evict_others(keep=keep)
        release_memory(self.info)

    def _reclaim(self, watch: Stopwatch, keep: str) -> None:
        with watch.phase("load"):
            self._free(keep=keep)

    def _read_inputs(
        self, request: RenderRequest
    ) -> tuple[dict[str, Image.Image], list[InputDigest]]:
        """The inputs as the pipeline takes them (image, mask_image), and each one's sha256."""
        if request.image is None:
            return {}, []
        from worker.inputs import InputUnavailable, check_mask_size, load_input

        image = load_input(request.image, self._redis, self.store, self.settings)
        if image.image.size != (request.width, request.height):
            width, height = image.image.size
            raise InputUnavailable(
                f"image {short(request.image)}: is {width}x{height}, not the job's size"
                f" {request.width}x{request.height} (kiln never resizes an input)"
            )
        sources = {"image": image.image}
        inputs = [InputDigest(field="image", sha256=image.sha256)]
        if request.mask is not None:
            mask = load_input(request.mask, self._redis, self.store, self.settings, field="mask")
            check_mask_size(image.image, mask.image, request.mask)
            sources["mask_image"] = mask.image
            inputs.append(InputDigest(field="mask", sha256=mask.sha256))
        return sources, inputs

    @functools.cached_property
    def _redis(self) -> Redis:
        """Where uploaded inputs are read from: the worker's Redis, opened at the first one."""
        return connect(self.settings.redis_url)

    def _details(
        self,
        request: RenderRequest,
        loaded: LoadedPipeline,
        index: int,
        inputs: list[InputDigest],
    ) -> ImageDetails:
        """What image `index` of this job carries inside its file: enough to render it again."""
        return ImageDetails(
            kiln=kiln_version(),
            model=request.model,
            revision=loaded.manifest.revision,
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            seed=int(request.seed or 0),
            steps=int(request.steps or 0),
            guidance=float(request.guidance or 0.0),
            true_cfg=request.true_cfg,
            scheduler=type(loaded.pipe.scheduler).__name__,
            width=int(request.width or 0),
            height=int(request.height or 0),
            num_images=request.num_images,
            index=index,
            format=request.output_format,
            rung=loaded.rung,
            dtype=loaded.dtype_name,
            compiled=loaded.compiled,
            device=self.info.torch_device,
            quantized=dict(loaded.quantized),
            loras=[
                LoraWeight(name=c.name, weight=float(c.weight or 0.0)) for c in request.loras or []
            ],
            inputs=inputs,
            mode=request.mode or "txt2img",
            strength=request.strength,
        )

    def _result(
        self,
        request: RenderRequest,
        ctx: JobContext,
        loaded: LoadedPipeline,
        record: TimingRecord,
        files: list[Any],
        watch: Stopwatch,
        started_at: datetime,
        digest: str,
    ) -> RenderResult:
        return RenderResult(
            job_id=ctx.job_id,
            model=request.model,
            images=files,
            seed=int(request.seed or 0),
            steps=int(request.steps or 0),
            guidance=float(request.guidance or 0.0),
            true_cfg=request.true_cfg,
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
            request_sha256=digest,
        )


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


def _describe(record: TimingRecord, request: RenderRequest) -> None:
    """What the record needs to reproduce the job: the resolved request's numbers."""
    record.model, record.num_images, record.seed = request.model, request.num_images, request.seed
    record.steps, record.guidance, record.true_cfg = (
        request.steps,
        request.guidance,
        request.true_cfg,
    )
    record.width, record.height = request.width, request.height
    record.mode, record.strength = request.mode or "txt2img", request.strength


def _requested_model(payload: Any) -> str | None:
    """The model a raw payload names, if it names one; for records of jobs that fail early."""
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, str):
        return None
    # Bounded and encodable: it goes into the timing log and onto stdout, whatever it was.
    return str(short(model.encode("utf-8", "backslashreplace").decode()))


def _fatal(exc: BaseException, job_id: str) -> FatalWorkerError | None:
    """A device-lost error ends this worker, not just the job (no later job could succeed)."""
    if isinstance(exc, FatalWorkerError):
        return exc
    if device_lost(exc) and not is_oom(exc):
        return FatalWorkerError(f"the device was lost during job {job_id}: {exc}")
    return None
