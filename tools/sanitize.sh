#!/usr/bin/env bash
# Builds the tree with a sanitizer and runs the test suite under it:
#
#   tools/sanitize.sh address     # AddressSanitizer + UndefinedBehaviorSanitizer
#   tools/sanitize.sh undefined   # UndefinedBehaviorSanitizer alone
#   tools/sanitize.sh thread      # ThreadSanitizer
#   tools/sanitize.sh address -R 'BatchEngine|Generation'   # extra ctest args
#
# Each mode builds in its own folder (build-<mode>, RelWithDebInfo, GCC) so
# the normal build stays as it is. The tree's own checks (format, layering,
# clang's thread-safety analysis) are left out: they do not run code.
# LibTorch, OpenMP, gRPC and OpenBLAS come from Debian uninstrumented; the
# suppression files in tools/sanitizers/ list what is theirs, each entry with
# its reason. A report fails the test that produced it.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
shift || true
case "$mode" in
  address) flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined" ;;
  undefined) flags="-fsanitize=undefined -fno-sanitize-recover=undefined" ;;
  thread) flags="-fsanitize=thread" ;;
  *) echo "usage: tools/sanitize.sh address|undefined|thread [ctest args]" >&2
     exit 2 ;;
esac
flags="$flags -fno-omit-frame-pointer -g"
tools/setup.sh >/dev/null  # packages (and the normal build)
dir=build-$mode
if [ ! -f "$dir/build.ninja" ]; then
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags"
fi
cmake --build "$dir" -j "${JOBS:-$(nproc)}"
supp="$PWD/tools/sanitizers"
# Leaks: LibTorch and gRPC keep process-lifetime singletons that are never
# freed; lsan.supp names them. Reports go to stderr, which CTest shows.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=0"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
cd "$dir"
ctest --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 1800 \
  -E '^(FormatCheck|LayeringCheck|ThreadSafetyAnalysis.*|LintProtos.*)$' "$@"
