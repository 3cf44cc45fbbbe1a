#!/usr/bin/env bash
# Install (fresh .venv, CPU torch pin first) and run the whole test suite. README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec .venv/bin/python -m pytest -q "$@"
