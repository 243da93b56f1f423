#!/usr/bin/env bash
# CI: build the unmodified docker/Dockerfile.cpu and run the image, with no Docker engine and no registry.
#
# 1. A Debian bookworm base image (python3 + venv) made with debootstrap and imported with buildah;
# 2. `buildah bud --isolation=chroot` builds Dockerfile.cpu on it, torch from the machine's local CPU wheel
#    and the rest from PyPI (pip gets the machine's CA bundle);
# 3. the image's ENTRYPOINT runs with `buildah run --isolation=chroot --network=host` (podman run cannot set
#    rlimits in this sandbox); the script waits for /health, runs the image's HEALTHCHECK command, sends one
#    completion and checks /metrics counted its tokens.
# Every wait is bounded. Needs root, buildah, debootstrap, curl and python3. The base rootfs is cached in
# $KVSERVE_CI_CACHE (default /var/cache/kvserve-ci).
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${KVSERVE_CI_CACHE:-/var/cache/kvserve-ci}
BASE_IMAGE=localhost/kvserve-ci-base:bookworm
IMAGE=localhost/kvserve:cpu-ci
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
PORT=${KVSERVE_CI_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
HEALTH_TIMEOUT_S=240
BUILD_TIMEOUT_S=2400
log() { echo "[container-ci $(date +%T)] $*"; }

mkdir -p "$CACHE"
if ! buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    if [ ! -f "$CACHE/bookworm.tar" ]; then
        log "debootstrap bookworm (minbase + python3, venv, CA certificates)"
        rm -rf "$CACHE/rootfs"
        timeout 900 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$CACHE/rootfs" http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap.log"; exit 1; }
        tar -C "$CACHE/rootfs" -cf "$CACHE/bookworm.tar.partial" . && mv "$CACHE/bookworm.tar.partial" "$CACHE/bookworm.tar"
        rm -rf "$CACHE/rootfs"
    fi
    log "importing the base image"
    base=$(buildah from scratch)
    buildah add "$base" "$CACHE/bookworm.tar" / >/dev/null
    buildah commit -q "$base" "$BASE_IMAGE" >/dev/null
    buildah rm "$base" >/dev/null
fi

# The CPU wheel: pip's find-links on these machines hold it, so this copies rather than downloads.
rm -rf "$CACHE/wheels"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 -d "$CACHE/wheels" "$TORCH_SPEC"
wheels=("$CACHE"/wheels/torch-*.whl)
wheel=$(basename "${wheels[0]}")
log "building docker/Dockerfile.cpu with TORCH_SPEC=/wheels/$wheel"
timeout "$BUILD_TIMEOUT_S" buildah bud --isolation=chroot --network=host --format docker --layers \
    -f docker/Dockerfile.cpu -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg TORCH_SPEC="/wheels/$wheel" \
    --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
    --build-arg PIP_CA_BUNDLE="$CA_BUNDLE" \
    -v "$CACHE/wheels:/wheels:ro" -v "$CA_BUNDLE:$CA_BUNDLE:ro" \
    .

# The image's own ENTRYPOINT, HEALTHCHECK and USER, shell-quoted, to run them as a container runtime would.
read_config='import json, shlex, sys
config = json.load(sys.stdin)["Docker"]["config"]
print(shlex.join(config["Entrypoint"]))
print(shlex.join(config["Healthcheck"]["Test"][1:]))
print(config["User"])'
{ read -r entrypoint; read -r healthcheck; read -r user; } < <(buildah inspect --type image "$IMAGE" | python3 -c "$read_config")
[ "$entrypoint" = "kvserve serve" ] || { log "unexpected ENTRYPOINT: $entrypoint"; exit 1; }
[ "$user" = 10001 ] || { log "the image runs as user '$user', not 10001"; exit 1; }

container=$(buildah from "$IMAGE")
server_pid=
cleanup() {
    if [ -n "$server_pid" ]; then
        kill -TERM "$server_pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$server_pid" 2>/dev/null || true
    fi
    buildah rm "$container" >/dev/null 2>&1 || true
}
trap cleanup EXIT

log "starting the image's entrypoint ($entrypoint) on port $PORT"
# exec: $! is buildah run itself, which passes the TERM of the cleanup on to the server.
eval "exec buildah run --isolation=chroot --network=host --env KVSERVE_PORT=$PORT $container -- $entrypoint" \
    --max-num-seqs 4 >"$CACHE/server.log" 2>&1 &
server_pid=$!
deadline=$((SECONDS + HEALTH_TIMEOUT_S))
until curl -fsS --max-time 5 "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ] || ! kill -0 "$server_pid" 2>/dev/null; then
        log "no healthy server within ${HEALTH_TIMEOUT_S}s"; tail -40 "$CACHE/server.log"; exit 1
    fi
    sleep 1
done
log "healthy; running the image's HEALTHCHECK command"
eval "timeout 30 buildah run --isolation=chroot --network=host --env KVSERVE_PORT=$PORT $container -- $healthcheck"

completion=$(curl -fsS --max-time 120 "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
    -d '{"prompt": "Hello from the container", "max_tokens": 8, "ignore_eos": true}')
tokens=$(echo "$completion" | python3 -c 'import json, sys; print(json.load(sys.stdin)["usage"]["completion_tokens"])')
[ "$tokens" = 8 ] || { log "unexpected completion: $completion"; exit 1; }
metrics=$(curl -fsS --max-time 10 "http://127.0.0.1:$PORT/metrics")
echo "$metrics" | grep -E '^kvserve:generation_tokens_total\{model_name="kvserve-default-kjv-v2"\} 8\.0$' >/dev/null \
    || { log "/metrics did not count the 8 tokens:"; echo "$metrics" | grep '^kvserve:generation' || true; exit 1; }

log "stopping the server; the HEALTHCHECK command must now fail"
kill -TERM "$server_pid"
for _ in $(seq 100); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.2; done
if eval "timeout 30 buildah run --isolation=chroot --network=host --env KVSERVE_PORT=$PORT $container -- $healthcheck" \
    2>/dev/null; then
    log "the HEALTHCHECK command passed with no server"; exit 1
fi
log "OK: built, healthy, HEALTHCHECK passes (and fails once stopped), a completion of $tokens tokens counted in /metrics"
