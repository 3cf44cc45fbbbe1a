"""`megatron-hetero profile`: measure the local host's cost profile (layer and collective times) and write
it as JSON for `megatron-hetero search --profile PROFILE.json`.

    megatron-hetero profile --world-size 8 --out profile.json [--quick]

Ranks are forked on the local host (gloo on CPU, NCCL on GPU) and measured all busy at once; see
`profiling/kernels.py` for what is measured and how it is fitted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NAME = "profile"
USES_MEGATRON = True  # run_command applies megatron_hetero.compat first


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="measure layer and collective times on the local host; write a cost profile",
        description="Measure transformer-layer times (per module kind, tokens, hidden, TP, CP), "
        "whole-module overheads and collective times (per kind, group size, bytes) on "
        "forked ranks; fit the cost model's profile and write it as JSON.",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=8,
        help="ranks to measure with, all busy at once (default 8; on GPU: the GPUs of the node); use "
        "the world size you will train with: where ranks share a CPU, times depend on it",
    )
    p.add_argument("--out", default="profile.json", help="profile JSON to write (default profile.json)")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds, for checks), not for planning")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the measurement and keep each case's least-disturbed round (default 1)",
    )
    p.add_argument("--json", action="store_true", help="print the whole profile document")
    return p


def run(args: argparse.Namespace) -> int:
    from megatron_hetero.training.job import quiet_upstream_warnings

    quiet_upstream_warnings()
    from megatron_hetero.planner import profile_fit as F
    from megatron_hetero.profiling import run as T

    world = args.world_size
    if world < 2:
        raise ValueError(f"--world-size must be >= 2 (collectives need two ranks), got {world}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    out = Path(args.out)
    if out.exists() and out.is_dir():
        raise ValueError(f"--out {args.out!r} is a directory; give a file name")
    grid = F.ProfileGrid.quick() if args.quick else F.ProfileGrid()
    _, doc = T.run_profile(world, grid, out=out, rounds=args.rounds)
    print(json.dumps(doc, indent=1) if args.json else F.summary(doc))
    if not args.json:
        print(f"\nwrote {out}")
    return 0
