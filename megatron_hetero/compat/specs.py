"""Construction helpers for building Megatron-core models without Transformer Engine.

These are not CPU patches (they are needed on any machine without TE/apex), so they are plain
functions that callers use explicitly. (The CP layer spec is model code:
``megatron_hetero.models.layer_specs``.)
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from megatron.core import parallel_state

__all__ = [
    "clip_vit_norm_kwargs",
    "ensure_global_memory_buffer",
    "ensure_moe_without_te",
]


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
