"""Pure layout declarations, parsing (YAML, flags) and validation. No torch.distributed here."""
from megatron_hetero.layout.args import add_hetero_args, layout_from_args
from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout, RankRange
from megatron_hetero.layout.validate import resolve_layout, topological_order
from megatron_hetero.layout.yaml_io import dump_layout, layout_from_dict, load_layout

__all__ = [
    "Edge", "HeteroLayout", "ModuleLayout", "RankRange", "add_hetero_args", "dump_layout",
    "layout_from_args", "layout_from_dict", "load_layout", "resolve_layout", "topological_order",
]
