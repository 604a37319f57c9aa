#!/usr/bin/env bash
# Usage: check_no_temp_leftovers.sh TEST_BINARY
#
# A test binary removes every temporary folder it makes (tests/testing/
# temp_dir.h), whether it runs tests, only lists them (ctest lists every
# binary's suites each time it runs: tests/testing/gtest_suites.cmake), or
# skips a per-target SIMD run. Runs TEST_BINARY those three ways with TMPDIR
# set to an empty folder of its own and fails if anything is left in it.
set -u
binary=$1
work=$(mktemp -d "${TMPDIR:-/tmp}/knapserve_leftovers.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
status=0
check() {
  local what=$1
  shift
  if ! "$@" >"$work.log" 2>&1; then
    echo "FAIL: $what: the binary failed:"
    cat "$work.log"
    status=1
  fi
  local left
  left=$(ls -A "$work")
  if [ -n "$left" ]; then
    echo "FAIL: $what left in TMPDIR: $left"
    status=1
    rm -rf "${work:?}"/*
  else
    echo "ok: $what"
  fi
}
check "listing the tests" env TMPDIR="$work" "$binary" --gtest_list_tests
check "running tests" env TMPDIR="$work" "$binary" --gtest_filter='ProfileCache*'
# The run names the CPU's best SIMD target ("knapserve tests: simd avx2
# (supported: avx2 scalar)"); a per-target run of it is skipped.
best=$(sed -n 's/^knapserve tests: simd \([a-z0-9]*\) .*/\1/p' "$work.log")
if [ -z "$best" ]; then
  echo "FAIL: the run did not name its SIMD target"
  status=1
else
  check "a skipped per-target run ($best)" env TMPDIR="$work" \
    KNAPSERVE_SIMD_TEST="$best" "$binary" --gtest_filter='ProfileCache*'
  grep -q "SIMD run skipped" "$work.log" ||
    { echo "FAIL: the run of $best was not skipped"; status=1; }
fi
rm -f "$work.log"
exit $status
