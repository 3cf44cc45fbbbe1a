"""Pure layout declarations, parsing (YAML, flags) and validation. No torch, no megatron here.

The API: `load_layout(path, world_size=None)` (a YAML file), `layout_from_args(args,
world_size=None)` (parsed `--hetero-*` flags), `layout_from_dict`, `resolve_layout`,
`topological_order`; the data types live in spec.py.
"""

from megatron_hetero.layout.args import add_hetero_args, layout_from_args
from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout, RankRange
from megatron_hetero.layout.graph import order_modules, topological_order
from megatron_hetero.layout.validate import resolve_layout
from megatron_hetero.layout.yaml_io import dump_layout, layout_from_dict, load_layout

__all__ = [
    "Edge",
    "HeteroLayout",
    "ModuleLayout",
    "RankRange",
    "add_hetero_args",
    "dump_layout",
    "layout_from_args",
    "layout_from_dict",
    "load_layout",
    "order_modules",
    "resolve_layout",
    "topological_order",
]
