#!/usr/bin/env bash
# `make test-docker` (not in CI: the worker image's CUDA torch is GBs): builds the gateway and
# worker images, then renders a tiny txt2img and a tiny upscale in the worker image on CPU,
# against a private redis-server on this host (--network host), and checks the gateway image
# answers /healthz.
#
# Where no image registry is reachable, the base the Dockerfiles name (python:3.11-slim-bookworm)
# is built from Debian's packages with debootstrap and passed as BASE (KILN_DOCKER_BASE names an
# existing image instead). A Docker daemon is started if none answers:
#   dockerd --storage-driver=overlay2 --iptables=false --bridge=none
# Each step says what it does; the first that fails ends the run with its status.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${KILN_DOCKER_WORK:-/tmp/kiln-test-docker}
BASE=${KILN_DOCKER_BASE:-kiln-base:bookworm}
MIRROR=${KILN_DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$WORK"
say() { printf '\n== %s\n' "$*"; }

# 1. A daemon: the one that answers, or one started here (its log in $WORK/dockerd.log).
if ! docker info >/dev/null 2>&1; then
    say "starting dockerd (log: $WORK/dockerd.log)"
    command -v dockerd >/dev/null || { echo "no dockerd: apt-get install docker.io" >&2; exit 1; }
    dockerd --storage-driver=overlay2 --iptables=false --bridge=none \
        >"$WORK/dockerd.log" 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log" >&2; exit 1; }
fi

# 2. The base: Debian bookworm's python3 (3.11) from debootstrap, imported as $BASE. pip may
#    install into the system Python there, as it does in python:3.11-slim.
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    say "building $BASE with debootstrap from $MIRROR"
    command -v debootstrap >/dev/null || { echo "no debootstrap: apt-get install debootstrap" >&2; exit 1; }
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase \
        --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates,libgl1,libglib2.0-0 \
        bookworm "$WORK/rootfs" "$MIRROR"
    # The CAs this host adds to Debian's (a TLS-inspecting proxy's), so pip in the builds trusts
    # what pip here trusts.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$WORK/rootfs/usr/local/share/ca-certificates/"
        chroot "$WORK/rootfs" update-ca-certificates
    fi
    tar -C "$WORK/rootfs" -c . | docker import \
        --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["python3"]' - "$BASE"
fi

# 3. The images, built with the host's network (no bridge here), from a context of only what
#    the Dockerfiles copy (the checkout's .venv and models would be GBs of context).
CONTEXT="$WORK/context"
rm -rf "$CONTEXT" && mkdir -p "$CONTEXT"
tar -C "$ROOT" --exclude=__pycache__ -c pyproject.toml README.md docs/LICENSE api_client worker \
    manifests | tar -C "$CONTEXT" -x
say "building kiln-api:test"
docker build --network host --build-arg BASE="$BASE" -f "$ROOT/docker/Dockerfile.api" \
    -t kiln-api:test "$CONTEXT"
say "building kiln-worker:test (the CUDA torch: GBs)"
docker build --network host --build-arg BASE="$BASE" -f "$ROOT/docker/Dockerfile.cuda" \
    -t kiln-worker:test "$CONTEXT"

# 4. A private Redis on a free port of this host.
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$PORT" --bind 127.0.0.1 --save '' --dir "$WORK" >"$WORK/redis.log" 2>&1 &
REDIS_PID=$!
trap 'kill "$REDIS_PID" 2>/dev/null || true' EXIT
for _ in $(seq 50); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
URL="redis://127.0.0.1:$PORT/0"

# 5. The gateway image starts and answers.
say "kiln-api:test answers /healthz"
API_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
API=$(docker run -d --rm --network host -e KILN_REDIS_URL="$URL" -e KILN_API_HOST=127.0.0.1 \
    -e KILN_API_PORT="$API_PORT" kiln-api:test)
ok=""
for _ in $(seq 60); do
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$API_PORT/healthz', timeout=2)" 2>/dev/null; then ok=1; break; fi
    sleep 1
done
docker logs "$API" 2>&1 | tail -5
docker rm -f "$API" >/dev/null
[ -n "$ok" ] || { echo "kiln-api:test never answered /healthz" >&2; exit 1; }

# 6. In the worker image, on CPU: the tiny models, a worker of tiny-sd15 and tiny-upscaler, a
#    txt2img and an upscale of its image, each waited for.
say "kiln-worker:test renders a tiny txt2img and a tiny upscale on CPU"
docker run --rm --network host -e KILN_REDIS_URL="$URL" -e KILN_DEVICE=cpu \
    -v "$ROOT/docker/smoke.sh:/smoke.sh:ro" --entrypoint bash kiln-worker:test /smoke.sh
say "test-docker: passed"
