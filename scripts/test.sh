#!/usr/bin/env bash
# Install (fresh .venv, CPU torch pin first) and run the whole test suite. README's test command.
# Extra arguments go to pytest: scripts/test.sh -m pure (the quick tier), scripts/test.sh tests/ranks, ...
# --durations=25: the slowest tests, printed at the end of every run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec .venv/bin/python -m pytest -q --durations=25 "$@"
