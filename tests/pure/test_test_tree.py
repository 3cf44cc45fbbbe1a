"""The test tree itself: pytest imports each test file as a top-level module named by its basename
(the folders have no `__init__.py`, and tests import helpers such as `parity` by name), so two test
files with one basename in different folders stop the whole suite at collection ("import file
mismatch"). A run of one folder does not see it; this check does."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" not in path.parts:
            by_name[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"test modules share a basename (rename one of each): {shared}"
    assert len(by_name) > 50  # the walk saw the tree
