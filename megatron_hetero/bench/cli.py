"""`megatron-hetero bench NAME [--json] [--out DIR]`: run a benchmark, print its table, write JSON/PNG."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

BENCHMARKS = ("boundary", "schedule", "planner")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run; JSON + PNG)")
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("--out", default="bench-results", help="folder for NAME.json and NAME.png")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    p.add_argument("--iters", type=int, default=None,
                   help="iterations per case (default: boundary 10, schedule 4 steps, planner 6 steps)")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.iters is not None and args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    args.iters = args.iters or {"boundary": 10, "schedule": 4, "planner": 6}[args.name]
    out = Path(args.out)
    if args.name == "boundary":
        from megatron_hetero.bench import boundary as bench

        doc = bench.run(out, iters=args.iters)
    elif args.name == "schedule":
        from megatron_hetero.bench import schedule as bench

        doc = bench.run(out, steps=max(args.iters, 2))
    else:
        from megatron_hetero.bench import planner as bench

        doc = bench.run(out, iters=args.iters)
    print(json.dumps(doc, indent=1) if args.json else bench.table(doc))
    if not args.json:
        print(f"\nwrote {out / (args.name + '.json')}")
    return 0
