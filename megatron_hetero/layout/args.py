"""Megatron-style flags for heterogeneous layouts.

`add_hetero_args` has the signature of Megatron-LM's `extra_args_provider`, so it can be passed to
`megatron.training.initialize_megatron(extra_args_provider=add_hetero_args)` or `pretrain(...)`.
All flags use the `--hetero-` prefix (Megatron's own `--heterogeneous-layers-config-path` is a
different feature).
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.layout.yaml_io import layout_from_dict, load_layout, parse_module_flag

from megatron_hetero.layout.degrees import DEFAULT_COMM_TIMEOUT_S  # noqa: F401 (re-exported)


def add_hetero_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `--hetero-*` flags to `parser` and return it (Megatron's extra_args_provider contract)."""
    group = parser.add_argument_group(title="heterogeneous parallelism (megatron-hetero)")
    group.add_argument(
        "--hetero-layout",
        type=str,
        default=None,
        metavar="FILE",
        help="Layout YAML file (placement, modules, edges). Excludes --hetero-module.",
    )
    group.add_argument(
        "--hetero-placement",
        type=str,
        default=None,
        choices=["colocated", "disjoint"],
        help="Placement of the modules given with --hetero-module (default colocated).",
    )
    group.add_argument(
        "--hetero-boundary-mode",
        type=str,
        default=None,
        choices=["direct", "hierarchical"],
        help="How the tensors of disjoint edges travel: direct point-to-point (default) or the "
        "hierarchical leader route; replaces the layout file's boundary_mode.",
    )
    group.add_argument(
        "--hetero-module",
        type=str,
        action="append",
        default=None,
        metavar="SPEC",
        help="NAME:tp=..,cp=..,pp=..,dp=..,ep=..[,expt_tp=..][,ranks=A-B][,layers=A-B][,frozen]; "
        "repeat once per module.",
    )
    group.add_argument(
        "--hetero-edge",
        type=str,
        action="append",
        default=None,
        metavar="'A->B'",
        help="A producer -> consumer edge; repeat once per edge.",
    )
    group.add_argument(
        "--hetero-comm-timeout",
        type=float,
        default=DEFAULT_COMM_TIMEOUT_S,
        metavar="SECONDS",
        help="Timeout of every boundary wait; on expiry the edge, rank and peer are named.",
    )
    group.add_argument(
        "--hetero-schedule",
        choices=("1f1b", "zb"),
        default="1f1b",
        help="The disjoint schedule's tables: 1f1b (default), or zb: each backward split into its "
        "input-gradient pass (its gradient goes upstream) and its weight-gradient pass (zero-bubble).",
    )
    group.add_argument(
        "--hetero-offload-encoder",
        action="store_true",
        help="Move encoder parameters, gradients and optimizer state to host memory "
        "during the language-model phase of the colocated schedule.",
    )
    return parser


def layout_from_args(args: Any, world_size: Optional[int] = None) -> HeteroLayout:
    """Build and validate the layout from parsed `--hetero-*` flags (file or per-module flags)."""
    if world_size is None:
        world_size = getattr(args, "world_size", None)
    path = getattr(args, "hetero_layout", None)
    flags = getattr(args, "hetero_module", None) or []
    edges = getattr(args, "hetero_edge", None) or []
    placement = getattr(args, "hetero_placement", None)
    mode = getattr(args, "hetero_boundary_mode", None)
    if path:
        if flags or edges:
            raise ValueError("give either --hetero-layout FILE or --hetero-module/--hetero-edge flags, not both")
        if mode is not None:
            doc = load_layout(path, world_size).to_dict()
            doc["boundary_mode"] = mode
            try:
                layout = layout_from_dict(doc, world_size)
            except ValueError as exc:
                raise ValueError(f"--hetero-boundary-mode {mode} with {path}: {exc}") from None
        else:
            layout = load_layout(path, world_size)
        if placement is not None and placement != layout.placement:
            raise ValueError(f"--hetero-placement {placement} contradicts placement {layout.placement} in {path}")
        return layout
    if not flags:
        raise ValueError("no layout: give --hetero-layout FILE or one --hetero-module NAME:tp=..,dp=.. per module")
    modules: dict[str, dict] = {}
    for text in flags:
        name, spec = parse_module_flag(text)
        if name in modules:
            raise ValueError(f"--hetero-module {name} is given twice")
        modules[name] = spec
    doc = {
        "placement": placement or "colocated",
        "boundary_mode": mode or "direct",
        "modules": modules,
        "edges": list(edges),
    }
    return layout_from_dict(doc, world_size)
