"""Spec and construction helpers for building Megatron-core models without Transformer Engine.

These are not CPU patches (they are needed on any machine without TE/apex), so they are plain
functions that callers use explicitly.
"""
from __future__ import annotations

import copy
from typing import Any, Dict

import torch
from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import ModuleSpec

from .cp_attention import ContextParallelDotProductAttention

__all__ = [
    "get_gpt_layer_local_spec_with_cp",
    "with_cp_core_attention",
    "clip_vit_norm_kwargs",
    "ensure_global_memory_buffer",
    "ensure_moe_without_te",
]


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


def clip_vit_norm_kwargs() -> Dict[str, Any]:
    """Keyword arguments for ``CLIPViTModel(...)`` when Transformer Engine is absent.

    Upstream bug (megatron/core/models/vision/clip_vit_model.py): without TE the default
    ``ln_pre_impl``/``ln_post_impl`` is ``torch.nn.LayerNorm``, which ``build_module`` calls with
    ``config=`` and fails. ``WrappedTorchNorm`` accepts that signature. With TE: no override.
    """
    from megatron.core.models.vision import clip_vit_model

    if clip_vit_model.NORM_IMPL is not torch.nn.LayerNorm:
        return {}
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return {"ln_pre_impl": WrappedTorchNorm, "ln_post_impl": WrappedTorchNorm}


def ensure_global_memory_buffer() -> None:
    """Create Megatron's global memory buffer if ``initialize_model_parallel`` did not.

    ``DotProductAttention.forward`` (local spec) takes its score buffer from
    ``parallel_state.get_global_memory_buffer()``, which only ``initialize_model_parallel`` creates;
    a model built from explicit ``pg_collection`` groups needs this call once per process.
    """
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


def ensure_moe_without_te() -> None:
    """Make Megatron's MoE router run without Transformer Engine.

    Upstream bug (megatron/core/transformer/moe/moe_utils.py, 0.16.1): `te_general_gemm` is bound
    only when TE imports, but `RouterGatingLinearFunction` reads it unconditionally (NameError
    without TE). Without TE it must be None (the torch.mm path). With TE: no change.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
