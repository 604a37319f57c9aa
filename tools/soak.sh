#!/usr/bin/env bash
# A bounded soak of the split deployment on loopback:
#
#   tools/soak.sh            # 10 minutes (the default SECONDS is 600)
#   tools/soak.sh 120        # a shorter run
#   MODEL=DIR tools/soak.sh  # another model (default: the shared stories-24l)
#
# Starts knapserve-planner and knapserve-executor (--planner, --metrics-port)
# on free loopback ports, then runs `knapserve bench soak` against the
# executor: 32 concurrent clients, greedy and sampling, all speculation
# modes, random cancels, deadlines and Aborts (tools/bench_soak.cc says what
# it checks). Every 60 s the planner is killed with SIGKILL and started again
# on the same port; the executor must carry on. At the end the executor gets
# SIGTERM and must exit 0. Prints the soak's figures and PASS or FAIL; exit
# 0 only when every check held. Logs stay in the folder it prints.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
tools/setup.sh >/dev/null
shared=${KNAPSERVE_SHARED:-$PWD/../shared}
export KNAPSERVE_SHARED=$shared
model=${MODEL:-$shared/models/stories-24l}
bin=${BUILD_DIR:-build}/tools
work=$(mktemp -d "${TMPDIR:-/tmp}/knapserve-soak.XXXXXX")
echo "soak: model $model, $seconds s, logs in $work"

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
planner_port=$(free_port)
executor_port=$(free_port)
metrics_port=$(free_port)
threads=${THREADS:-2}

pids=()
cleanup() {
  [ -z "${killer:-}" ] || kill "$killer" 2>/dev/null || true
  [ ! -f "$work/planner.pid" ] || kill -9 "$(cat "$work/planner.pid")" 2>/dev/null || true
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

start_planner() {
  "$bin/knapserve-planner" --model "$model" --listen "127.0.0.1:$planner_port" \
    --threads 1 --profile-cache "$work/profiles" >>"$work/planner.log" 2>&1 &
  echo $! >"$work/planner.pid"
  disown "$!"  # its SIGKILLs are the point: no "Killed" job notices
}
wait_for_log() {  # FILE TEXT SECONDS
  for _ in $(seq 1 "$3"); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 1
  done
  echo "soak: timed out waiting for '$2' in $1" >&2
  tail -20 "$1" >&2
  return 1
}

start_planner
wait_for_log "$work/planner.log" "serving" 600
"$bin/knapserve-executor" --model "$model" --listen "127.0.0.1:$executor_port" \
  --planner "127.0.0.1:$planner_port" --metrics-port "$metrics_port" \
  --threads "$threads" --profile-cache "$work/profiles" \
  --skip a10,a12,a14,a16,a18 --max-draft 4 --max-running 16 --max-queue 64 \
  >"$work/executor.log" 2>&1 &
executor=$!
pids+=("$executor")
wait_for_log "$work/executor.log" "serving" 600

# The planner dies every minute and comes back on the same port.
(
  restarts=0
  while sleep 60; do
    pid=$(cat "$work/planner.pid")
    kill -9 "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    start_planner
    restarts=$((restarts + 1))
    echo "$restarts" >"$work/planner.restarts"
  done
) 2>>"$work/killer.log" &
killer=$!

rc=0
"$bin/knapserve" bench soak --server "127.0.0.1:$executor_port" \
  --metrics "127.0.0.1:$metrics_port" --server-pid "$executor" \
  --soak-seconds "$seconds" --warmup-seconds "$((seconds < 120 ? seconds / 4 : 60))" \
  --concurrency "${CONCURRENCY:-32}" --max-new-tokens "${MAX_NEW_TOKENS:-48}" \
  --num-prompts 16 || rc=$?
kill "$killer" 2>/dev/null || true
wait "$killer" 2>/dev/null || true
killer=""
echo "soak: planner killed and restarted $(cat "$work/planner.restarts" 2>/dev/null || echo 0) times"

kill -TERM "$executor"
executor_rc=0
wait "$executor" || executor_rc=$?
pids=()
if [ "$executor_rc" -ne 0 ]; then
  echo "soak: FAIL: the executor exited $executor_rc on SIGTERM (log: $work/executor.log)" >&2
  rc=1
fi
if grep -q "AddressSanitizer\|ThreadSanitizer\|runtime error" "$work"/*.log; then
  echo "soak: FAIL: a sanitizer report in $work" >&2
  rc=1
fi
exit "$rc"
