"""The fleet's compile cache: the files one worker's torch.compile wrote into its Inductor cache
directory, shared through Redis as a bundle per compile key, so a replica with an empty local
cache unpacks them and loads instead of compiling again (issue 29).

Why files and not torch's own remote caches. Measured on tiny-sd15 (CPU, torch 2.13, regional
compile, one 128x128 job): cold 27.4 s; torch's Mega-Cache (save/load_cache_artifacts) carries
the FX graph and AOTAutograd entries but not the C++ kernels they load, so a fresh process that
loaded it still spent 17.7 s building them; the files Inductor wrote (FX graph and AOTAutograd
entries, kernel sources and the shared objects built from them, and Triton's kernels on a GPU,
which live under the same directory) made a fresh directory as good as the one that compiled:
3.3 s, the same pixels. torch's Redis remote cache has no bound and no lifetime.

Keys. A bundle is found by the digest of its CompileKey (torch build, the real device's name,
the model's weights, dtype, rung, compile method and the job's shape); its header repeats the
key, and a header that differs from the job's is never unpacked. Inside, torch's own cache keys
still decide what is used, so a bundle can only ever miss, never supply wrong code.

Trust. A bundle holds shared objects a worker loads and runs: only workers may read or write the
`kiln-fleet:` keys (docs/fleet.md, Redis ACLs); the gateway's and clients' users are not given them.

Bounds. Each bundle lives KILN_COMPILE_CACHE_TTL_S from its last use; together they hold at most
KILN_COMPILE_CACHE_MB, the least recently used dropped first (0 turns sharing off)."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import platform
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Literal

from redis import Redis

if TYPE_CHECKING:
    from worker.pipelines.resident import LoadedPipeline

log = logging.getLogger(__name__)

PREFIX = "kiln-fleet:compile:"  # outside kiln:* so a client's ACL (~kiln:*) never reaches it
INDEX_KEY = "kiln-fleet:compile-index"  # sorted set: bundle digest -> last used (unix s)
SIZES_KEY = "kiln-fleet:compile-sizes"  # hash: bundle digest -> bytes
FORMAT = 1  # the bundle layout; a header of another format is not unpacked

CompileSource = Literal["cold", "local", "fleet"]


@dataclass(frozen=True)
class CompileKey:
    """What a compiled job's code depends on beyond what torch keys itself: the same key on
    another worker means the same graphs, so its files are worth unpacking."""

    torch: str  # version and git revision of the torch build
    device: str  # the real device's name (a CUDA card's, or the CPU's model), not a profile's
    model: str  # manifest id and its weights (source, revision, variant)
    dtype: str
    rung: str
    method: str  # regional, regional forwards or whole, and Dynamo's dynamic= setting
    shape: str  # width x height, batch, guidance on/off, mode, adapters or none

    @property
    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:40]


@functools.cache
def torch_build() -> str:
    import torch

    return f"{torch.__version__}+{getattr(torch.version, 'git_version', 'unknown')[:12]}"


@functools.cache
def device_name(torch_device: str) -> str:
    """The card's name on CUDA, else the CPU's model: C++ kernels are built for the host's ISA."""
    if torch_device.startswith("cuda"):
        import torch

        return str(torch.cuda.get_device_name(torch.device(torch_device)))
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            names = (ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name"))
            model = next(names, model)
    except OSError:
        pass
    return f"{torch_device}: {model}"


def compile_key(
    loaded: LoadedPipeline,
    torch_device: str,
    shape: tuple[int, int, int],
    *,
    cfg: bool,
    mode: str,
    adapters: bool,
) -> CompileKey:
    """The key of a job on a compiled pipeline: shape is (width, height, images)."""
    from worker.pipelines import compile as kiln_compile

    m = loaded.manifest
    note = next((n.reason for n in loaded.settings.applied if n.name == "compile"), "")
    quantized = ",".join(f"{c}={s}" for c, s in sorted(loaded.quantized.items()))
    width, height, count = shape
    return CompileKey(
        torch=torch_build(),
        device=device_name(torch_device),
        model=f"{m.id} {m.source}@{m.revision or '-'} variant={m.variant or '-'} q={quantized}",
        dtype=loaded.dtype_name,
        rung=loaded.rung,
        method=f"{note.split(':')[0] if note else '?'} dynamic={kiln_compile.DYNAMIC}",
        shape=(
            f"{width}x{height} x{count} cfg={'on' if cfg else 'off'} {mode}"
            f" {'adapters' if adapters else 'plain'}"
        ),
    )


@dataclass
class _Counts:
    seconds: float
    misses: int

    @classmethod
    def now(cls) -> _Counts:
        """Dynamo's whole-compile time so far, and graphs Inductor could not take from a cache."""
        try:
            from torch._dynamo.utils import compilation_time_metrics, counters
        except ImportError:
            return cls(0.0, 0)
        seconds = sum(compilation_time_metrics.get("_compile.compile_inner", []))
        inductor = counters["inductor"]
        return cls(seconds, inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"])


@dataclass
class CompileRun:
    """One job's compile accounting: seconds Dynamo spent, and where the code came from; and
    what CompileCache.finish needs to share what the job compiled."""

    key: CompileKey | None
    counts: _Counts
    fetched: bool = False  # a fleet bundle was unpacked for this job
    seconds: float = 0.0
    source: CompileSource | None = None  # None: the job compiled nothing
    files_before: set[str] = field(default_factory=set)
    bundle: list[str] | None = None  # the files of the key's bundle, when it had one


@dataclass
class CompileCache:
    """One worker's side of the fleet's compile cache. connection None (or limit 0): nothing is
    shared, and jobs still say how long they compiled and whether from the local cache."""

    connection: Redis | None
    limit_bytes: int
    ttl_s: int
    root: Path | None = None  # the Inductor cache directory; None: torch's own choice
    seen: set[str] = field(default_factory=set)  # keys this process has compiled or unpacked

    @property
    def sharing(self) -> bool:
        return self.connection is not None and self.limit_bytes > 0

    @property
    def directory(self) -> Path:
        if self.root is not None:
            return self.root
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return Path(cache_dir())

    def start(self, key: CompileKey | None) -> CompileRun:
        """Before one try of a job (key None: an uncompiled pipeline). The first time this
        process meets a key, the files of its fleet bundle that the local cache lacks."""
        first = key is not None and key.digest not in self.seen and self.sharing
        run = CompileRun(key, _Counts.now())
        if key is not None and first:
            run.files_before = _files(self.directory)
            try:
                run.bundle = self._fetch(key, run)
            except Exception as exc:  # the cache saves time; it never fails a job
                log.warning("compile bundle for %s not read: %s: %s", key.model, _kind(exc), exc)
            run.counts = _Counts.now()
        return run

    def finish(self, run: CompileRun) -> None:
        """After the try: how long it compiled and from where; what it compiled afresh, shared."""
        after = _Counts.now()
        run.seconds = round(after.seconds - run.counts.seconds, 3)
        if run.key is None or run.seconds <= 0:
            return
        missed = after.misses > run.counts.misses
        run.source = "cold" if missed else "fleet" if run.fetched else "local"
        if missed and self.sharing and run.key.digest not in self.seen:
            try:
                self._share(run.key, _files(self.directory) - run.files_before, run.bundle)
            except Exception as exc:  # as in start: a bundle not shared costs a later compile
                log.warning(
                    "compile bundle of %s not shared: %s: %s", run.key.model, _kind(exc), exc
                )
        self.seen.add(run.key.digest)

    def stats(self) -> dict[str, int]:
        """The shared cache as `kiln doctor` shows it: bundles alive and their bytes."""
        if self.connection is None:
            return {"entries": 0, "bytes": 0}
        sizes = _sizes(self.connection)
        alive = [d for d in sizes if self.connection.exists(PREFIX + d)]
        return {"entries": len(alive), "bytes": sum(sizes[d] for d in alive)}

    # -- the bundles ----------------------------------------------------------------------------

    def _fetch(self, key: CompileKey, run: CompileRun) -> list[str] | None:
        """Unpack the files of key's bundle that the local cache lacks; its file list, or None
        when there is no bundle (or one this worker must not trust)."""
        assert self.connection is not None
        name = PREFIX + key.digest
        header = self.connection.hget(name, "meta")
        if header is None:
            return None
        meta = json.loads(header)
        if not isinstance(meta, dict) or not isinstance(meta.get("files"), list):
            log.warning("compile bundle %s: its header is not kiln's; not unpacked", name)
            return None
        if meta.get("format") != FORMAT or meta.get("key") != asdict(key):
            log.warning("compile bundle %s: its header names another key; not unpacked", name)
            return None
        files: list[str] = meta["files"]
        if not all(_inside(f) for f in files):
            log.warning("compile bundle %s names a file outside the cache; not unpacked", name)
            return None
        self._touch(key.digest)
        missing = [f for f in files if not (self.directory / f).exists()]
        if not missing:
            return files
        blob = self.connection.hget(name, "tar")
        if not isinstance(blob, bytes) or hashlib.sha256(blob).hexdigest() != meta["sha256"]:
            log.warning("compile bundle %s: its bytes do not match its header; not unpacked", name)
            return None
        _unpack(blob, self.directory, set(missing))
        run.fetched = True
        return files

    def _share(self, key: CompileKey, new: set[str], bundle: list[str] | None) -> None:
        """The files this key's compile wrote, with the bundle's earlier ones, as its bundle."""
        assert self.connection is not None
        names = sorted(new | {f for f in bundle or [] if (self.directory / f).is_file()})
        if not new or not names:
            return
        blob = _pack(self.directory, names)
        if len(blob) > self.limit_bytes:
            log.warning(
                "compile bundle of %s is %d bytes, over KILN_COMPILE_CACHE_MB; not shared",
                key.model,
                len(blob),
            )
            return
        meta = {
            "format": FORMAT,
            "key": asdict(key),
            "files": names,
            "sha256": hashlib.sha256(blob).hexdigest(),
        }
        name = PREFIX + key.digest
        with self.connection.pipeline(transaction=True) as pipe:
            pipe.hset(name, mapping={"meta": json.dumps(meta), "tar": blob})
            pipe.expire(name, self.ttl_s)
            pipe.zadd(INDEX_KEY, {key.digest: time.time()})
            pipe.hset(SIZES_KEY, key.digest, len(blob))
            pipe.execute()
        self._trim()

    def _touch(self, digest: str) -> None:
        assert self.connection is not None
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.expire(PREFIX + digest, self.ttl_s)
            pipe.zadd(INDEX_KEY, {digest: time.time()})
            pipe.execute()

    def _trim(self) -> None:
        """Expired bundles out of the index; then the least recently used until under the limit."""
        assert self.connection is not None
        conn = self.connection
        sizes = _sizes(conn)
        total = 0
        for raw in conn.zrange(INDEX_KEY, 0, -1)[::-1]:  # newest first: the ones kept
            digest = _text(raw)
            size = sizes.get(digest, 0)
            if conn.exists(PREFIX + digest) and total + size <= self.limit_bytes:
                total += size
                continue
            with conn.pipeline(transaction=True) as pipe:
                pipe.delete(PREFIX + digest)
                pipe.zrem(INDEX_KEY, digest)
                pipe.hdel(SIZES_KEY, digest)
                pipe.execute()


def _kind(exc: Exception) -> str:
    return type(exc).__name__


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _sizes(conn: Redis) -> dict[str, int]:
    return {_text(d): int(_text(b)) for d, b in conn.hgetall(SIZES_KEY).items()}


def _files(root: Path) -> set[str]:
    """Every finished file under the cache directory, relative and in POSIX form: not Inductor's
    lock files nor its temporary files (written under a dotted name, then renamed)."""
    found: set[str] = set()
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "locks" and not d.startswith(".")]
        for name in names:
            if name.startswith(".") or name.endswith((".lock", ".tmp")):
                continue
            found.add(Path(folder, name).relative_to(root).as_posix())
    return found


def _inside(name: str) -> bool:
    """A relative path that stays under the cache directory."""
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def _pack(root: Path, names: list[str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for name in names:
            tar.add(root / name, arcname=name, recursive=False)
    return buffer.getvalue()


def _unpack(blob: bytes, root: Path, wanted: set[str]) -> None:
    """Only regular files the header listed, only under root, written whole (a temporary name,
    then a rename) so a worker beside this one on the same directory never reads half a file."""
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for member in tar.getmembers():
            if member.name not in wanted or not member.isfile() or not _inside(member.name):
                continue
            target = root / member.name
            if target.exists():
                continue
            source = tar.extractfile(member)
            assert source is not None
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            partial.write_bytes(source.read())
            os.chmod(partial, member.mode & 0o755)
            os.replace(partial, target)
