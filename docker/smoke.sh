#!/usr/bin/env bash
# Inside the worker image (docker/test-docker.sh runs it): the tiny models built, a worker of
# tiny-sd15 and tiny-upscaler in the background, a txt2img and an upscale of its image, each
# waited for with `kiln submit --wait --json`, the upscale twice the txt2img's size.
set -euo pipefail
kiln tiny-models /models
kiln worker --models tiny-sd15,tiny-upscaler >/tmp/worker.log 2>&1 &
WORKER=$!
trap 'kill "$WORKER" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    kiln models --json | python -c 'import json,sys; sys.exit(0 if all(m["served"] for m in json.load(sys.stdin) if m["id"] in ("tiny-sd15", "tiny-upscaler")) else 1)' && break
    kill -0 "$WORKER" || { tail -30 /tmp/worker.log; exit 1; }
    sleep 1
done
kiln submit "a red fox" --model tiny-sd15 --steps 2 --seed 7 --wait --json >/tmp/txt2img.json
IMAGE=$(python -c 'import json; print(json.load(open("/tmp/txt2img.json"))["images"][0]["path"])')
kiln submit "" --model tiny-upscaler --image "$IMAGE" --wait --json >/tmp/upscale.json
python - <<'EOF'
import json
first, up = (json.load(open(f"/tmp/{n}.json")) for n in ("txt2img", "upscale"))
a, b = first["images"][0], up["images"][0]
assert (b["width"], b["height"]) == (2 * a["width"], 2 * a["height"]), (a, b)
print(f"txt2img {a['width']}x{a['height']} on {first['device']}, upscale {b['width']}x{b['height']}")
EOF
