"""Manifests on the worker side: load and check a directory, find the weights, publish to Redis."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from redis import Redis

from api_client import keys
from api_client.errors import Problem
from api_client.manifest import Manifest, ManifestDirs, ManifestInvalid, load_manifest_dir
from worker.errors import ManifestDirectoryInvalid


def load_manifests(
    directory: Path | Iterable[Path], only: list[str] | None = None
) -> dict[str, Manifest]:
    """All manifests in directory, or in each directory in order (settings.manifests: the shipped
    ones, then KILN_MANIFESTS's, a later one replacing an earlier one of the same id); or
    ManifestDirectoryInvalid naming each problem in each file, and each directory not found."""
    dirs = [directory] if isinstance(directory, Path) else list(directory)
    manifests, failures = load_manifest_dir(dirs)
    if failures:
        raise ManifestDirectoryInvalid(failures)
    if only:
        unknown = sorted(set(only) - set(manifests))
        if unknown:
            problems = [
                Problem("model", model_id, "no manifest with this id") for model_id in unknown
            ]
            where = Path(str(ManifestDirs(dirs)))  # every directory read, as KILN_MANIFESTS
            raise ManifestDirectoryInvalid([ManifestInvalid(where, problems)])
        manifests = {model_id: manifests[model_id] for model_id in only}
    return manifests


@dataclass(frozen=True)
class WeightsSource:
    """Where from_pretrained reads: a local directory, or a hub id (with revision and variant)."""

    location: str
    local: bool


def weights_source(
    manifest: Manifest,
    models_dir: Path,
    source: str | None = None,
    marker: str = "model_index.json",
) -> WeightsSource:
    """Where the manifest's source (or another of its weights, e.g. taesd) lives.

    A source without a slash, or an absolute or ./ path, is a local directory under models_dir;
    otherwise a directory there of that name if it holds marker, else a hub id.
    """
    source = source if source is not None else manifest.source
    as_path = Path(source).expanduser()
    if as_path.is_absolute() or source.startswith(("./", "../")) or "/" not in source:
        path = as_path if as_path.is_absolute() else models_dir / as_path
        if not (path / marker).is_file():
            hint = (
                f" (build it: `kiln tiny-models` writes the tiny models into KILN_MODELS_DIR,"
                f" now {models_dir}; where they were built elsewhere, set KILN_MODELS_DIR there)"
                if manifest.id.startswith("tiny-")
                else f" (build it as manifests/{manifest.id}.yaml describes, with save_pretrained)"
            )
            raise FileNotFoundError(
                f"model {manifest.id}: source {source!r} resolves to {path}, which holds no "
                f"{marker}{hint}"
            )
        return WeightsSource(str(path), local=True)
    local_path = models_dir / source
    if (local_path / marker).is_file():
        return WeightsSource(str(local_path), local=True)
    return WeightsSource(source, local=False)


def publish_manifests(connection: Redis, manifests: dict[str, Manifest]) -> None:
    """Write manifests to Redis so clients validate against what workers actually serve."""
    if not manifests:
        return
    connection.hset(
        keys.MANIFESTS_KEY, mapping={m.id: m.model_dump_json() for m in manifests.values()}
    )
