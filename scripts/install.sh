#!/usr/bin/env bash
# Create .venv (if missing) and install megatron-hetero into it for CPU machines.
# torch==2.13.0 goes first: it is the local CPU wheel; an unpinned torch would pull a multi-GB
# CUDA build. Never installs transformer-engine or apex (GPU extra only).
# Usage: scripts/install.sh [EXTRA[,EXTRA]]   e.g. scripts/install.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[${extras}]"
else
  .venv/bin/python -m pip install -q -e .
fi
