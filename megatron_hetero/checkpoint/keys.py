"""The layout-independent names of a checkpoint (`checkpoint/save_load.py`'s docstring): the logical models
of a layout (each encoder, and `language` for every language module) and the global key of a
parameter (`<logical>.<name>` with the global layer index).
"""

from __future__ import annotations

import re

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.plan import roles as plan_roles


LANGUAGE = "language"


_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def logical_models(layout: HeteroLayout) -> dict[str, list[str]]:
    """logical model -> its layout modules: each encoder is its own; every language module (one, or
    the pipeline segments) is `language`."""
    langs = [m.name for m in plan_roles.language_modules(layout)]
    out: dict[str, list[str]] = {}
    for m in layout.modules:
        out.setdefault(LANGUAGE if m.name in langs else m.name, []).append(m.name)
    return out


def logical_of(layout: HeteroLayout, module: str) -> str:
    return next(k for k, mods in logical_models(layout).items() if module in mods)


def global_key(logical: str, key: str, layer_offset: int) -> str:
    """`decoder.layers.3.x` of a segment starting at layer A -> `<logical>.decoder.layers.{3+A}.x`."""
    if layer_offset:
        key = _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", key, count=1)
    return f"{logical}.{key}"


def _layer_offset(layout: HeteroLayout, module: str, spec) -> int:
    from megatron_hetero.config.model import segment_layers

    if logical_of(layout, module) != LANGUAGE:
        return 0
    return segment_layers(layout.module(module), spec).start
