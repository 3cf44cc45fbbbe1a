"""Session-wide test setup.

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

`slow` (pytest.ini) marks the multi-rank end-to-end cases: every test of the modules in
`END_TO_END` gets it here, and a module can also mark itself (`pytestmark = pytest.mark.slow`, as
test_gpu.py does). `pytest -m "not slow"` is the quick loop; the default run includes them.
"""
from __future__ import annotations

import sys

import pytest

#: Test modules that train a model end to end on forked ranks (loss/parameter parity).
END_TO_END = frozenset({"test_colocated_parity.py", "test_disjoint_parity.py"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
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
