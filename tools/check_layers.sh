#!/usr/bin/env bash
# Fails when a source file includes a project header its folder may not use.
# The allowed edges are the table in README.md ("Where things are") and, for
# executor's parts, executor/CMakeLists.txt; CMake's target_link_libraries
# mirror them. Every folder of common/, executor/ and planner/ that holds
# sources needs an entry here. Usage: tools/check_layers.sh [REPO_ROOT]
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"

# folder -> project folders its files may include (itself is always allowed),
# or single headers ("common/text/unicode_util.h") where a folder may use one
# header of another and nothing else of it.
declare -A ALLOWED=(
  [common/base]=""
  [common/text]="common/base common/text/jinja"
  # The template engine behind common/text/chat_template.h, internal to
  # common/text (no other folder may include it): of common/text it uses only
  # the UTF-8 helpers it shares with the tokenizer.
  [common/text/jinja]="common/base common/text/unicode_util.h"
  [common/checkpoint]="common/base"
  [common/metrics]="common/base"
  [common/trace]="common/base common/metrics"
  [common/model]="common/base common/checkpoint"
  [common/plan]="common/base common/checkpoint common/model common/trace"
  [common/wire]="common/base common/checkpoint common/model common/plan proto"
  # executor/, bottom up: planning (which plan a sequence uses), engine (the
  # decode loop), api (gRPC and HTTP). The engine and planning know nothing
  # of gRPC, HTTP or the protos (see also the check below); the api reaches
  # the engine only through the service's submit interface: the batch
  # engine, Generate() and its request/result types, and what setting them
  # up takes (the K/V pool, the speculation modes).
  [executor/planning]="common/base common/checkpoint common/model common/plan"
  [executor/engine]="common/base common/text common/checkpoint common/model common/plan common/trace executor/planning"
  [executor/api]="common/base common/text common/checkpoint common/model common/plan common/wire common/metrics common/trace common/rpc proto executor/planning executor/engine/batch_engine.h executor/engine/generator.h executor/engine/kv_pool.h executor/engine/speculation_mode.h"
  [planner]="common/base common/checkpoint common/model common/plan common/wire common/metrics common/trace common/rpc proto"
)
ALLOWED[common/rpc]=""

status=0
checked=0
for folder in "${!ALLOWED[@]}"; do
  [[ -d $folder ]] || { echo "missing folder $folder" >&2; status=1; continue; }
  for file in "$folder"/*.h "$folder"/*.cc; do
    [[ -e $file ]] || continue
    checked=$((checked + 1))
    while IFS= read -r inc; do
      # The folder of the included header: "common/model/llama.h" -> common/model;
      # generated protos ("knapserve/v1/x.pb.h") count as proto.
      case $inc in
        knapserve/v1/*) dir=proto ;;
        */*) dir=${inc%/*} ;;
        *) continue ;;
      esac
      case $dir in common/*|executor|executor/*|planner|tools|tests*|proto) ;; *) continue ;; esac
      [[ $dir == "$folder" ]] && continue
      ok=0
      for allowed in ${ALLOWED[$folder]}; do
        [[ $dir == "$allowed" || $inc == "$allowed" ]] && ok=1
      done
      if [[ $ok == 0 ]]; then
        echo "$file includes \"$inc\": $folder may not use $dir" >&2
        status=1
      fi
    done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$file")
  done
done
# A folder with sources but no entry would go unchecked.
while IFS= read -r dir; do
  if [[ ! -v ALLOWED[$dir] ]]; then
    echo "$dir holds sources but has no entry in tools/check_layers.sh" >&2
    status=1
  fi
done < <(find common executor planner \( -name '*.h' -o -name '*.cc' \) \
           -printf '%h\n' | sort -u)
# The engine and planning know nothing of gRPC, HTTP or protobuf.
for folder in executor/engine executor/planning; do
  if grep -n '#include [<"]\(grpc\|httplib\.h\|google/protobuf/\)' \
       "$folder"/*.h "$folder"/*.cc >&2; then
    echo "$folder must not include gRPC, HTTP or protobuf headers" >&2
    status=1
  fi
done
# The torch-free floors stay torch-free.
for folder in common/base common/text common/text/jinja common/metrics common/trace; do
  if grep -n '#include <\(torch\|ATen\|c10\)/' "$folder"/*.h "$folder"/*.cc >&2; then
    echo "$folder must not include LibTorch" >&2
    status=1
  fi
done
echo "check_layers: $checked files checked"
exit $status
