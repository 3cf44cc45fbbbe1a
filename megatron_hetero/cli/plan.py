"""`megatron-hetero plan`: validate a layout and print the rank map and boundary plans (`--json`).

    megatron-hetero plan LAYOUT.yaml [--world-size N] [--json] [--global-batch-size G]
        [--seq-length S] [--hidden-size H] [--dtype-bytes B] [--num-experts E]
    megatron-hetero plan --hetero-module NAME:tp=..,dp=.. ... [--hetero-edge 'A->B'] [--hetero-placement P]

The model flags give the shape crossing each edge (default: the smallest one every transform takes).
Pure: no torch.
"""

from __future__ import annotations

import argparse
import json

from megatron_hetero.cli.model_flags import MODEL_FLAGS, add_model_flags
from megatron_hetero.layout.flags import value

NAME = "plan"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from megatron_hetero.layout.args import add_hetero_args
    from megatron_hetero.layout.flags import add_flags, flags_of
    from megatron_hetero.planner.model import LlavaSpec

    p = sub.add_parser(NAME, help="validate a layout and print the rank map and boundary plans")
    p.add_argument("layout", nargs="?", default=None, help="layout YAML (or use --hetero-layout / --hetero-module)")
    p.add_argument("--world-size", type=int, default=None, help="total ranks (default: what the layout uses)")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    add_model_flags(
        p,
        ("global_batch_size", "seq_length", "hidden_size"),
        help={
            "global_batch_size": "samples crossing each edge per step (default: lcm of the DP sizes)",
            "seq_length": "tokens per sample on each edge (default: 8 * lcm of 2*cp)",
            "hidden_size": "hidden size on each edge (default {default}: the model's)",
        },
    )
    p.add_argument("--dtype-bytes", type=int, default=4, help="bytes per element (4 fp32, 2 bf16)")
    p.add_argument(
        "--draw",
        default=None,
        metavar="FILE.png",
        help="also draw the layout: ranks as cells coloured by module with their coordinates, "
        "edges with their transform (needs matplotlib)",
    )
    add_flags(
        p,
        flags_of(LlavaSpec, ["num_experts"]),
        help={"num_experts": "experts per MoE layer of the language model: checks ep against it and prints them"},
    )
    add_hetero_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    from megatron_hetero.layout.args import layout_from_args
    from megatron_hetero.report.plan import default_shape, layout_json, layout_text

    if args.layout and args.hetero_layout:
        raise ValueError("give the layout file once: positional LAYOUT or --hetero-layout, not both")
    if args.layout:
        args.hetero_layout = args.layout
    from megatron_hetero.layout.validate import check_experts
    from megatron_hetero.plan.roles import roles

    layout = layout_from_args(args, world_size=args.world_size)
    experts = {}
    if args.num_experts is not None:  # ep > 1 on a dense module, ep not dividing --num-experts: exit 2
        experts = {n: args.num_experts for n in roles(layout).language}
        check_experts(layout, experts)
    hidden = value(args, MODEL_FLAGS["hidden_size"])  # the model's hidden size unless given
    shape = default_shape(layout, args.global_batch_size, args.seq_length, hidden, args.dtype_bytes)
    if args.json:
        print(json.dumps(layout_json(layout, shape, experts), indent=1))
    else:
        print(layout_text(layout, shape, experts))
    if args.draw:
        _draw(layout, shape, args.draw, quiet=args.json)
    return 0


def _draw(layout, shape, out: str, quiet: bool) -> None:
    import sys

    from megatron_hetero.report.draw import draw_layout
    from megatron_hetero.cli import CommandFailed

    try:
        summary = draw_layout(layout, out, shape)
    except ImportError as exc:
        raise CommandFailed(str(exc)) from None
    print(
        f"drew {summary['cells']} cells over {len(summary['ranks'])} ranks -> {out}",
        file=sys.stderr if quiet else sys.stdout,
    )
