"""`megatron-hetero bench NAME [--json] [--out DIR] [--iters N]`: run a benchmark, print its table,
write NAME.json (and NAME.png). The benchmarks: `bench/suite.py`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from megatron_hetero.bench.suite import BENCHMARKS, run_benchmark, table

NAME = "bench"
USES_MEGATRON = True  # run_command applies megatron_hetero.compat first


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="benchmarks (ratios measured side by side in one run; JSON + PNG)")
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("--out", default="bench-results", help="folder for NAME.json and NAME.png")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="iterations per case (default: boundary 10, schedule 4 steps, planner 6 steps, "
        "soak 300 steps, e2e 6 steps, autotune 150 steps per run, peer 8 iterations per script run, zb 4 steps per run)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="faults: a covering subset of the fault matrix; e2e: smaller models, a small profile grid, one round; "
        "autotune: e2e's smaller models, 10 steps per run, measuring windows of 3; "
        "peer: two cases, one round, 4 iterations; "
        "scale: worlds of 64 and 256 ranks",
    )
    p.add_argument(
        "--before-tree",
        default=None,
        metavar="DIR",
        help="scale: an older checkout of megatron-hetero whose planning is timed beside this tree's",
    )
    return p


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    doc = run_benchmark(args.name, out, args.iters, quick=args.quick, before_tree=args.before_tree)
    print(json.dumps(doc, indent=1) if args.json else table(args.name, doc))
    if not args.json:
        print(f"\nwrote {out / (args.name + '.json')}")
    if doc.get("passed") is False:  # a benchmark with a verdict (soak: RSS growth >= 2% or counts changed)
        return 1
    return 0
