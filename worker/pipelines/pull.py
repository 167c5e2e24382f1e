"""Weights before jobs: which files each manifest needs from the Hugging Face hub (only its
variant and the components the pipeline loads), whether they are in the cache, and `kiln pull`,
which fetches what is missing through huggingface_hub into the usual cache (HF_HOME).

A worker checks the same at start and pulls what is missing before it takes a job, so no job
timeout ever covers a multi-GB download. HF_HUB_OFFLINE=1 is honoured: nothing is fetched, and
a missing model is named with the command that fetches it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from api_client.manifest import Manifest
from api_client.model_files import is_single_file
from worker.manifest import weights_source
from worker.pipelines.families import spec_for
from worker.pipelines.single_file import hub_file_parts

log = logging.getLogger(__name__)

# Everything a pipeline component holds besides weights: configs, tokenizers, scheduler, and
# the chat templates newer tokenizers keep beside their config (Qwen3's, for FLUX.2 and Z-Image).
_COMPONENT_FILES = ("json", "txt", "model", "jinja")
# Single-file and framework copies the pipeline never reads; the safety checker kiln drops.
_NEVER = ["*.bin", "*.ckpt", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.pb"]
_VAE_FILES = ["config.json", "diffusion_pytorch_model.safetensors"]


class PullError(RuntimeError):
    """Weights kiln cannot get; the message is one line naming the repository and what to do."""


@dataclass(frozen=True)
class Fetch:
    """One repository to fetch and the files of it a model needs."""

    model: str
    repo: str
    revision: str | None
    allow_patterns: list[str]
    ignore_patterns: list[str] = field(default_factory=list)
    marker: str = "model_index.json"
    configs_only: bool = False  # a single file's config repository: its configs and tokenizers


def fetches(manifest: Manifest, models_dir: Path) -> list[Fetch]:
    """The hub repositories manifest needs (pipeline, vae, taesd, loras, controlnets, the
    IP-Adapter and its image encoder); local sources must exist, else FileNotFoundError names
    the path and the command that builds it."""
    wanted: list[Fetch] = []
    if manifest.family_row.weights_files:  # one file: on this disk, or owner/repo/file on the hub
        from worker.pipelines.upscale import hub_file

        found = hub_file(manifest, models_dir)
        if isinstance(found, Path):
            return []
        repo, name = found
        return [Fetch(manifest.id, repo, manifest.revision, [name], marker=name)]
    wanted += _pipeline_fetches(manifest, models_dir)
    for extra in (manifest.vae, manifest.taesd):
        if extra is None:
            continue
        where = weights_source(manifest, models_dir, extra, marker="config.json")
        if not where.local:
            wanted.append(Fetch(manifest.id, extra, None, _VAE_FILES, marker="config.json"))
    for lora in manifest.loras.values():
        if lora.is_file:  # a kohya / A1111 file: on this disk, or owner/repo/file on the hub
            wanted += _file_fetches(manifest, models_dir, [(lora.source, lora.revision)])
            continue
        where = weights_source(manifest, models_dir, lora.source, marker=lora.weight_name)
        if not where.local:
            files = [lora.weight_name]
            wanted.append(Fetch(manifest.id, lora.source, lora.revision, files, marker=files[0]))
    checkpoints = {(c.source, c.subfolder, c.revision) for c in manifest.controlnets.values()}
    for repo, subfolder, revision in sorted(checkpoints, key=str):
        marker = config_marker(subfolder)
        if not weights_source(manifest, models_dir, repo, marker=marker).local:
            prefix = f"{subfolder}/" if subfolder else ""
            # One checkpoint, whole or sharded (never a repository's other weights, as
            # xinsir's ProMax file beside its union ControlNet).
            weights = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model-*")
            files = [marker, *(prefix + name for name in (*weights, f"{weights[0]}.index.json"))]
            wanted.append(Fetch(manifest.id, repo, revision, files, marker=marker))
    wanted += _ip_adapter_fetches(manifest, models_dir)
    return wanted


def _pipeline_fetches(manifest: Manifest, models_dir: Path) -> list[Fetch]:
    """The pipeline's own weights: a diffusers layout, or one checkpoint file and the configs
    and tokenizers its config repository holds; and each component's own file."""
    own = [(c.file, c.revision) for c in manifest.components.values()]
    if not is_single_file(manifest.source):
        source = weights_source(manifest, models_dir)
        layout = [] if source.local else [_pipeline_fetch(manifest)]
        return layout + _file_fetches(manifest, models_dir, own)
    wanted = _file_fetches(manifest, models_dir, [(manifest.source, manifest.revision), *own])
    assert manifest.config is not None  # the manifest's rule for a single-file source
    if not weights_source(manifest, models_dir, manifest.config).local:
        configs = ["model_index.json", *(f"*/*.{ext}" for ext in _COMPONENT_FILES)]
        wanted.append(Fetch(manifest.id, manifest.config, None, configs, configs_only=True))
    return wanted


def _file_fetches(
    manifest: Manifest, models_dir: Path, files: list[tuple[str, str | None]]
) -> list[Fetch]:
    """Files a manifest names one by one (a single-file checkpoint, a component's file, a kohya
    LoRA): none for a file on this disk, else its repository and the file in it."""
    wanted = []
    for name, revision in files:
        found = hub_file_parts(name, models_dir)
        # Under a directory that is here (tiny-sd15/loras/x.safetensors), a missing file is a
        # local one, not owner/repo/file on the hub: say so rather than ask the hub for it.
        if found is None or (models_dir / Path(name).parts[0]).is_dir():
            path = Path(name).expanduser()
            path = path if path.is_absolute() else models_dir / path
            if not path.is_file():
                raise FileNotFoundError(
                    f"model {manifest.id}: {name!r} is no file at {path}, nor owner/repo/file on"
                    " the hub" + (" (build it: `kiln tiny-models`)" if "tiny-" in name else "")
                )
            continue
        repo, filename = found
        wanted.append(Fetch(manifest.id, repo, revision, [filename], marker=filename))
    return wanted


def _ip_adapter_fetches(manifest: Manifest, models_dir: Path) -> list[Fetch]:
    """The IP-Adapter's weights file and its image encoder's folder, one fetch a repository
    (h94/IP-Adapter holds both)."""
    adapter = manifest.ip_adapter
    if adapter is None:
        return []
    encoder = adapter.image_encoder
    config = config_marker(encoder.subfolder)
    parts = [
        (
            adapter.source,
            adapter.revision,
            ["/".join(filter(None, (adapter.subfolder, adapter.weight_name)))],
        ),
        (
            encoder.source,
            encoder.revision,
            [config, config.replace("config.json", "model.safetensors")],
        ),
    ]
    by_repo: dict[tuple[str, str | None], list[str]] = {}
    for repo, revision, files in parts:
        if not weights_source(manifest, models_dir, repo, marker=files[0]).local:
            by_repo.setdefault((repo, revision), []).extend(files)
    return [
        Fetch(manifest.id, repo, revision, files, marker=files[0])
        for (repo, revision), files in by_repo.items()
    ]


def config_marker(subfolder: str | None) -> str:
    """The file a model's folder holds (its config: a ControlNet's, an image encoder's), under
    its subfolder."""
    return f"{subfolder}/config.json" if subfolder else "config.json"


def _pipeline_fetch(manifest: Manifest, components: list[str] | None = None) -> Fetch:
    """The files of the pipeline's components (all folders until model_index.json is read):
    never the single-file checkpoints at the top of a repository, nor other variants."""
    # The components the family loads without (FamilySpec.dropped: SD's safety checker).
    ignore = [*_NEVER, *(f"{name}/*" for name in spec_for(manifest).dropped)]
    variant = manifest.variant
    allow = ["model_index.json"]
    for folder in components or ["*"]:
        allow += [f"{folder}/*.{ext}" for ext in _COMPONENT_FILES]
        if folder in manifest.components:
            continue  # read from its own file: its config only
        if variant:
            # diffusers names variant weights x.fp16.safetensors, shards x.fp16-00001-of-00002.
            allow += [f"{folder}/*.{variant}.safetensors", f"{folder}/*.{variant}-*.safetensors"]
        else:
            allow.append(f"{folder}/*.safetensors")
    if not variant:
        ignore.append("*/*.*.safetensors")  # every variant of every weight file
    return Fetch(manifest.id, manifest.source, manifest.revision, allow, ignore)


def pipeline_components(index: dict[str, object]) -> list[str]:
    """The component folders a model_index.json names (those set to null are not loaded)."""
    return [
        name
        for name, value in index.items()
        if not name.startswith("_") and isinstance(value, list) and value[0] is not None
        if name != "safety_checker"
    ]


def narrowed(fetch: Fetch, manifest: Manifest) -> Fetch:
    """A pipeline fetch limited to the components its model_index.json names (fetched first,
    a few hundred bytes); other fetches as they are."""
    import json

    from huggingface_hub import hf_hub_download

    if fetch.marker != "model_index.json" or fetch.configs_only:
        return fetch
    index = hf_hub_download(
        fetch.repo, "model_index.json", revision=fetch.revision, cache_dir=_cache_dir()
    )
    components = pipeline_components(json.loads(Path(index).read_text(encoding="utf-8")))
    return _pipeline_fetch(manifest, components)


def present(fetch: Fetch) -> Path | None:
    """The cached snapshot holding fetch's files, or None; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(
            snapshot_download(
                fetch.repo,
                revision=fetch.revision,
                allow_patterns=fetch.allow_patterns,
                ignore_patterns=fetch.ignore_patterns,
                local_files_only=True,
                cache_dir=_cache_dir(),
            )
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None
    return folder if _complete(folder, fetch.marker) else None


def _complete(folder: Path, marker: str) -> bool:
    """The marker is there and, for a pipeline, a directory for every component it names."""
    import json

    index = folder / marker
    if not index.is_file():
        return False
    if marker != "model_index.json":
        return True
    try:
        components = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return all((folder / name).is_dir() for name in pipeline_components(components))


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def pull(
    manifests: dict[str, Manifest],
    models_dir: Path,
    say: Callable[[str], None] = print,
) -> list[str]:
    """Fetch every missing repository of these manifests; the models pulled.

    PullError (one line) for a gated repository, a missing local directory, or a missing
    model while HF_HUB_OFFLINE is set."""
    pulled: list[str] = []
    for manifest in manifests.values():
        try:
            wanted = fetches(manifest, models_dir)
        except FileNotFoundError as exc:
            raise PullError(str(exc)) from None
        for fetch in wanted:
            if present(fetch) is not None:
                say(f"{manifest.id}: {fetch.repo} already in the cache")
                continue
            if offline():
                raise PullError(
                    f"model {manifest.id}: {fetch.repo} is not in the Hugging Face cache"
                    f" ({_cache_dir()}) and HF_HUB_OFFLINE is set; run"
                    f" `kiln pull --models {manifest.id}` where the hub is reachable"
                )
            _download(fetch, manifest, say)
            if manifest.id not in pulled:
                pulled.append(manifest.id)
    return pulled


def _download(fetch: Fetch, manifest: Manifest, say: Callable[[str], None]) -> None:
    """snapshot_download with its progress bar, the gated case as one line."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        fetch = narrowed(fetch, manifest)
        say(f"{manifest.id}: fetching {fetch.repo} ({', '.join(fetch.allow_patterns)})")
        snapshot_download(
            fetch.repo,
            revision=fetch.revision,
            allow_patterns=fetch.allow_patterns,
            ignore_patterns=fetch.ignore_patterns,
            cache_dir=_cache_dir(),
        )
    except GatedRepoError:
        raise PullError(
            f"model {fetch.model}: {fetch.repo} is gated: accept its licence at"
            f" https://huggingface.co/{fetch.repo} and set HF_TOKEN to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise PullError(
            f"model {fetch.model}: no repository {fetch.repo} on the hub (or it is private:"
            " set HF_TOKEN)"
        ) from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PullError(
            f"model {fetch.model}: could not fetch {fetch.repo} from the hub ({reason})"
        ) from None


def missing(manifests: dict[str, Manifest], models_dir: Path) -> dict[str, str]:
    """Models whose weights are not here, with why; checks the cache only."""
    gaps: dict[str, str] = {}
    for manifest in manifests.values():
        try:
            wanted = fetches(manifest, models_dir)
        except FileNotFoundError as exc:
            gaps[manifest.id] = str(exc)
            continue
        absent = [f.repo for f in wanted if present(f) is None]
        if absent:
            gaps[manifest.id] = f"not in the Hugging Face cache: {', '.join(absent)}"
    return gaps


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
