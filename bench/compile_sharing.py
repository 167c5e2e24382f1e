"""What of a compile travels to a fresh process: torch's Mega-Cache against the files Inductor
wrote (what worker/pipelines/compile_cache.py shares). Each row is a new interpreter with its own
Inductor cache directory running the first compiled call of the tiny-sd15 UNet (regional,
fullgraph, 128x128, 2 steps):

- cold: an empty directory; it saves torch.compiler.save_cache_artifacts() and keeps its files;
- mega-cache: an empty directory, after torch.compiler.load_cache_artifacts() of cold's bytes;
- files: a directory holding a copy of the files cold wrote (no lock files);
- own disk: cold's directory itself.

    python bench/compile_sharing.py
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    if len(sys.argv) == 3:  # in the fresh process
        print(json.dumps(one(sys.argv[1], Path(sys.argv[2]))))
        return 0
    from worker.pipelines.tiny import build_tiny_models

    build_tiny_models(ROOT / "models")
    work = Path(tempfile.mkdtemp(prefix="kiln-compile-sharing-"))
    rows = {"cold": fresh("cold", work / "a", work)}
    rows["mega-cache"] = fresh("mega", work / "b", work)
    shutil.copytree(work / "a", work / "c", ignore=shutil.ignore_patterns("locks", "*.lock"))
    rows["files"] = fresh("plain", work / "c", work)
    rows["own disk"] = fresh("plain", work / "a", work)
    head = f"{'case':<11} {'first call s':>12} {'compile s':>9} {'fx hits':>7}"
    print(f"{head} {'C++ build s':>11}  pixels")
    for case, r in rows.items():
        print(
            f"{case:<11} {r['first_s']:>12.2f} {r['compile_s']:>9.2f} {r['hits']:>7}"
            f" {r['cpp_s']:>11.2f}  {r['pixels']}"
        )
    return 0


def fresh(mode: str, cache: Path, work: Path) -> dict[str, object]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    argv = [sys.executable, __file__, mode, str(work / "mega.bin")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    row: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def one(mode: str, mega: Path) -> dict[str, object]:
    import torch
    from diffusers import StableDiffusionPipeline
    from torch._dynamo.utils import compilation_time_metrics, counters

    pipe = StableDiffusionPipeline.from_pretrained(ROOT / "models" / "tiny-sd15")
    pipe.set_progress_bar_config(disable=True)
    if mode == "mega":
        torch.compiler.load_cache_artifacts(mega.read_bytes())
    pipe.unet.compile_repeated_blocks(fullgraph=True)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(1)
    out = pipe("a lighthouse", num_inference_steps=2, height=128, width=128, generator=generator)
    first = time.perf_counter() - started
    if mode == "cold":
        saved = torch.compiler.save_cache_artifacts()
        assert saved is not None
        mega.write_bytes(saved[0])
    image = out.images[0].tobytes()
    return {
        "first_s": round(first, 2),
        "compile_s": round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 2),
        "hits": counters["inductor"]["fxgraph_cache_hit"],
        "cpp_s": round(sum(compilation_time_metrics.get("compile_file", [])), 2),
        "pixels": hashlib.sha256(image).hexdigest()[:12],
    }


if __name__ == "__main__":
    sys.exit(main())
