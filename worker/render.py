"""Run one job from payload to result, in numbered steps: admit, validate, answer from disk,
choose a rung (or take the request's pins), load, generate under the ladder's out-of-memory
rules, save with the generation details inside each image. Every path out of
render() leaves exactly one timing record, created here and handed to the record listener.

Over 300 lines because the steps' helpers (load, reload, one attempt, the result) are the
callbacks the Ladder runs, and read best beside the steps that hand them over. Where a job runs
(memory, rung, measurements, eviction) is worker.placement's, a mixin of Renderer."""

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

from api_client.errors import short
from api_client.manifest import Manifest, check_servable, resolve_request
from api_client.schema import Attempt, RenderRequest, RenderResult, Rung, request_digest
from worker import device as dev
from worker import output
from worker.compile import graphs_compiled
from worker.context import JobContext
from worker.details import image_details
from worker.device import DeviceInfo
from worker.errors import (
    FatalWorkerError,
    JobStopped,
    LeaseLost,
    OutOfMemory,
    device_lost,
)
from worker.families import cfg_active
from worker.faults import FaultPlan
from worker.generate import DecodeRules, apply_loras, generate
from worker.inputs import read_inputs
from worker.ladder import GB, Ladder, RungChoice, RungMemory, is_oom
from worker.loading import load_pipeline, place_again, place_read
from worker.placement import Placement
from worker.prefetch import Prefetcher
from worker.resident import LoadedPipeline, PipelineCache
from worker.settings import Settings
from worker.store import Store, open_store
from worker.switches import compile_fell_back, compile_plan
from worker.timings import Stopwatch, TimingRecord, emit
from worker.webhooks import check_target

log = logging.getLogger(__name__)
RecordListener = Callable[[TimingRecord], None]


class Renderer(Placement):
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
        # Reads the next job's model into the RAM cache while a job renders; a queue worker
        # tells it what comes next (worker.prefetch).
        self.prefetcher = Prefetcher(self.cache, manifests, self.info, settings)
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
            sources, inputs = read_inputs(request, self._redis, self.store, self.settings)
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
                loaded = self._ensure_loaded(manifest, choice, pin, ladder, watch, record)
                _checkpoint(ctx, "after loading")
                self.prefetcher.after_load(manifest.id, ctx.job_id)
                # 4. Encode, denoise, decode; out of memory follows the ladder's rules, and one
                #    in decode keeps the latents (Ladder.decode: tiled, then a rung lower).
                reclaim = functools.partial(self._reclaim, watch, keep=manifest.id)
                reload = functools.partial(
                    self._reload,
                    manifest,
                    choice,
                    pin=pin,
                    ladder=ladder,
                    watch=watch,
                    record=record,
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
                details = [
                    image_details(request, loaded, i, inputs, self.info.torch_device)
                    for i in range(len(images))
                ]
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

    def _ensure_loaded(
        self,
        manifest: Manifest,
        choice: RungChoice,
        pin: bool | None,
        ladder: Ladder,
        watch: Stopwatch,
        record: TimingRecord,
    ) -> LoadedPipeline:
        """The resident pipeline at the chosen rung and compile state (the request's pin, else
        this worker's), else a load under the ladder's loading rules."""
        rung, full_need = choice.rung, choice.full_need_gb
        resident = self.cache.get(manifest.id)
        if resident is not None and self._serves(resident, rung, pin):
            return resident
        record.cold = True

        def load(at: Rung) -> LoadedPipeline:
            # Its read ahead, if one is in flight, then its RAM copy, before making room: the
            # pipelines evicted for it go into the RAM cache too, and must not push it out.
            self.prefetcher.wait_for(manifest.id)
            kept = self.cache.ram.take(manifest.id)
            self._make_room(manifest, at)
            # What a partial load splits its blocks by: memory now, and full's measured need.
            room = (self.usable_gb(reclaim=False), full_need)
            if kept is not None and (not kept.placed or self._serves(kept, at, pin)):
                record.load_source = "ram"
                if not kept.placed:  # read ahead, never placed: any rung's first placement
                    return place_read(kept, at, self.info, self.settings, self.faults, pin, *room)
                return place_again(kept, self.info, self.faults)
            if kept is not None:  # kept at another rung or compile state: not this job's
                self.cache.release(kept)
            record.load_source = "disk"
            return load_pipeline(manifest, at, self.info, self.settings, self.faults, pin, *room)

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
        choice: RungChoice,
        rung: Rung,
        pin: bool | None,
        ladder: Ladder,
        watch: Stopwatch,
        record: TimingRecord,
    ) -> LoadedPipeline:
        """After a second OOM while generating: the model again, one rung lower."""
        with watch.phase("load"):
            self.cache.evict(manifest.id, to_ram=False)
        lower = dataclasses.replace(choice, rung=rung)
        return self._ensure_loaded(manifest, lower, pin, ladder, watch, record)

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
            loras = apply_loras(loaded, request, watch, record, self.info.streams)
            mode = request.mode or "txt2img"
            novelty = loaded.novelty(*size, request.num_images, cfg, mode, loras)
            start, reads = dev.allocated_bytes(self.info), self.prefetcher.mark()
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
            # Not where a decode retried a rung lower (two pipelines), nor on a CPU beside a
            # read ahead (it grows the resident set a CPU job's peak is taken from).
            beside_read = self.info.torch_device == "cpu" and not self.prefetcher.quiet(reads)
            if decoded is loaded and not beside_read:
                self._measure(loaded, request, record, start)
            if loaded.compiled and ran_before and built:
                loaded.recompiles += built
                record.recompile_causes.append(f"{novelty}: {built} graph(s)")
            record.recompiles = loaded.recompiles
            return images, decoded

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
