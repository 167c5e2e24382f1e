"""Reading the next job's model into the RAM cache while a job renders (#18), as the Horde
worker preloads the next job's model, on kiln's RAM cache (worker.pipelines.resident.RamCache).

Once a job's pipeline is placed, the renderer asks its queues which model the job it pops next
is for (worker.queue.lanes.LaneOrder.upcoming_model: the first of its queues, in the next pop's lane
order, that holds a job). If that model is neither on the device nor in the RAM cache, one
thread reads it on the host (worker.pipelines.loading.read_pipeline: from_pretrained, quantization,
the switches, LoRA slots; nothing touches the device) and keeps it in the RAM cache, never placed.
The next job takes it from there (load_source `ram`) and places it on whatever rung its ladder
chooses (worker.pipelines.loading.place_read); a job that comes while its model is still being read
waits for that read instead of reading it a second time.

KILN_PREFETCH=auto reads ahead where the device is not the host's own CPU (off_reason); on and
off force it. A read is skipped, with the reason logged, when the RAM cache is off
(KILN_RAM_CACHE_GB=0), when the weights as loaded would not fit its bound or the host's
available memory (estimated from the safetensors headers before anything is read), when the
model is in no local directory and not in the hub cache (a worker pulls at start; a read ahead
never downloads), or while another read runs. A failed read costs a log line: the job then
loads the model itself and fails there with the same error, in its own record.

A read competes with the render it overlaps for the host's cores, disk and Python's GIL: on a
GPU box the host mostly waits on the card during a denoise; on a CPU device it never idles. On
a CPU device the read also grows the process's resident set, which is what a job's peak is
measured from there, so a CPU job a read overlapped leaves no measurement
(worker.render.placement)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from api_client.manifest import Manifest
from api_client.model_files import is_single_file
from worker.manifest import weights_source
from worker.memory.device import DeviceInfo
from worker.pipelines.loading import choose_dtype, read_pipeline
from worker.pipelines.resident import LoadedPipeline, PipelineCache, host_bytes
from worker.settings import Settings

log = logging.getLogger(__name__)

HOST_MARGIN = 1.25  # a read needs its estimate times this in available host memory
_FLOAT_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


@dataclass
class Read:
    """One read ahead: in flight while its thread runs, then done (kept or not)."""

    model_id: str
    beside_job: str
    seconds: float = 0.0
    outcome: str = "reading"  # reading | kept | failed: ... | not kept: ...
    done: threading.Event = field(default_factory=threading.Event)


class Prefetcher:
    """The renderer's reads ahead: at most one in flight, into its pipeline cache's RAM cache."""

    def __init__(
        self,
        cache: PipelineCache,
        manifests: dict[str, Manifest],
        info: DeviceInfo,
        settings: Settings,
        upcoming: Callable[[], str | None] | None = None,
    ) -> None:
        self.cache = cache
        self.manifests = manifests
        self.info = info
        self.settings = settings
        # The model of the job its runner pops next; None where no queue is behind the renderer.
        self.upcoming = upcoming
        self.latest: Read | None = None
        self.started = 0  # reads started, ever: a job compares it before and after itself
        self.off = off_reason(settings, info)  # why this worker never reads ahead; None: it does
        self._estimates: dict[str, int | None] = {}  # read_estimate per model, once
        self._told: set[str] = set()  # reasons not to read already logged, each said once
        if self.off is not None:
            log.info("prefetch: off: %s", self.off)

    def after_load(self, current: str, job_id: str) -> Read | None:
        """Once the job's pipeline is placed: start reading the next job's model, if it needs a
        read (the module docstring's rules). Never raises: a read ahead is a hint."""
        if self.off is not None or self.upcoming is None or self.busy():
            return None
        try:
            model_id = self.upcoming()
        except Exception as exc:  # a queue it cannot ask costs the hint, not the job
            log.warning("prefetch: could not see the next job's model: %s", exc)
            return None
        if model_id is None or model_id == current or model_id not in self.manifests:
            return None
        if model_id in self.cache.model_ids() or model_id in self.cache.ram.model_ids():
            return None
        try:
            why_not = self._why_not(self.manifests[model_id])
        except Exception as exc:  # weights it cannot size (a bad header): its job will say
            why_not = f"cannot size its weights: {type(exc).__name__}: {exc}"
        if why_not is not None:
            if f"{model_id}: {why_not}" not in self._told:
                self._told.add(f"{model_id}: {why_not}")
                log.info("prefetch: not reading %s ahead: %s", model_id, why_not)
            return None
        read = Read(model_id, beside_job=job_id)
        self.latest = read
        self.started += 1
        name = f"kiln-prefetch-{model_id}"
        threading.Thread(target=self._read, args=(read,), name=name, daemon=True).start()
        log.info("prefetch: reading %s ahead beside job %s", model_id, job_id)
        return read

    def busy(self) -> bool:
        return self.latest is not None and not self.latest.done.is_set()

    def reading(self) -> str | None:
        """The model being read ahead now, for the worker's published state (`kiln top`)."""
        read = self.latest
        return read.model_id if read is not None and not read.done.is_set() else None

    def mark(self) -> int:
        """Before a job's work: what quiet() compares against (-1 while a read runs)."""
        return -1 if self.busy() else self.started

    def quiet(self, mark: int) -> bool:
        """No read ran at any moment since mark."""
        return mark == self.started and not self.busy()

    def wait_for(self, model_id: str) -> None:
        """Before a load of model_id: wait for its read, if one is in flight (the pipeline is
        then in the RAM cache, unless the read failed); the wait counts in the load phase."""
        read = self.latest
        if read is None or read.model_id != model_id or read.done.is_set():
            return
        started = time.perf_counter()
        read.done.wait()
        log.info("prefetch: waited %.2f s for %s's read", time.perf_counter() - started, model_id)

    def _why_not(self, manifest: Manifest) -> str | None:
        if manifest.family_row.weights_files:
            return "an upscaler is a file of tens of MB, read when its job comes"
        bound = self.cache.ram.bound_bytes
        if bound <= 0:
            return "the RAM cache is off (KILN_RAM_CACHE_GB=0)"
        if manifest.id not in self._estimates:  # headers read once, not before every job
            self._estimates[manifest.id] = read_estimate(manifest, self.info, self.settings)
        estimate = self._estimates[manifest.id]
        if estimate is None:
            return "its weights are in no local directory and not in the hub cache (kiln pull)"
        takes = f"its weights take about {estimate / 1e9:.2f} GB on the host"
        if estimate > bound:
            return f"{takes}, over the RAM cache's {bound / 1e9:.2f} GB (KILN_RAM_CACHE_GB)"
        available = psutil.virtual_memory().available
        if estimate * HOST_MARGIN > available:
            return f"{takes}, and the host has {available / 1e9:.2f} GB available"
        return None

    def _read(self, read: Read) -> None:
        """The thread: read, then keep in the RAM cache; done is set whatever happens, since a
        job of this model waits for it."""
        # Half the intra-op threads (OpenMP's count is per thread): the render keeps its own.
        torch.set_num_threads(max(torch.get_num_threads() // 2, 1))
        started = time.perf_counter()
        try:
            loaded = read_pipeline(self.manifests[read.model_id], self.info, self.settings)
            read.seconds = time.perf_counter() - started
            _note(loaded, read)
            size = host_bytes(loaded.pipe)
            kept = self.cache.ram.keep(loaded, size)
            read.outcome = "kept" if kept else f"not kept: {size} bytes over the cache's bound"
            if not kept:
                self.cache.release(loaded)
            log.info("prefetch: read %s in %.2f s, %s", read.model_id, read.seconds, read.outcome)
        except Exception as exc:
            read.outcome = f"failed: {type(exc).__name__}: {exc}"
            log.warning(
                "prefetch: reading %s failed (its job will load it itself): %s", read.model_id, exc
            )
        finally:
            read.done.set()


def off_reason(settings: Settings, info: DeviceInfo) -> str | None:
    """KILN_PREFETCH: on, off, or auto, which reads ahead unless the device is the host's own
    CPU (a profile's card included: its tensors are on the CPU). There the read takes the cores
    the render runs on: bench/switches.py measured loads 4x shorter and the queue 28-32 %
    longer, six tiny models in turn on 2 cores."""
    if settings.prefetch == "off":
        return "switched off (KILN_PREFETCH=off)"
    if settings.prefetch == "auto" and info.torch_device == "cpu":
        return "auto: the device is this host's CPU, where a read takes the render's cores"
    return None


def _note(loaded: LoadedPipeline, read: Read) -> None:
    loaded.settings.add(
        "applied",
        "prefetch",
        f"read from disk in {read.seconds:.2f} s while job {read.beside_job} rendered",
    )


def read_estimate(manifest: Manifest, info: DeviceInfo, settings: Settings) -> int | None:
    """Host bytes the model's weights take once read, before reading them: every tensor in the
    safetensors files its pipeline loads (their headers only), floating ones at the dtype it
    loads in, before quantization (so an upper bound where the manifest quantizes); None when
    the weights are neither local nor in the hub cache."""
    if manifest.components or is_single_file(manifest.source):
        return None  # one checkpoint file or a component's own (GGUF): no estimate yet
    source = weights_source(manifest, settings.models_dir)
    if source.local:
        folder: Path | None = Path(source.location)
        patterns = ["*/*.safetensors"]
    else:
        from worker.pipelines.pull import fetches, present

        folder = present(fetches(manifest, settings.models_dir)[0])  # the pipeline's own
        variant = manifest.variant
        patterns = (
            [f"*/*.{variant}.safetensors", f"*/*.{variant}-*.safetensors"]
            if variant
            else ["*/*.safetensors"]
        )
    if folder is None:
        return None
    itemsize = choose_dtype(manifest, info)[0].itemsize
    files = {path for pattern in patterns for path in folder.glob(pattern)}
    if not manifest.variant or source.local:  # another variant's files are not loaded
        files = {path for path in files if "." not in path.name.removesuffix(".safetensors")}
    return sum(_loaded_bytes(path, itemsize) for path in files)


def _loaded_bytes(path: Path, itemsize: int) -> int:
    """A safetensors file's tensors as loaded: its header is 8 bytes of length, then JSON."""
    with path.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    total = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        start, end = tensor["data_offsets"]
        width = _FLOAT_BYTES.get(tensor["dtype"])
        total += (end - start) // width * itemsize if width else end - start
    return total
