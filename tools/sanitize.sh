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

# ThreadSanitizer sees a lock only where the locking code is instrumented.
# Debian's libabsl is not, so every absl::Mutex (ours, and gRPC's, which
# locks through Abseil) looks like no lock at all and every guarded member
# like a race. Thread mode therefore builds Debian's own Abseil source (the
# installed version, with Debian's patches: same options, same inline
# namespace, same SONAMEs) with -fsanitize=thread into $dir/abseil/lib, and
# runs the tests with it on LD_LIBRARY_PATH, so the binaries, gRPC included,
# load the instrumented copy. The source comes from the Debian archive
# ($DEBIAN_MIRROR, default http://deb.debian.org/debian).
build_tsan_abseil() {
  local root=$1 version upstream mirror
  [ -f "$root/lib/libabsl_synchronization.so.20220623" ] && return 0
  version=$(dpkg-query -W -f='${source:Version}' libabsl-dev)
  upstream=${version%-*}
  mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
  mkdir -p "$root/download"
  for file in "abseil_${version}.dsc" "abseil_${upstream}.orig.tar.gz" \
              "abseil_${version}.debian.tar.xz"; do
    [ -f "$root/download/$file" ] || curl -sSf -o "$root/download/$file" \
      "$mirror/pool/main/a/abseil/$file"
  done
  rm -rf "$root/src"
  dpkg-source --no-check -x "$root/download/abseil_${version}.dsc" \
    "$root/src" >/dev/null
  # debian/rules' shared build, plus the sanitizer.
  cmake -S "$root/src" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" \
    -DCMAKE_INSTALL_PREFIX="$root" -DCMAKE_INSTALL_LIBDIR=lib >/dev/null
  cmake --build "$root/build" -j "${JOBS:-$(nproc)}"
  cmake --install "$root/build" >/dev/null
}
if [ "$mode" = thread ]; then
  build_tsan_abseil "$PWD/$dir/abseil"
  export LD_LIBRARY_PATH="$PWD/$dir/abseil/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
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
# gRPC comes uninstrumented too: TSan records none of its own accesses, but
# would check the libc calls it makes (memcpy, malloc, sendmsg) against
# ours; ignore_noninstrumented_modules leaves those out instead of
# suppressing gRPC by name.
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$supp/tsan.supp"
cd "$dir"
ctest --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 1800 \
  -E '^(FormatCheck|LayeringCheck|ThreadSafetyAnalysis.*|LintProtos.*)$' "$@"
