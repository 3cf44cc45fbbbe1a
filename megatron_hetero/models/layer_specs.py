"""Layer specs for building Megatron-core models: Megatron's local GPT layer spec with the
context-parallel core attention of :mod:`megatron_hetero.models.cp_attention` (``--transformer-impl
local``, the default), or Megatron's Transformer Engine GPT layer spec (``--transformer-impl
transformer_engine``, GPU machines with the transformer-engine package: `language_layer_spec`,
`encoder_layer_spec`; `compat.device.transformer_engine_unavailable` says why not).

Model code, not a compat patch: it changes no Megatron object, it builds a spec from Megatron's own
``get_gpt_layer_local_spec`` with one submodule replaced.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_hetero.models.cp_attention import ContextParallelDotProductAttention
from megatron_hetero.config.model import TRANSFORMER_IMPLS

__all__ = [
    "TRANSFORMER_IMPLS",
    "encoder_layer_spec",
    "get_gpt_layer_local_spec_with_cp",
    "language_layer_spec",
    "with_cp_core_attention",
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


def _check_impl(impl: str) -> None:
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"--transformer-impl {impl!r}: choose one of {', '.join(TRANSFORMER_IMPLS)}")


def language_layer_spec(impl: str, num_experts: Optional[int], normalization: str) -> ModuleSpec:
    """The language model's layer spec: ``local``: Megatron's local spec with the CP core attention;
    ``transformer_engine``: Megatron's TE spec (its fused layer norm reads ``config.normalization``)."""
    _check_impl(impl)
    moe: dict[str, Any] = {"num_experts": num_experts, "moe_grouped_gemm": False} if num_experts else {}
    if impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(**moe)
    return get_gpt_layer_local_spec_with_cp(normalization=normalization, **moe)


def encoder_layer_spec(impl: str) -> ModuleSpec:
    """An encoder trunk's layer spec (linear-patch and CLIP encoders): the GPT layer of `impl` with
    bidirectional attention (no mask); `local`: with the CP core attention (exactly Megatron's at
    cp 1; a linear-patch encoder may run with cp > 1)."""
    _check_impl(impl)
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.enums import AttnMaskType

    if impl == "transformer_engine":
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec_with_cp()
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    return spec
