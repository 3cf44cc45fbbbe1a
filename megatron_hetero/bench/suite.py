"""The benchmarks by name (`megatron-hetero bench NAME`): each runs its cases side by side in one
process tree, writes OUT/NAME.json (and NAME.png with matplotlib) and returns its document."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Optional

BENCHMARKS = ("boundary", "schedule", "planner", "soak", "faults", "e2e", "autotune", "peer", "zb", "scale")
#: iterations per case; schedule, soak, e2e, autotune, zb: steps (faults: cells; peer: iterations per script run; scale: unused)
DEFAULT_ITERS = {
    "boundary": 10,
    "schedule": 4,
    "planner": 6,
    "soak": 300,
    "faults": 1,
    "e2e": 6,
    "autotune": 150,
    "peer": 8,
    "zb": 4,
    "scale": 1,
}


def _module(name: str):
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; benchmarks are {list(BENCHMARKS)}")
    return importlib.import_module(f"megatron_hetero.bench.{name}")


def run_benchmark(
    name: str, out: Path, iters: Optional[int] = None, quick: bool = False, before_tree: Optional[str] = None
) -> dict[str, Any]:
    """Run benchmark `name` with `iters` iterations per case (default DEFAULT_ITERS; the schedule
    benchmark runs at least 2 steps; `quick`: e2e only); writes its files under `out` and returns its document.
    `before_tree` (scale only): an older checkout whose planning is timed beside this tree's."""
    if iters is not None and iters < 1:
        raise ValueError(f"--iters must be >= 1, got {iters}")
    if before_tree is not None and name != "scale":
        raise ValueError("--before-tree applies to `bench scale` only")
    bench = _module(name)
    if name == "scale":  # worlds of 1,024-65,536 ranks on the fake process group (--quick: 64 and 256)
        return bench.run(Path(out), worlds=bench.QUICK_WORLDS if quick else bench.WORLDS, before_tree=before_tree)
    if name == "autotune":  # steps per run; --quick: e2e's small models, windows of 3 steps
        return bench.run(
            Path(out),
            iters=iters or (10 if quick else DEFAULT_ITERS[name]),
            steps=3 if quick else bench.STEPS,
            quick=quick,
        )
    if name == "peer":  # iterations per script run; --quick: two cases, one round, 4 iterations
        return bench.run(
            Path(out), iters=iters or (4 if quick else DEFAULT_ITERS[name]), rounds=1 if quick else 3, quick=quick
        )
    iters = iters or (2 if quick else DEFAULT_ITERS[name])
    if name == "zb":  # steps per run, two alternating pairs of runs per layout
        return bench.run(Path(out), steps=max(iters, 2))
    if name == "schedule":
        return bench.run(Path(out), steps=max(iters, 2))
    if name == "soak":  # growth measured from step 50 (from step iters // 3 in runs of 100 steps or fewer)
        return bench.run(Path(out), steps=max(iters, 3), warmup=50 if iters > 100 else max(1, iters // 3))
    if name == "faults":  # the fault matrix: cells, not iterations (`--quick`: a covering subset)
        return bench.run(Path(out), quick=quick)
    if name == "e2e":  # --quick: smaller models, a small profile, one round (the smoke test's)
        return bench.run(Path(out), iters=iters, quick=quick)
    return bench.run(Path(out), iters=iters)


def table(name: str, doc: dict[str, Any]) -> str:
    """The markdown table of benchmark `name`'s document."""
    return _module(name).table(doc)
