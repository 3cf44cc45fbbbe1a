#!/usr/bin/env bash
# Install (fresh .venv, CPU torch pin first) and run every check: lint (ruff check, ruff format --check,
# mypy on the pure floors), the docs site built strictly, then the whole test suite. README's test
# command; .ci/run calls it.
# Extra arguments go to pytest: scripts/test.sh -m pure (the quick tier), scripts/test.sh tests/ranks, ...
# --durations=25: the slowest tests, printed at the end of every run.
# Two pytest workers (pytest-xdist), each running whole test files (`--dist loadfile`: a file's module
# fixtures, e.g. the SLURM cluster or a batch of Megatron-LM runs, stay in one process); MH_TEST_WORKERS=0
# runs everything in this process (what a debugger or `-x` wants), MH_TEST_WORKERS=N on N workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,dev,docs
bash scripts/lint.sh
bash scripts/docs.sh .venv/bin/python
workers="${MH_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != "0" ]; then
  # --no-loadscope-reorder: hand out files in tests/conftest.py's RUN_ORDER (slowest first); xdist's
  # default reorders them by test count, which left the SLURM file (10 slow tests) to the very end
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest -q --durations=25 "${parallel[@]}" "$@"
