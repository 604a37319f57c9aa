#!/usr/bin/env bash
# Lints the protobuf contract (proto/knapserve/v1/*.proto) with buf, using
# proto/buf.yaml (STANDARD + COMMENTS rules), and checks buf's formatting.
#
#   tools/lint_protos.sh           # lint + format check
#   tools/lint_protos.sh --fix     # rewrite the files in buf's format, then lint
#
# buf comes from $BUF if set, else from <repo>/.cache/buf (installed there from
# the npm registry on first use; .cache/ is git-ignored), else from PATH.
# Exit status: 0 clean, non-zero on lint or format findings or a missing buf.
set -euo pipefail

readonly BUF_VERSION="1.75.0"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${repo}/.cache/buf"

find_buf() {
  if [[ -n "${BUF:-}" ]]; then
    echo "${BUF}"
  elif [[ -x "${cache}/node_modules/.bin/buf" ]]; then
    echo "${cache}/node_modules/.bin/buf"
  elif command -v npm >/dev/null 2>&1; then
    echo "lint_protos: installing @bufbuild/buf@${BUF_VERSION} into ${cache}" >&2
    mkdir -p "${cache}"
    npm install --prefix "${cache}" --no-audit --no-fund --loglevel=error \
      "@bufbuild/buf@${BUF_VERSION}" >&2
    echo "${cache}/node_modules/.bin/buf"
  elif command -v buf >/dev/null 2>&1; then
    command -v buf
  else
    echo "lint_protos: buf not found and npm is not installed" >&2
    return 1
  fi
}

buf="$(find_buf)"
cd "${repo}/proto"
echo "lint_protos: $("${buf}" --version 2>&1 | head -n1) in ${PWD}" >&2

if [[ "${1:-}" == "--fix" ]]; then
  "${buf}" format --write
fi

status=0
"${buf}" lint || status=1
if ! "${buf}" format --diff --exit-code; then
  echo "lint_protos: formatting differs from buf format (run $0 --fix)" >&2
  status=1
fi
if [[ ${status} -eq 0 ]]; then
  echo "lint_protos: OK" >&2
fi
exit ${status}
