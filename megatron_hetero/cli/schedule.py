"""`megatron-hetero schedule`: the schedule tables of a layout, checked by simulation.

    megatron-hetero schedule DISJOINT.yaml --micro-batches M [--json] [--full]
        [--stage-cost NAME=F,B ...] [--module-cost NAME=F,B ...] [--latency L] [--world-size N]
    megatron-hetero schedule COLOCATED.yaml [--global-batch-size G] [--micro-batch-size B]
        [--hetero-offload-encoder] [--json] [--world-size N]

Disjoint: prints every stage's compute order (warm-up | steady | cool-down), the links it receives
from and sends to, the checker verdict in both execution models (buffered sends, and rendezvous:
the batches the runtime posts, which must complete with zero buffering) and the predicted bubble
fraction (`--full`: every batch, compact tokens `ra3<vision/1` = receive activation of mb 3 from
vision/1, `sg3>vision/1` = send gradient, `+` joins the operations of one batch).
Colocated: prints every rank's three-phase table (`plan/colocated.py`) and the checker's verdict.
Exit codes: 0 ok, 2 invalid input (message on stderr), 1 the checker rejected the generated tables.
Pure (no torch): `plan/schedule.py`, `plan/colocated.py`, `plan/schedule_check.py`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from megatron_hetero.cli import CommandFailed
from megatron_hetero.report.draw import draw_schedule

NAME = "schedule"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `schedule` subcommand to an argparse subparsers object; returns its parser."""
    p = sub.add_parser(NAME, help="per-stage graph-aware 1F1B tables of a disjoint layout, checked")
    p.add_argument("layout", help="layout YAML")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        metavar="M",
        help="disjoint: micro-batches per step (1..64), required",
    )
    p.add_argument("--global-batch-size", type=int, default=8, help="colocated: samples per step (default 8)")
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=1,
        help="colocated: the language model's per-rank micro-batch (default 1)",
    )
    p.add_argument("--hetero-offload-encoder", action="store_true", help="colocated: offload encoders in phase 2")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    p.add_argument("--full", action="store_true", help="print every action of every stage (text mode)")
    p.add_argument("--world-size", type=int, default=None, help="total ranks (default: what the layout uses)")
    p.add_argument(
        "--stage-cost",
        action="append",
        default=[],
        metavar="NAME=F,B",
        help="forward,backward cost of each stage of module NAME (default 1,2)",
    )
    p.add_argument(
        "--module-cost",
        action="append",
        default=[],
        metavar="NAME=F,B",
        help="total forward,backward cost of module NAME, split evenly over its pp stages",
    )
    p.add_argument("--latency", type=float, default=0.0, help="latency of every message (default 0)")
    p.add_argument(
        "--draw",
        default=None,
        metavar="FILE.png",
        help="also draw the planned per-rank timeline (disjoint: simulated stage spans; colocated: "
        "the phases with nominal costs; needs matplotlib)",
    )
    return p


def _draw(layout, args: argparse.Namespace, **kwargs) -> None:
    import sys

    try:
        summary = draw_schedule(layout, args.draw, **kwargs)
    except ImportError as exc:
        raise CommandFailed(str(exc)) from None
    print(
        f"drew the planned timeline of {len(summary['ranks'])} ranks ({summary['bars']} spans) -> {args.draw}",
        file=sys.stderr if args.json else sys.stdout,
    )


def _parse_costs(values: list[str], flag: str) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for text in values:
        name, eq, rest = text.partition("=")
        parts = rest.split(",")
        try:
            if not eq or not name.strip() or len(parts) != 2:
                raise ValueError
            pair = (float(parts[0]), float(parts[1]))
        except ValueError:
            raise ValueError(f"{flag} {text!r} is not of the form NAME=FORWARD,BACKWARD (e.g. vision=1,2)") from None
        if name.strip() in out:
            raise ValueError(f"{flag}: module {name.strip()!r} given twice")
        out[name.strip()] = pair
    return out


def _ranks_text(ranks: tuple) -> str:
    if not ranks:
        return "-"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _document(layout, tables, graph, report, error, micro_batches: int) -> dict[str, Any]:
    stages = []
    for st, t in tables.items():
        entry: dict[str, Any] = {
            "stage": str(st),
            "module": st.module,
            "pp": st.pp,
            "ranks": list(t.ranks),
            "depth": graph.depth[st],
            "dist_to_sink": graph.dist_to_sink[st],
            "warmup": t.warmup,
            "steady": t.steady,
            "cooldown": t.cooldown,
            "forward_cost": t.forward_cost,
            "backward_cost": t.backward_cost,
            "recv_from": [str(lk.src) for lk in graph.incoming[st]],
            "send_to": [str(lk.dst) for lk in graph.outgoing[st]],
            "compute": [a.short() for a in t.compute()],
            "actions": [a.short() for a in t.actions],
        }
        if report is not None:
            entry.update(busy=report.busy[st], idle=report.idle[st], finish=report.finish[st])
        stages.append(entry)
    check: dict[str, Any] = {"ok": report is not None}
    if report is not None:
        check.update(
            message=report.summary(),
            makespan=report.makespan,
            bubble_fraction=report.bubble_fraction,
            messages=report.messages,
        )
    else:
        check.update(message=str(error))
    return {
        "placement": layout.placement,
        "world_size": layout.world_size,
        "micro_batches": micro_batches,
        "links": [str(lk) for lk in graph.links],
        "stages": stages,
        "check": check,
    }


def _text(tables, graph, report, error, full: bool, micro_batches: int) -> str:
    lines = [f"graph-aware 1F1B: {len(tables)} stages, {len(graph.links)} links, {micro_batches} micro-batches"]
    width = max(len(str(st)) for st in tables)
    rwidth = max(len(_ranks_text(t.ranks)) for t in tables.values())
    lines.append(f"{'stage':<{width}}  {'ranks':<{rwidth}}  depth  to-sink  warmup  steady  cooldown  cost f/b")
    for st, t in tables.items():
        lines.append(
            f"{str(st):<{width}}  {_ranks_text(t.ranks):<{rwidth}}  {graph.depth[st]:>5}  {graph.dist_to_sink[st]:>7}  "
            f"{t.warmup:>6}  {t.steady:>6}  {t.cooldown:>8}  {t.forward_cost:g}/{t.backward_cost:g}"
        )
    lines.append("")
    for st, t in tables.items():
        src = ",".join(str(lk.src) for lk in graph.incoming[st]) or "-"
        dst = ",".join(str(lk.dst) for lk in graph.outgoing[st]) or "-"
        lines.append(f"{str(st):<{width}}  {t.compact()}   (recv from {src}; send to {dst})")
        if full:
            lines.append(
                f"{'':<{width}}  "
                + " ".join("+".join(a.short() for a in b) if isinstance(b, tuple) else b.short() for b in t.batches())
            )
    lines.append("")
    if report is not None:
        lines.append(f"check: {report.summary()}")
        lines.append("rendezvous (zero buffering, the runtime's batches): ok, no deadlock")
        lines.append("idle:  " + ", ".join(f"{st} {report.idle[st]:g}" for st in tables))
        lines.append(f"bubble fraction: {report.bubble_fraction:.4f}")
    else:
        lines.append(f"check: FAILED: {error}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Body of the subcommand: ValueError for invalid input (exit 2), CommandFailed (exit 1) when the
    checker rejects the generated tables (after printing them)."""
    from megatron_hetero.layout.yaml_io import load_layout
    from megatron_hetero.plan.schedule import build_tables, stage_graph
    from megatron_hetero.plan.schedule_check import ScheduleError, check_tables, simulate_leader_routes

    layout = load_layout(args.layout, args.world_size)
    if layout.placement == "colocated":
        return _colocated(layout, args)
    if args.micro_batches is None:
        raise ValueError("--micro-batches M is required for a disjoint layout")
    stage_costs = _parse_costs(args.stage_cost, "--stage-cost")
    module_costs = _parse_costs(args.module_cost, "--module-cost")
    if not args.latency >= 0.0:
        raise ValueError(f"--latency must be >= 0, got {args.latency}")
    tables = build_tables(layout, args.micro_batches, stage_costs=stage_costs, module_costs=module_costs)
    graph = stage_graph(layout)
    tables = dict(sorted(tables.items(), key=lambda kv: (graph.depth[kv[0]], graph.stages.index(kv[0]))))
    report, error = None, None
    try:
        report = check_tables(tables, layout=layout, micro_batches=args.micro_batches, latency=args.latency)
        check_tables(tables, layout=layout, micro_batches=args.micro_batches, mode="rendezvous")
        if layout.boundary_mode == "hierarchical":  # the edges' leader routes, one blocking exchange each
            simulate_leader_routes(tables, {(e.src, e.dst): i for i, e in enumerate(layout.edges)})
    except ScheduleError as exc:  # a generator bug, not a user error
        error = exc
    if args.json:
        print(json.dumps(_document(layout, tables, graph, report, error, args.micro_batches), indent=1))
    else:
        print(_text(tables, graph, report, error, args.full, args.micro_batches))
    if error is not None:
        raise CommandFailed(f"generated tables failed the check: {error}")
    if args.draw:
        _draw(
            layout,
            args,
            micro_batches=args.micro_batches,
            stage_costs=stage_costs,
            module_costs=module_costs,
            latency=args.latency,
        )
    return 0


def _colocated(layout, args: argparse.Namespace) -> int:
    """The three-phase tables of a colocated layout, one block per rank, and the checker's verdict."""
    from megatron_hetero.plan.colocated import check_colocated_tables, colocated_tables

    tables = colocated_tables(layout, args.global_batch_size, args.micro_batch_size, args.hetero_offload_encoder)
    try:
        messages = check_colocated_tables(tables)
        error = None
    except ValueError as exc:  # a generator bug, not a user error
        messages, error = 0, exc
    verdict = (
        f"ok: {len(tables)} ranks, {messages} pipeline messages matched, collectives in one order, no deadlock"
        if error is None
        else f"FAILED: {error}"
    )
    if args.json:
        doc = {
            "placement": "colocated",
            "world_size": layout.world_size,
            "ranks": [
                {"rank": r, "phases": {name: [str(a) for a in acts] for name, acts in t.phases}}
                for r, t in tables.items()
            ],
            "check": {"ok": error is None, "message": verdict},
        }
        print(json.dumps(doc, indent=1))
    else:
        print(
            f"three-phase colocated schedule: {layout.world_size} ranks, global batch {args.global_batch_size}, "
            f"micro-batch {args.micro_batch_size}"
        )
        for t in tables.values():
            print(t.format())
        print(f"check: {verdict}")
    if error is not None:
        raise CommandFailed(f"generated tables failed the check: {error}")
    if args.draw:
        _draw(
            layout,
            args,
            global_batch=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            offload=args.hetero_offload_encoder,
        )
    return 0
