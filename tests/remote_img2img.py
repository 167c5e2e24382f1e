"""A backend on another host using input images and adapters, played by a separate process: it
knows only Redis and has only the client package (no AWS credentials, no store settings, no
torch). It uploads an image and a mask, submits an img2img, an inpaint and a LoRA job, waits,
downloads the results and prints what it saw.

    python -m tests.remote_img2img REDIS_URL MODEL IMAGE MASK DOWNLOAD_DIR
"""

from __future__ import annotations

import json
import sys

from api_client import KilnClient


def main(redis_url: str, model: str, image: str, mask: str, directory: str) -> int:
    client = KilnClient(redis_url)
    uri, mask_uri = client.upload(image), client.upload(mask)
    base = {"model": model, "prompt": "a fox", "steps": 4, "seed": 2}
    jobs = [
        client.submit({**base, "image": uri}),
        client.submit({**base, "image": uri, "mask": mask_uri}),
        client.submit({**base, "loras": [{"name": "detail", "weight": 0.9}]}),
    ]
    print(json.dumps({"job_ids": [job.id for job in jobs], "uri": uri}), flush=True)
    uris, paths = [], []
    for job in jobs:
        result = job.wait(timeout=120)
        uris += [i.uri for i in result.images]
        paths += [str(p) for p in job.download(directory)]
    loaded = sorted(m for m in ("torch", "boto3", "diffusers") if m in sys.modules)
    print(json.dumps({"uris": uris, "paths": paths, "modules": loaded}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
