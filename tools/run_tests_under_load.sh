#!/usr/bin/env bash
# Runs the whole CTest suite of an existing build N times in a row (default
# 3) while stress-ng keeps every core busy, to show no test depends on a
# quiet machine (tests/README.md, "Under load"). Stops at the first failing
# run. Needs stress-ng (Debian's; installed here when missing and apt-get
# can run). Usage: tools/run_tests_under_load.sh [runs]; BUILD_DIR (build)
# and JOBS (nproc) as for tools/run_tests.sh. Logs: <build>/under_load/.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
if ! command -v stress-ng > /dev/null; then
  SUDO=""
  [ "$(id -u)" != 0 ] && SUDO=sudo
  $SUDO apt-get install -y stress-ng
fi
logs="$build/under_load"
mkdir -p "$logs"
stress-ng --cpu "$(nproc)" --timeout 6h > "$logs/stress-ng.log" 2>&1 &
stress=$!
trap 'kill $stress 2> /dev/null || true; wait $stress 2> /dev/null || true' EXIT
for run in $(seq 1 "$runs"); do
  start=$(date +%s)
  if (cd "$build" && ctest --output-on-failure -j "$jobs" --timeout 900) \
    > "$logs/run$run.log" 2>&1; then
    echo "run $run of $runs: passed in $(($(date +%s) - start)) s (log $logs/run$run.log)"
  else
    echo "run $run of $runs: FAILED after $(($(date +%s) - start)) s (log $logs/run$run.log)"
    grep -A40 'tests failed out of' "$logs/run$run.log" || true
    exit 1
  fi
done
