#!/usr/bin/env bash
# Builds knapserve (installing packages if needed) and runs the whole test
# suite with CTest. CUDA tests skip themselves where no GPU exists.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 900
