"""Layer specs for building Megatron-core models without Transformer Engine: Megatron's local GPT
layer spec with the context-parallel core attention of :mod:`megatron_hetero.models.cp_attention`.

Model code, not a compat patch: it changes no Megatron object, it builds a spec from Megatron's own
``get_gpt_layer_local_spec`` with one submodule replaced.
"""

from __future__ import annotations

import copy
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_hetero.models.cp_attention import ContextParallelDotProductAttention

__all__ = ["get_gpt_layer_local_spec_with_cp", "with_cp_core_attention"]


def with_cp_core_attention(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a local transformer-layer spec whose ``core_attention`` is
    :class:`ContextParallelDotProductAttention` (works for any CP size, including 1)."""
    spec = copy.deepcopy(layer_spec)
    attention = spec.submodules.self_attention
    if not hasattr(attention.submodules, "core_attention"):
        raise ValueError(f"layer spec {layer_spec.module} has no self_attention.core_attention")
    attention.submodules.core_attention = ContextParallelDotProductAttention
    return spec


def get_gpt_layer_local_spec_with_cp(**kwargs: Any) -> ModuleSpec:
    """``get_gpt_layer_local_spec(**kwargs)`` with the context-parallel core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return with_cp_core_attention(get_gpt_layer_local_spec(**kwargs))
