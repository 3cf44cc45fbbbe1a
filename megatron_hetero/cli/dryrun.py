"""`megatron-hetero dryrun`: train's setup of sampled ranks of a (large) world, on torch's fake
process-group backend, without a cluster.

    megatron-hetero dryrun LAYOUT.yaml [train's model, batch and feature flags] [--ranks 0,17,N-1|all]
                           [--jobs 2] [--no-baseline] [--json FILE]

For each sampled rank (default: rank 0, the last rank, the first rank of every module stage, every
boundary leader), in its own forked process, the rank runs the setup a rank of `train` runs before its
first step (`training.dryrun`): validation, process groups through Megatron's grids (counted), its
plan and schedule table, the boundary plans of every edge for every sequence length the data can
produce, and its modules on the meta device (parameter, gradient and optimizer bytes next to the
memory model's). Beside it, the same module grids created by Megatron's MIMO example (from the
Megatron-LM tree in $MEGATRON_LM) and a homogeneous grid of the world. The schedule checker runs
once for the world, here. Prints a table per rank; `--json FILE` writes
{"world_size": N, "ranks": [{"rank", "plugin_s", "groups_s", "megatron_baseline_s", "groups_member",
"groups_created", "state_bytes": {"built", "predicted"}, "phases"}, ...]}. A bad layout or job exits
2 with the message `train` gives. Details: docs/dryrun.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NAME = "dryrun"
USES_MEGATRON = True


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """train's flags (the same parser code: `cli.train.add_train_flags`), a positional LAYOUT, and the
    dry run's own."""
    from megatron_hetero.cli.train import add_train_flags

    p = sub.add_parser(
        NAME, help="train's setup of sampled ranks of a large world on a fake process group (no cluster)"
    )
    p.add_argument("layout_file", metavar="LAYOUT", nargs="?", help="the layout YAML (or --hetero-layout FILE)")
    add_train_flags(p)
    g = p.add_argument_group("dry run")
    g.add_argument(
        "--ranks",
        default=None,
        help="ranks to run: a comma list (0,17,N-1), or all (small worlds); default rank 0, the last "
        "rank, the first rank of every module stage and every boundary leader",
    )
    g.add_argument("--jobs", type=int, default=2, help="sampled ranks run at the same time (default 2)")
    g.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip Megatron's MIMO grids (megatron_baseline_s) and the homogeneous grid",
    )
    g.add_argument(
        "--state-only",
        action="store_true",
        help="the state bytes only: no boundary plans and no Megatron grids (a large world's memory check)",
    )
    g.add_argument(
        "--regime-row",
        default=None,
        metavar="ENC,LLM,CONTEXT",
        help="instead of LAYOUT and model flags: a row of `search --regime-table` (e.g. 1B,14B,8192) on the "
        "layout the search picks at --nproc-per-node ranks, with the search's state bytes beside",
    )
    g.add_argument("--megatron-lm", default=None, help="Megatron-LM tree with examples/mimo (default $MEGATRON_LM)")
    g.add_argument("--json", default=None, metavar="FILE", help="write the per-rank results as JSON")
    return p


def _layout_args(args: argparse.Namespace) -> None:
    if args.layout_file is not None:
        if args.hetero_layout is not None and args.hetero_layout != args.layout_file:
            raise ValueError(f"two layouts given: {args.layout_file} and --hetero-layout {args.hetero_layout}")
        args.hetero_layout = args.layout_file


def precheck(args: argparse.Namespace) -> None:
    """The layout read and checked before torch is imported (as `train`'s precheck)."""
    from megatron_hetero.cli.train import precheck as train_precheck

    if args.regime_row is not None:
        from megatron_hetero.training.dryrun_regime import parse_row

        parse_row(args.regime_row)
        if args.nproc_per_node is None or args.layout_file or args.hetero_layout:
            raise ValueError("--regime-row takes the world size from --nproc-per-node N and no layout")
        return
    _layout_args(args)
    train_precheck(args)


def _fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**30:.3f}"


def table(doc: dict) -> str:
    """The per-rank table of a dry run's document."""
    head = (
        f"{'rank':>7} {'plugin_s':>9} {'groups_s':>9} {'megatron_s':>10} {'member':>6} {'created':>8} "
        f"{'homog_mem':>9} {'homog_cr':>8} {'state GiB':>9} {'predicted':>9}"
    )
    lines = [head]
    for r in doc["ranks"]:
        h = r.get("baseline", {}).get("homogeneous", {})
        mb = r["megatron_baseline_s"]
        lines.append(
            f"{r['rank']:>7} {r['plugin_s']:>9.3f} {r['groups_s']:>9.3f} {'-' if mb is None else f'{mb:.3f}':>10} "
            f"{r['groups_member']:>6} {r['groups_created']:>8} {h.get('groups_member', '-'):>9} "
            f"{h.get('groups_created', '-'):>8} {_fmt_bytes(r['state_bytes']['built']):>9} "
            f"{_fmt_bytes(r['state_bytes']['predicted']):>9}"
        )
    return "\n".join(lines)


def state_table(doc: dict) -> str:
    """Per rank and module: the meta-built state bytes, planner.memory's and the search's, and the
    differences (GiB; relative to built)."""
    lines = [f"{'rank':>7} {'module':>10} {'built':>9} {'memory.py':>9} {'diff':>7} {'search':>9} {'diff':>7}"]
    for r in doc["ranks"]:
        for n, v in r["state_bytes"]["modules"].items():
            b = sum(v["built"].values())
            p = sum(v["predicted"].values()) if v.get("predicted") else None
            s = v.get("search")
            row = f"{r['rank']:>7} {n:>10} {_fmt_bytes(b):>9} {_fmt_bytes(p):>9} "
            row += f"{'-' if p is None else f'{(p - b) / b:+.2%}':>7} {_fmt_bytes(s):>9} "
            row += f"{'-' if s is None else f'{(s - b) / b:+.2%}':>7}"
            lines.append(row)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from megatron_hetero.layout.args import layout_from_args
    from megatron_hetero.training.dryrun_world import dry_world, parse_ranks
    from megatron_hetero.cli.train_door import job_from_args
    from megatron_hetero.training.job import quiet_upstream_warnings

    quiet_upstream_warnings()
    regime = None
    if args.regime_row is not None:
        from megatron_hetero.training.dryrun_regime import regime_case, with_search_state

        draft, wl, cand = regime = regime_case(args.regime_row, args.nproc_per_node)
    else:
        _layout_args(args)
        draft = job_from_args(args, layout_from_args(args, world_size=args.nproc_per_node))
    layout = draft.layout
    ranks = parse_ranks(args.ranks, layout)
    doc = dry_world(
        draft,
        ranks,
        jobs=args.jobs,
        megatron_lm=args.megatron_lm,
        baseline=not (args.no_baseline or args.state_only),
        boundaries=not args.state_only,
    )
    if regime is not None:
        doc = with_search_state(doc, wl, cand, layout)
    print(
        f"megatron-hetero dryrun: {layout.world_size} ranks (fake process group), placement {layout.placement}: "
        + ", ".join(f"{m.name} {m.short()} @{m.ranks}" for m in layout.modules)
    )
    print(f"schedule check: {doc['schedule_check']['what']}: ok in {doc['schedule_check']['s']:.2f} s")
    print(table(doc))
    if regime is not None:
        print(f"regime row {args.regime_row}: {doc['regime']['candidate']}")
        print(state_table(doc))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
