"""A backend on another host, played by a separate process: it knows only Redis (no AWS
credentials, no KILN_OUTPUT_*, not the worker's directories). It submits one job, follows it
through job.events(), downloads the images (sha256 checked) and prints what it saw as JSON.

    python -m tests.remote_client REDIS_URL MODEL DOWNLOAD_DIR [WEBHOOK]
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from api_client import KilnClient


def main(redis_url: str, model: str, directory: str, webhook: str | None = None) -> int:
    client = KilnClient(redis_url)
    request = {
        "model": model,
        "prompt": "a fox far away",
        "steps": 8,
        "seed": 3,
        "num_images": 2,
        "previews": True,
    }
    if webhook:
        request["webhook"] = webhook
    job = client.submit(request)
    print(json.dumps({"job_id": job.id}), flush=True)
    seen = [event.model_dump(mode="json", exclude_none=True) for event in job.events(timeout=120)]
    paths = job.download(directory)
    result = job.wait(timeout=5)
    digests = [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]
    print(
        json.dumps(
            {
                "events": seen,
                "paths": [str(p) for p in paths],
                "sha256": digests,
                "result_sha256": [image.sha256 for image in result.images],
                "uris": [image.uri for image in result.images],
                "modules": sorted(m for m in ("torch", "boto3", "diffusers") if m in sys.modules),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
