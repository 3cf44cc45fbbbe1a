"""`megatron-hetero` command line. Exit codes: 0 ok, 2 invalid input, 1 runtime failure."""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Callable, Optional

EXIT_OK, EXIT_FAILURE, EXIT_INVALID = 0, 1, 2


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from megatron_hetero.layout.args import add_hetero_args

    p = sub.add_parser("plan", help="validate a layout and print the rank map and boundary plans")
    p.add_argument("layout", nargs="?", default=None, help="layout YAML (or use --hetero-layout / --hetero-module)")
    p.add_argument("--world-size", type=int, default=None, help="total ranks (default: what the layout uses)")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="samples crossing each edge per step (default: lcm of the DP sizes)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="tokens per sample on each edge (default: 8 * lcm of 2*cp)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--dtype-bytes", type=int, default=4, help="bytes per element (4 fp32, 2 bf16)")
    add_hetero_args(p)
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from megatron_hetero.layout.args import layout_from_args
    from megatron_hetero.plan.report import default_shape, layout_json, layout_text

    if args.layout and args.hetero_layout:
        raise ValueError("give the layout file once: positional LAYOUT or --hetero-layout, not both")
    if args.layout:
        args.hetero_layout = args.layout
    layout = layout_from_args(args, world_size=args.world_size)
    shape = default_shape(layout, args.global_batch_size, args.seq_length, args.hidden_size, args.dtype_bytes)
    if args.json:
        print(json.dumps(layout_json(layout, shape), indent=1))
    else:
        print(layout_text(layout, shape))
    return EXIT_OK


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from megatron_hetero.bench.cli import add_parser

    add_parser(sub)


def _add_schedule(sub: argparse._SubParsersAction) -> None:
    from megatron_hetero.cli_schedule import add_parser

    add_parser(sub)


def _add_train(sub: argparse._SubParsersAction) -> None:
    from megatron_hetero.training.cli_train import add_parser

    add_parser(sub)


def _add_search(sub: argparse._SubParsersAction) -> None:
    from megatron_hetero.cli_search import add_parser

    add_parser(sub)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    from megatron_hetero.cli_profile import add_parser

    add_parser(sub)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_plan, _add_train, _add_schedule, _add_profile, _add_search, _add_bench,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-hetero",
        description="Per-module parallel layouts for multimodal training on Megatron-core.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or EXIT_OK)
    except ValueError as exc:
        print(f"megatron-hetero {args.command}: invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return EXIT_FAILURE
    except Exception:  # noqa: BLE001 - the CLI reports any unexpected failure with exit 1
        traceback.print_exc()
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
