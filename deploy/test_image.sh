#!/usr/bin/env bash
# Builds deploy/Dockerfile with podman and checks the image from the host:
#
#   1. a Debian 12 base image made here from Debian's packages (mmdebstrap,
#      imported into podman), since no container registry is reachable;
#   2. the two-stage build (deploy/Dockerfile) on that base;
#   3. what the runtime image holds: no compiler, no -dev package, no
#      source, a non-root user;
#   4. the executor container (`knapserve serve` on the bundled
#      stories260k), then from the host: grpc.health.v1 SERVING and a short
#      streamed generation over gRPC (tests/tools/independent_client.py, a
#      Python client independent of the C++ code), and the HTTP front door's
#      /health and a completion;
#   5. the image size.
#
#   deploy/test_image.sh                 # everything, cached base image reused
#   KEEP=1 deploy/test_image.sh          # leave the container running
#
# Needs root (or sudo) for the packages podman, runc, mmdebstrap and
# python3-grpcio. Made to run inside sandboxes too:
#  - containers use the host's network (--network host), so no bridge is
#    needed;
#  - the OCI runtime is runc: crun refuses hosts with hybrid cgroups (v1
#    controllers plus a cgroup2 mount), which runc handles;
#  - a containers.conf with no default ulimits (CONTAINERS_CONF, written to
#    the work folder unless set): podman's defaults raise RLIMIT_NOFILE and
#    RLIMIT_NPROC, which a process without CAP_SYS_RESOURCE may not.
# PODMAN_OPTS adds global podman options (e.g. "--storage-driver vfs" where
# overlayfs is unavailable). Exit 0 only if every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."

work=${WORK_DIR:-build-image}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
base=localhost/knapserve-base:bookworm
image=localhost/knapserve:test
name=knapserve-image-test
grpc_port=${GRPC_PORT:-50151}
http_port=${HTTP_PORT:-8100}
mkdir -p "$work"
if [ -z "${CONTAINERS_CONF:-}" ]; then
  printf '[containers]\ndefault_ulimits = []\n' > "$work/containers.conf"
  export CONTAINERS_CONF="$PWD/$work/containers.conf"
fi
# shellcheck disable=SC2206
podman=(podman --runtime runc ${PODMAN_OPTS:-})

step() { echo "== $*" >&2; }
fail() { echo "test_image: FAILED: $*" >&2; exit 1; }

missing=()
for tool in podman runc mmdebstrap; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
/usr/bin/python3 -c 'import grpc' 2>/dev/null || missing+=(python3-grpcio)
command -v protoc >/dev/null || missing+=(protobuf-compiler)
if ((${#missing[@]})); then
  step "installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    --no-install-recommends "${missing[@]}"
fi

step "1. base image $base"
if ! "${podman[@]}" image exists "$base"; then
  rm -f "$work/debian-12.tar"
  mmdebstrap --variant=apt --include=ca-certificates --format=tar \
    bookworm "$work/debian-12.tar" "$mirror" >&2
  "${podman[@]}" import --change 'CMD ["/bin/bash"]' "$work/debian-12.tar" "$base" >&2
fi

step "2. build deploy/Dockerfile"
start=$(date +%s)
"${podman[@]}" build --network host -f deploy/Dockerfile \
  --ignorefile deploy/Dockerfile.dockerignore \
  --build-arg BASE="$base" -t "$image" . >&2
build_seconds=$(( $(date +%s) - start ))

step "3. what the runtime image holds"
inside() { "${podman[@]}" run --rm --network host "$image" bash -c "$1"; }
uid=$(inside 'id -u')
[ "$uid" != 0 ] || fail "the image runs as root"
compilers=$(inside 'for c in gcc g++ cc c++ clang cmake; do command -v $c; done; true')
[ -z "$compilers" ] || fail "compilers in the runtime image: $compilers"
dev=$(inside "dpkg-query -W -f='\${Package}\n' | grep -- '-dev\$' || true")
[ -z "$dev" ] || fail "-dev packages in the runtime image: $dev"
inside 'test ! -e /src' || fail "the source is in the runtime image"

step "4. the executor container"
"${podman[@]}" rm -f "$name" >/dev/null 2>&1 || true
cleanup() {
  [ -n "${KEEP:-}" ] || "${podman[@]}" rm -f "$name" >/dev/null 2>&1 || true
}
trap cleanup EXIT
"${podman[@]}" run -d --name "$name" --network host "$image" \
  knapserve serve --model /usr/local/share/knapserve/models/stories260k \
  --listen "127.0.0.1:$grpc_port" --http-listen "127.0.0.1:$http_port" \
  --threads 2 >/dev/null
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$http_port/health" >/dev/null && break
  "${podman[@]}" container exists "$name" || fail "the container exited"
  sleep 0.2
done
mkdir -p "$work/client"
client=$(/usr/bin/python3 tests/tools/independent_client.py \
  "127.0.0.1:$grpc_port" proto "$work/client" "Once upon a time" 16) ||
  { "${podman[@]}" logs "$name" >&2; fail "the gRPC client failed"; }
echo "$client" | /usr/bin/python3 -c '
import json, sys
out = json.load(sys.stdin)
assert out["health"][""] == 1 and out["health"]["knapserve.v1.Generation"] == 1, out["health"]
assert out["completion_tokens"] == 16, out
print("grpc.health.v1: SERVING; generated:", json.dumps(out["text"]))' ||
  fail "health or generation"
completion=$(curl -sf "http://127.0.0.1:$http_port/v1/completions" \
  -H 'Content-Type: application/json' \
  -d '{"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}') ||
  fail "the HTTP completion"
echo "$completion" | /usr/bin/python3 -c '
import json, sys
out = json.load(sys.stdin)
assert out["usage"]["completion_tokens"] >= 1, out
print("HTTP /v1/completions:", json.dumps(out["choices"][0]["text"]))' ||
  fail "the HTTP completion's body"

step "5. size"
size=$("${podman[@]}" image inspect --format '{{.Size}}' "$image")
base_size=$("${podman[@]}" image inspect --format '{{.Size}}' "$base")
echo "image $image: $((size / 1000000)) MB (base $((base_size / 1000000)) MB), built in ${build_seconds} s"
echo "test_image: OK"
