"""Session-wide test setup.

Tiers are folders, and each test gets its folder's marker here (pyproject.toml registers them):

* ``tests/pure``: no torch.distributed, no forked ranks: layouts, plans, schedule tables, cost model
  and search, the sbatch script's text, the import walk. ``pytest -m pure`` is the quick loop.
* ``tests/ranks``: multi-rank CPU/gloo cases under the fork launcher.
* ``tests/e2e``: CLI end-to-end runs (train, bench, convert, data), torchrun, Megatron-LM's scripts.
* ``tests/cluster``: the real local SLURM cluster (also marked ``slurm``).
* ``tests/gpu``: CUDA/NCCL; a single GPU case elsewhere carries ``gpu`` itself.

A file that mixes tiers lives in the highest one. The helpers beside this file (parity.py,
search_reference.py) are importable from every tier (pyproject.toml: ``pythonpath = ["tests"]``).
When ``-m`` names only tiers (``-m pure``, ``-m "pure or ranks"``) the other tier folders are not
collected at all, so ``pytest -m pure`` never imports the multi-rank modules (nor torch through them).

This file is the tests' entry point for `megatron_hetero.compat` (the library assumes an entry point
applied it): `megatron_compat` applies `apply_compat()` once per test session, in the pytest process,
before the first test that needs it: the fork launcher forks every rank from this process, so all
ranks of every multi-rank test inherit the patched Megatron modules. No test module applies compat
itself (importing a test file has no side effect on Megatron).

It is used automatically when collecting imported torch; a session that collected only pure tests
(layouts, plans, schedule tables, cost model: nothing imported torch while collecting) skips it, so
the pure tier stays free of torch and Megatron. Tests in modules that import torch only inside a test
and build Megatron models ask for it by name (`megatron_compat` as an argument, or
`@pytest.mark.usefixtures("megatron_compat")`).

`slow` (pyproject.toml) marks the multi-rank end-to-end cases: every test of the modules in
`END_TO_END` gets it here, and a module can also mark itself (`pytestmark = pytest.mark.slow`, as
gpu/test_gpu.py does). `pytest -m "not slow"` skips them; the default run includes them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Optional

import pytest

#: Tier folders under tests/, lowest first; each is also the marker its tests get.
TIERS = ("pure", "ranks", "e2e", "cluster", "gpu")

#: Test modules that train a model end to end on forked ranks (loss/parameter parity).
END_TO_END = frozenset({"test_colocated_parity.py", "test_disjoint_parity.py"})

TESTS = Path(__file__).resolve().parent
_TIER_NAMES_ONLY = re.compile(r"\s*\w+(\s+or\s+\w+)*\s*")


def tier_of(path: Path) -> Optional[str]:
    """The tier folder a test file lives in, or None for a path outside them."""
    try:
        parts = Path(path).resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def _only_tiers(config: pytest.Config) -> Optional[frozenset[str]]:
    """The tiers a `-m` expression selects when it is a plain `A or B ...` of tier names; None
    otherwise (any other expression can match tests in any folder). `gpu` selects single GPU cases
    outside tests/gpu too, so it never prunes."""
    expr = config.getoption("markexpr", "") or ""
    if not _TIER_NAMES_ONLY.fullmatch(expr):
        return None
    names = frozenset(re.split(r"\s+or\s+", expr.strip()))
    return names if names <= set(TIERS) and "gpu" not in names else None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> Optional[bool]:
    tiers = _only_tiers(config)
    if tiers is not None and collection_path.name in TIERS and collection_path.parent.resolve() == TESTS:
        return collection_path.name not in tiers or None
    return None


#: Test files in the order the suite runs them: the slowest first (the SLURM cluster, then the
#: end-to-end tier with Megatron-LM's scripts leading, then the multi-rank tier), the many short pure
#: files last. Under scripts/test.sh's 2 workers (`--dist loadfile` hands out whole files in this order)
#: the long files start early and the short ones fill the end, so neither worker idles at the tail.
RUN_ORDER = ("cluster", "e2e/test_megatron_lm", "e2e", "ranks", "gpu", "pure")


def run_rank(path: Path) -> int:
    """The position of a test file's group in `RUN_ORDER` (files outside the tiers: last)."""
    try:
        rel = Path(path).resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return len(RUN_ORDER)
    return next((i for i, prefix in enumerate(RUN_ORDER) if rel.startswith(prefix)), len(RUN_ORDER))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: run_rank(item.path))  # stable: files and tests keep their order within a group
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
        if item.path.name in END_TO_END:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def megatron_compat() -> None:
    """`megatron_hetero.compat.apply_compat()`, once per session (idempotent)."""
    from megatron_hetero.compat import apply_compat

    apply_compat()


@pytest.fixture(scope="session", autouse=True)
def _megatron_compat_when_torch_was_collected(request: pytest.FixtureRequest) -> None:
    if "torch" in sys.modules:  # else a pure session: no collected test module uses torch
        request.getfixturevalue("megatron_compat")
