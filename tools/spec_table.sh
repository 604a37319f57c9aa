#!/usr/bin/env bash
# Runs the README's 16-row speculation table: `bench spec` with every mode on
# stories-24l and stories-24l-skip, fp32 and bf16, short prompts and 1000-token
# contexts, a cold and a warm plan cache, each run after a fresh latency
# profile. Writes one JSON per (model, dtype, cache) into OUT_DIR and prints
# the table with tools/spec_table.py. About 35 minutes on 2 cores.
#
#   tools/spec_table.sh [OUT_DIR]          (default: ./spec_table)
#
# Environment: KNAPSERVE (the binary, default build/tools/knapserve),
# KNAPSERVE_SHARED (the data folder, default ../shared), COLD_REPEATS (8),
# WARM_REPEATS (8), MODELS (stories-24l stories-24l-skip), DTYPES (fp32 bf16).
# Anchors for knn are built once per model into OUT_DIR (<model>.anchors)
# and reused when present. Nothing else may run on the machine meanwhile:
# the cells are ratios of timings.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-spec_table}"
bin="${KNAPSERVE:-$here/build/tools/knapserve}"
S="${KNAPSERVE_SHARED:-$here/../shared}"
cold="${COLD_REPEATS:-8}"
warm="${WARM_REPEATS:-8}"
mkdir -p "$out"
# The static mask: every other sublayer of layers 6-17.
M=a6,m6,a7,m7,a8,m8,a9,m9,a10,m10,a11,m11,a12,m12,a13,m13,a14,m14,a15,m15,a16,m16,a17,m17
A="stories=$S/bench/stories/prompts.jsonl,stories=$S/corpus/stories_train_sample.txt"
A="$A,novels=$S/bench/novels/prompts.jsonl,novels=$S/corpus/novels_sample.txt"
for model in ${MODELS:-stories-24l stories-24l-skip}; do
  if [[ ! -s "$out/$model.anchors" ]]; then
    "$bin" anchors --model "$S/models/$model" --threads 2 --domains "$A" \
      --out "$out/$model.anchors"
  fi
  for dtype in ${DTYPES:-fp32 bf16}; do
    for cache in cold warm; do
      name="${model}_${dtype}_${cache}"
      extra=(--repeats "$cold")
      [[ $cache == warm ]] && extra=(--warm-plan-cache --repeats "$warm")
      echo "== $name $(date -u +%H:%M:%S)" >&2
      "$bin" profile --model "$S/models/$model" --dtype "$dtype" --threads 2 \
        --profile-contexts 128,512,1024,1536 --out "$out/$name.profile.json" \
        > "$out/$name.profile.log" 2>&1
      "$bin" bench spec --model "$S/models/$model" --dtype "$dtype" \
        --threads 2 --prompts "$S/bench/stories/prompts.jsonl" \
        --num-prompts 6 --max-new-tokens 128 --skip "$M" --max-draft 4 \
        --modes off,static,off,clasp,off,knapspec,off,knn,off,specbound,off \
        --profile "$out/$name.profile.json" --anchors "$out/$model.anchors" \
        --long-context-tokens 1000 "${extra[@]}" --json \
        > "$out/$name.json" 2> "$out/$name.log"
    done
  done
done
python3 "$here/tools/spec_table.py" "$out"
