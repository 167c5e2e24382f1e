"""A backend on another host doing img2img, played by a separate process: it knows only Redis and
has only the client package (no AWS credentials, no store settings, no torch). It uploads an
image, submits an img2img job with it, waits, downloads the result and prints what it saw.

    python -m tests.remote_img2img REDIS_URL MODEL IMAGE DOWNLOAD_DIR
"""

from __future__ import annotations

import json
import sys

from api_client import KilnClient


def main(redis_url: str, model: str, image: str, directory: str) -> int:
    client = KilnClient(redis_url)
    uri = client.upload(image)
    job = client.submit({"model": model, "prompt": "a fox", "steps": 4, "seed": 2, "image": uri})
    print(json.dumps({"job_id": job.id, "uri": uri}), flush=True)
    result = job.wait(timeout=120)
    paths = job.download(directory)
    loaded = sorted(m for m in ("torch", "boto3", "diffusers") if m in sys.modules)
    report = {"uris": [i.uri for i in result.images], "paths": [str(p) for p in paths]}
    print(json.dumps({**report, "modules": loaded}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
