#!/usr/bin/env bash
# Builds the fuzz targets of tests/fuzz/ with clang, libFuzzer, ASan and UBSan
# (in build-fuzz/), writes their seed corpus from the shared data, and fuzzes
# each for SECONDS (default 60):
#
#   tools/fuzz.sh                 # every target, 60 s each
#   tools/fuzz.sh 600             # 10 minutes each
#   tools/fuzz.sh 30 plan_codec   # some targets only
#   JOBS=2 tools/fuzz.sh 600      # two targets at a time
#
# The corpus of each target grows across runs in build-fuzz/corpus/<name>/.
# A crash, hang (> 10 s for one input) or out-of-memory (> 4 GB) leaves its
# input in build-fuzz/artifacts/<name>/ and makes the script exit 1; copy the
# input to tests/fuzz/regressions/<name>/ once fixed, and the test suite
# replays it from then on (FuzzReplay.<name>). Prints each target's
# executions, corpus size and coverage.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
all=(safetensors model_config tokenizer_json tokenizer_text tensor_codec
     plan_codec generate_request latency_profile chat_template traceparent)
targets=("$@")
((${#targets[@]})) || targets=("${all[@]}")

tools/setup.sh >/dev/null  # packages, and the normal build (fuzz_seeds)
export KNAPSERVE_SHARED=${KNAPSERVE_SHARED:-$PWD/../shared}
dir=build-fuzz
flags="-O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined"
# LibTorch 1.13's headers need one patched header under clang in C++20.
overlay=$(python3 tools/clang_libtorch_overlay.py "$PWD/$dir/overlay")
[ -z "$overlay" ] || flags="$flags -isystem $overlay"
if [ ! -f "$dir/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=None \
    -DKNAPSERVE_FUZZ=ON -DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
fi
cmake --build "$dir" -j "$(nproc)" --target fuzzers
"${BUILD_DIR:-build}/tests/fuzz/fuzz_seeds" "$dir/seeds" >/dev/null

supp="$PWD/tools/sanitizers"
export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=1:detect_stack_use_after_return=0"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"

run_one() {
  local name=$1
  mkdir -p "$dir/corpus/$name" "$dir/artifacts/$name" "$dir/logs"
  local log="$dir/logs/$name.log"
  local rc=0
  "$dir/tests/fuzz/fuzz_$name" "$dir/corpus/$name" "$dir/seeds/$name" \
    "tests/fuzz/regressions/$name" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="$dir/artifacts/$name/" \
    >"$log" 2>&1 || rc=$?
  local execs cov
  execs=$(awk '/stat::number_of_executed_units/{print $NF}' "$log")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}')
  printf 'fuzz: %-17s %4s s  %10s execs  cov %6s  corpus %5s  %s\n' "$name" \
    "$seconds" "${execs:-?}" "${cov:-?}" \
    "$(find "$dir/corpus/$name" -type f | wc -l)" \
    "$([ "$rc" -eq 0 ] && echo ok || echo "FAILED (exit $rc, $log)")"
  if [ "$rc" -ne 0 ]; then
    grep -v '^#[0-9]\|^\[libprotobuf' "$log" | tail -40 >&2
  fi
  return "$rc"
}
export -f run_one
export dir seconds

status=0
printf '%s\n' "${targets[@]}" | xargs -P "${JOBS:-1}" -I{} bash -c 'run_one {}' || status=1
if [ "$status" -ne 0 ]; then
  echo "fuzz: findings in $dir/artifacts/ (logs in $dir/logs/)" >&2
fi
exit "$status"
