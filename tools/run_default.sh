#!/usr/bin/env bash
# Builds knapserve (installing packages if needed) and runs the main job:
# greedy generation on the default model: $KNAPSERVE_MODEL, else the bundled
# stories260k (tools/models/stories260k, which the build copies to
# $BUILD_DIR/share/knapserve/models/ where build/tools/knapserve finds it).
# Needs nothing outside the clone. Extra arguments go to `knapserve generate`
# (e.g. --model DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
exec "${BUILD_DIR:-build}/tools/knapserve" generate --prompt "${PROMPT:-Once upon a time}" \
  --max-new-tokens 64 --temperature 0 "$@"
