#!/usr/bin/env bash
# Builds knapserve (installing packages if needed) and runs the main job:
# greedy generation on the default model, $KNAPSERVE_MODEL or
# ../shared/models/stories260k. Extra arguments go to `knapserve generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
exec "${BUILD_DIR:-build}/tools/knapserve" generate --prompt "${PROMPT:-Once upon a time}" \
  --max-new-tokens 64 --temperature 0 "$@"
