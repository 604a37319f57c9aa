#!/usr/bin/env bash
# Builds knapserve (installing packages if needed) and runs the whole test
# suite with CTest, then a short smoke of every fuzz target. CUDA tests skip
# themselves where no GPU exists.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
(cd "${BUILD_DIR:-build}" &&
  ctest --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 900)
# A smoke of every fuzz target (tests/fuzz/): clang + libFuzzer + ASan/UBSan,
# 10 s each, two at a time. KNAPSERVE_FUZZ_SMOKE=0 skips it.
if [ "${KNAPSERVE_FUZZ_SMOKE:-1}" != 0 ]; then
  JOBS=${JOBS:-$(nproc)} tools/fuzz.sh 10
fi
