#!/usr/bin/env bash
# Fails when a C++ file in the tree differs from what clang-format (with the
# repository's .clang-format, Google style) would write. Usage:
#   tools/check_format.sh [--fix] [REPO_ROOT]
# --fix rewrites the files instead of checking them.
set -euo pipefail
fix=0
if [[ ${1:-} == --fix ]]; then fix=1; shift; fi
cd "${1:-$(dirname "$0")/..}"

clang_format=""
for candidate in clang-format-14 clang-format; do
  if command -v "$candidate" >/dev/null; then clang_format=$candidate; break; fi
done
if [[ -z $clang_format ]]; then
  echo "clang-format not found: tools/setup.sh installs it (Debian package clang-format)" >&2
  exit 1
fi

mapfile -t files < <(find common executor planner tools tests \
  \( -name '*.h' -o -name '*.cc' \) -type f | sort)
if [[ $fix == 1 ]]; then
  "$clang_format" -i "${files[@]}"
  echo "check_format: formatted ${#files[@]} files"
  exit 0
fi
report=$(mktemp)
trap 'rm -f "$report"' EXIT
if ! "$clang_format" --dry-run --Werror "${files[@]}" 2>"$report"; then
  grep -E '^[^ ].*: (error|warning):' "$report" | cut -d: -f1 | sort -u |
    sed 's/^/not formatted: /' >&2
  echo "run tools/check_format.sh --fix" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files clean ($("$clang_format" --version | head -1))"
