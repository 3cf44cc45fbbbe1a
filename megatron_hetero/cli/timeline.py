"""`megatron-hetero timeline`: draw a trace (`train --trace FILE.json`) as a per-rank Gantt chart.

    megatron-hetero timeline TRACE.json [--out TIMELINE.png] [--title TEXT]

One row per rank, one bar per span coloured by its kind (encoder/LLM forward and backward,
boundary, communication batch, wait, gradient reduction, optimizer, ...), nested spans thinner on
top of their parents, and a legend. Needs matplotlib (`pip install -e '.[bench]'`). Exit codes:
0 drawn, 2 the file is missing or not a trace, 1 matplotlib is missing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_hetero.cli import CommandFailed
from megatron_hetero.report.draw import draw_timeline

NAME = "timeline"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="draw a trace (train --trace) as a per-rank Gantt chart")
    p.add_argument("trace", help="trace file written by `megatron-hetero train --trace FILE.json`")
    p.add_argument("--out", default=None, help="PNG to write (default: the trace's name with .png)")
    p.add_argument("--title", default=None, help="figure title (default: the traced layout)")
    return p


def run(args: argparse.Namespace) -> int:
    path = Path(args.trace)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no 'traceEvents' list)")
    out = Path(args.out) if args.out else path.with_suffix(".png")
    try:
        summary = draw_timeline(doc, out, args.title)
    except ImportError as exc:
        raise CommandFailed(str(exc)) from None
    print(f"timeline of {len(summary['ranks'])} ranks, {summary['bars']} spans -> {out}")
    return 0
