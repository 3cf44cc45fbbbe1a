#!/usr/bin/env bash
# Lint the tree with the tools and settings of pyproject.toml: `ruff check .`, `ruff format --check .`
# and `mypy` (the pure floors, [tool.mypy] files). Installs the dev extra into .venv first when ruff or
# mypy is missing there (scripts/install.sh dev: CPU torch pin first, as for the tests).
# Runs every step and exits non-zero if any failed.
#
# Usage: scripts/lint.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if ! { [ -x .venv/bin/ruff ] && [ -x .venv/bin/mypy ]; }; then
  bash scripts/install.sh dev
fi
rc=0
step() {
  echo "+ $*"
  "$@" || { rc=1; echo "scripts/lint.sh: failed: $*" >&2; }
}
step .venv/bin/ruff check .
step .venv/bin/ruff format --check .
step .venv/bin/mypy
exit "$rc"
