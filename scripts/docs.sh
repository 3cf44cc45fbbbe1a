#!/usr/bin/env bash
# Build the documentation site strictly (mkdocs.yml: broken links, missing pages and unknown anchors
# fail the build) into build/site. Installs mkdocs==1.6.1 into the given Python's environment when it
# is missing (the `docs` extra).
# Usage: scripts/docs.sh [PYTHON]   (default: .venv/bin/python if it exists, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
if ! "$py" -c 'import mkdocs, sys; sys.exit(0 if mkdocs.__version__ == "1.6.1" else 1)' 2>/dev/null; then
  "$py" -m pip install -q "mkdocs==1.6.1"
fi
exec "$py" -m mkdocs build --strict --site-dir build/site
