#!/usr/bin/env bash
# Installs the Debian packages knapserve needs (when missing), then configures
# and builds it in ./build (Release). Safe to run again: it only installs what
# is missing and rebuilds what changed.
#
#   tools/setup.sh            # packages + configure + build
#   BUILD_DIR=out tools/setup.sh
#   KNAPSERVE_SETUP=build tools/setup.sh   # what building needs, no tests
#                                          # (deploy/Dockerfile's build stage)
set -euo pipefail
cd "$(dirname "$0")/.."

SETUP=${KNAPSERVE_SETUP:-all}  # all | build
PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git
  libtorch-dev libopenblas0-pthread
  libgrpc++-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libabsl-dev nlohmann-json3-dev libpcre2-dev libutf8proc-dev
  libcpp-httplib-dev
  prometheus-cpp-dev  # the metrics
  libhwy-dev  # Highway: the portable SIMD kernels (common/model/kernels)
)
if [ "$SETUP" != build ]; then
  PACKAGES+=(
    libgtest-dev libgmock-dev libbenchmark-dev
    clang  # tools/check_thread_safety.sh (clang's -Wthread-safety), a CTest test
    libclang-rt-14-dev libomp-dev  # tools/fuzz.sh: libFuzzer, sanitizers and OpenMP under clang
    python3 python3-grpcio python3-protobuf
    clang-format
    openssl  # the TLS tests make their certificates with it
    python3-jinja2  # the chat-template tests compare with jinja2's renderings
    prometheus  # the scrape test runs the real server
    kubectl  # the manifests test renders deploy/kubernetes with kubectl kustomize
  )
  # Node.js and npm for the official `openai` client test (tests/node). Any
  # recent Node will do; Debian's packages when there is none.
  command -v node >/dev/null && command -v npm >/dev/null || PACKAGES+=(nodejs npm)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# OpenBLAS instead of the reference BLAS: fp32 GEMM is ~30x faster here.
if [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] && command -v update-alternatives >/dev/null; then
  current=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | awk '/^Value:/{print $2}')
  case "$current" in
    *openblas*) ;;
    *) SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
       $SUDO update-alternatives --set libblas.so.3-x86_64-linux-gnu \
         /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 || true ;;
  esac
fi

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  tests=ON
  [ "$SETUP" != build ] || tests=OFF
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DKNAPSERVE_TESTS=$tests
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
[ "$SETUP" != build ] || exit 0

# The npm packages of two tests, at the versions their package-lock.json
# pins: the official `openai` client (tests/node, the HTTP front door's
# client test) and kubernetes-models (tests/deploy, the Kubernetes schemas
# the DeployManifests test validates against).
for dir in tests/node tests/deploy; do
  if [ ! -f "$dir/node_modules/.package-lock.json" ] ||
     [ "$dir/package-lock.json" -nt "$dir/node_modules/.package-lock.json" ]; then
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
  fi
done
