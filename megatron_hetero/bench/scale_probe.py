"""The plugin's own planning at one world size, timed in one process: what `bench scale` runs in the
tree under test and in an older tree beside it (`--before-tree`), so both are measured on the same
machine in the same run.

    python megatron_hetero/bench/scale_probe.py WORLD {colocated|disjoint} TIMEOUT_S

It imports `megatron_hetero` from whatever tree is first on the path and prints one JSON object:
`{"world": W, "layout": kind, "rank_plan_s", "boundary_s", "validate_s", "plugin_s", "plan_cli_s",
"per_rank": "one rank" | "every rank"}` (seconds; a string ">T" for a step stopped at its timeout).

- `rank_plan_s`: rank 0's plan (`plan.rank_plan.rank_plan`; in trees before per-rank plans this call
  built every rank's plan);
- `boundary_s`: rank 0's boundary plan of the edge as a rank of `train` computes it at start (the
  per-rank `plan_rank_boundary`; in older trees the runtime's whole-edge `plan_boundary`);
- `validate_s`: the batch arithmetic a rank's validation runs (`check_rank_plans`; in older trees
  `rank_plans`, run twice per process by `validate_job`);
- `plugin_s`: what rank 0 of `train` computed itself at start in that tree: validation (as often as
  that tree ran it) + its rank plan + one boundary plan per sequence shape;
- `plan_cli_s`: `megatron-hetero plan LAYOUT` in a subprocess of the same interpreter and path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

#: two layouts of the scale benchmark (the scale note's L and a disjoint twin): vision DP over the
#: world (or its first half), language TP8·PP4 over the world (or its second half)
KINDS = ("colocated", "disjoint")


def layout_doc(world: int, kind: str) -> dict[str, Any]:
    """The YAML document of layout `kind` at `world` ranks (world a multiple of 64)."""
    if kind not in KINDS:
        raise ValueError(f"layout kind must be one of {KINDS}, got {kind!r}")
    if world < 64 or world % 64:
        raise ValueError(f"world {world}: the scale layouts need a multiple of 64 ranks")
    if kind == "colocated":
        mods = {"vision": {"dp": world}, "language": {"tp": 8, "pp": 4, "dp": world // 32}}
    else:
        mods = {"vision": {"dp": world // 2}, "language": {"tp": 8, "pp": 4, "dp": world // 64}}
    return {"placement": kind, "modules": mods, "edges": ["vision -> language"]}


def batch_of(world: int, kind: str) -> tuple[int, int]:
    """(global batch, micro-batch size) every module's DP divides, four language micro-batches."""
    lang_dp = world // 32 if kind == "colocated" else world // 64
    vision_dp = world if kind == "colocated" else world // 2
    mbs = max(1, vision_dp // lang_dp)  # a disjoint micro-batch must split over the vision DP too
    return 4 * lang_dp * mbs, mbs


class _Timeout(Exception):
    pass


def _alarm(signum, frame):  # pragma: no cover - only on a timeout
    raise _Timeout()


def timed(fn: Callable[[], Any], timeout_s: int) -> float | str:
    """Seconds `fn` took, or ">T" when it ran past `timeout_s` (stopped by SIGALRM)."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, int(timeout_s)))
    t0 = time.perf_counter()
    try:
        fn()
        return time.perf_counter() - t0
    except _Timeout:
        return f">{int(timeout_s)}"
    finally:
        signal.alarm(0)


def probe(world: int, kind: str, timeout_s: int, plan_cli: bool = True) -> dict[str, Any]:
    """Time the tree's own planning for rank 0 of layout `kind` at `world` ranks (module docstring;
    `plan_cli` False: without the `plan` CLI subprocess)."""
    import yaml

    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.plan import rank_plan as RP
    from megatron_hetero.report.plan import default_shape

    doc = layout_doc(world, kind)
    layout = layout_from_dict(doc)
    g, mbs = batch_of(world, kind)
    shape = default_shape(layout)
    edge = layout.edges[0]
    try:
        from megatron_hetero.plan.boundary_rank import plan_rank_boundary

        def boundary() -> Any:
            return plan_rank_boundary(layout, edge, shape, 0)

        per_rank, checks = "one rank", 1
        validate = RP.check_rank_plans
    except ImportError:  # before per-rank plans: the runtime planned the whole edge; validate_job ran twice
        from megatron_hetero.plan.boundary import plan_boundary

        def boundary() -> Any:
            return plan_boundary(layout, edge, shape)

        per_rank, checks = "every rank", 2
        validate = RP.rank_plans
    out: dict[str, Any] = {"world": world, "layout": kind, "per_rank": per_rank}
    out["validate_s"] = timed(lambda: validate(layout, g, mbs), timeout_s)
    out["rank_plan_s"] = timed(lambda: RP.rank_plan(layout, 0, g, mbs), timeout_s)
    out["boundary_s"] = timed(boundary, timeout_s)
    parts = [out["validate_s"]] * checks + [out["rank_plan_s"], out["boundary_s"]]
    out["plugin_s"] = sum(parts) if all(isinstance(p, float) for p in parts) else f">{int(timeout_s)}"
    if not plan_cli:
        return out
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(doc, f)
    try:
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "megatron_hetero", "plan", f.name],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout_s,
            env=os.environ,
            check=True,
        )
        out["plan_cli_s"] = time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        out["plan_cli_s"] = f">{int(timeout_s)}"
    finally:
        os.unlink(f.name)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: scale_probe.py WORLD {colocated|disjoint} TIMEOUT_S", file=sys.stderr)
        return 2
    print(json.dumps(probe(int(argv[0]), argv[1], int(argv[2]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
