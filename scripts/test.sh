#!/usr/bin/env bash
# Install (fresh .venv, CPU torch pin first) and run every check: lint (ruff check, ruff format --check,
# mypy on the pure floors), the docs site built strictly, then the whole test suite. README's test
# command; .ci/run calls it.
# Extra arguments go to pytest: scripts/test.sh -m pure (the quick tier), scripts/test.sh tests/ranks, ...
# --durations=25: the slowest tests, printed at the end of every run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,dev,docs
bash scripts/lint.sh
bash scripts/docs.sh .venv/bin/python
exec .venv/bin/python -m pytest -q --durations=25 "$@"
