#!/usr/bin/env bash
# Create .venv (if missing) on a Python >= 3.12 and install megatron-hetero into it.
# Python: $PYTHON if set, else python3.13 / python3.12 / python3 on PATH (the first that is >= 3.12),
# else pyenv's newest 3.12+ (megatron-core 0.17 and later require Python >= 3.12).
# torch==2.13.0 and megatron-core==0.19.2 go first, pinned: on Python 3.12 the registry has only
# torch's CUDA build (about 4.8 GB installed; it runs on CPU), and the pin keeps pip from taking a
# newer one. Never installs transformer-engine or apex (the `gpu` extra only).
# Usage: scripts/install.sh [EXTRA[,EXTRA]]   e.g. scripts/install.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

is_312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  if [ -n "${PYTHON:-}" ]; then
    is_312 "$PYTHON" || { echo "install.sh: PYTHON=$PYTHON is not a Python >= 3.12" >&2; return 1; }
    echo "$PYTHON"; return 0
  fi
  local c
  for c in python3.13 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && is_312 "$(command -v "$c")"; then command -v "$c"; return 0; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local root v
    root="$(pyenv root)"
    for v in $(ls "$root/versions" 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])\.[0-9]+$' | sort -t. -k1,1n -k2,2n -k3,3n -r); do
      if is_312 "$root/versions/$v/bin/python3"; then echo "$root/versions/$v/bin/python3"; return 0; fi
    done
  fi
  echo "install.sh: no Python >= 3.12 found (tried \$PYTHON, python3.13, python3.12, python3, pyenv's versions);" \
    "megatron-core 0.19 needs one: install it, or set PYTHON=/path/to/python3.12" >&2
  return 1
}

if [ -x .venv/bin/python ] && ! is_312 .venv/bin/python; then
  echo "install.sh: .venv is $(.venv/bin/python -V 2>&1), older than 3.12: making it anew" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  py="$(find_python)"
  echo "install.sh: making .venv with $py ($("$py" -V 2>&1))"
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q "torch==2.13.0" "megatron-core==0.19.2"
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[${extras}]"
else
  .venv/bin/python -m pip install -q -e .
fi
