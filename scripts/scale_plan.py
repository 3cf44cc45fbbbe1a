"""Time the plugin's planning at large worlds, one process (not a test: it prints a table).

    PYTHONPATH=$PWD python scripts/scale_plan.py [--worlds 1024,4096,16384,65536] [--cli-timeout 120]

For each world W and two layouts (colocated: vision DP=W, language TP8·PP4·DP=W/32; disjoint:
vision DP=W/2 on the first half, language TP8·PP4·DP=W/64 on the second half) it times the boundary
plan of the one edge as a rank computes it at start (rank 0 and the last rank), one rank's rank plan,
and the `megatron-hetero plan` CLI (a subprocess). Runs against older trees too: where the per-rank
boundary plan does not exist it times the whole-world `plan_boundary` the runtime used.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def layouts(world: int) -> dict[str, dict]:
    return {
        "colocated": {
            "placement": "colocated",
            "modules": {"vision": {"dp": world}, "language": {"tp": 8, "pp": 4, "dp": world // 32}},
            "edges": ["vision -> language"],
        },
        "disjoint": {
            "placement": "disjoint",
            "modules": {"vision": {"dp": world // 2}, "language": {"tp": 8, "pp": 4, "dp": world // 64}},
            "edges": ["vision -> language"],
        },
    }


def _timed(fn) -> str:
    t = time.perf_counter()
    fn()
    return f"{time.perf_counter() - t:.4f}"


def boundary_of(layout, rank: int):
    from megatron_hetero.report.plan import default_shape

    shape = default_shape(layout)
    try:
        from megatron_hetero.plan.boundary_rank import plan_rank_boundary
    except ImportError:  # before per-rank plans: the runtime planned the whole edge
        from megatron_hetero.plan.boundary import plan_boundary

        return lambda: plan_boundary(layout, layout.edges[0], shape)
    return lambda: plan_rank_boundary(layout, layout.edges[0], shape, rank)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", default="1024,4096,16384,65536")
    p.add_argument("--cli-timeout", type=float, default=120.0)
    p.add_argument("--skip-boundary-above", type=int, default=1 << 30, help="skip the boundary timing above W")
    p.add_argument("--skip-rank-plan-above", type=int, default=1 << 30)
    p.add_argument("--whole", action="store_true", help="also time the whole-edge plan_boundary (report, draw)")
    p.add_argument("--repeat", type=int, default=1, help="CLI runs per cell (the minimum is printed)")
    args = p.parse_args()
    import yaml

    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.plan.rank_plan import rank_plan

    print(
        "layout     world   boundary r0 (s)  boundary last (s)  rank_plan r0 (s)  rank_plan last (s)"
        + ("     whole edge (s)" if args.whole else "")
        + "  plan CLI (s)"
    )
    for w in (int(x) for x in args.worlds.split(",")):
        for name, doc in layouts(w).items():
            layout = layout_from_dict(doc)
            last = layout.world_size - 1
            cells = []
            for r in (0, last):
                cells.append(_timed(boundary_of(layout, r)) if w <= args.skip_boundary_above else "-")
            g = 4 * w  # a global batch every module's DP divides, 4 micro-batches of the language model
            for r in (0, last):
                mbs = g // (4 * (w // 32 if name == "colocated" else w // 64))
                cells.append(_timed(lambda: rank_plan(layout, r, g, mbs)) if w <= args.skip_rank_plan_above else "-")
            if args.whole:
                from megatron_hetero.plan.boundary import plan_boundary
                from megatron_hetero.report.plan import default_shape

                cells.append(_timed(lambda: plan_boundary(layout, layout.edges[0], default_shape(layout))))
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
                yaml.safe_dump(doc, f)
            runs = []
            try:
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    subprocess.run(
                        [sys.executable, "-m", "megatron_hetero", "plan", f.name],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        timeout=args.cli_timeout,
                        env=os.environ,
                        check=True,
                    )
                    runs.append(time.perf_counter() - t)
                cli = f"{min(runs):.2f}"
            except subprocess.TimeoutExpired:
                cli = f">{args.cli_timeout:.0f}"
            finally:
                os.unlink(f.name)
            print(f"{name:<10} {w:>6}  " + "  ".join(f"{c:>16}" for c in cells) + f"  {cli:>12}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
