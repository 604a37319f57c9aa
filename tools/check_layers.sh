#!/usr/bin/env bash
# Fails when a source file includes a project header its folder may not use.
# The allowed edges are the table in README.md ("Architecture"); CMake's
# target_link_libraries mirror them. Usage: tools/check_layers.sh [REPO_ROOT]
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
  [executor]="common/base common/text common/checkpoint common/model common/plan common/wire common/metrics common/trace common/rpc proto"
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
      case $dir in common/*|executor|planner|tools|tests*|proto) ;; *) continue ;; esac
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
# The torch-free floors stay torch-free.
for folder in common/base common/text common/text/jinja common/metrics common/trace; do
  if grep -n '#include <\(torch\|ATen\|c10\)/' "$folder"/*.h "$folder"/*.cc >&2; then
    echo "$folder must not include LibTorch" >&2
    status=1
  fi
done
echo "check_layers: $checked files checked"
exit $status
