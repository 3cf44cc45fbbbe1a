"""Megatron-core 0.19's `HybridModel` as the language model, from a layer pattern
(`--hybrid-layer-pattern`, Megatron's meaning: `*` attention layer, `-` MLP layer, `E` MoE layer,
`M` Mamba layer, `|` a pipeline-stage boundary; `megatron.core.models.hybrid`).

Megatron's own hybrid stack spec (`hybrid_layer_specs.hybrid_stack_spec`) is Transformer Engine only
(its attention and MLP layers fuse the layer norm into TE linears; `HybridStack` builds its final norm
as `TENorm`). `--transformer-impl transformer_engine` takes it as it is (GPU machines). The default
`local` builds the same layers from Megatron's local GPT layer spec (the one the GPT path uses, with
our context-parallel core attention), split the way Megatron's hybrid spec splits a GPT layer:

  `*` a `TransformerLayer` with input_layernorm + self_attention (no MLP),
  `-` an `MLPLayer` with pre_mlp_layernorm + the dense MLP (no attention),
  `E` a `TransformerLayer` with pre_mlp_layernorm + the MoE MLP (experts on the module's EP group),

and `LocalNormHybridStack`, Megatron's `HybridStack` whose final norm is the local spec's norm (the
one thing its constructor hard-wires to TE). So a GPT layer is `*-` and a GPT model of L layers is
the pattern `*-` * L with 2L layers. `M` needs Megatron's Mamba mixer, which needs the mamba-ssm and
causal-conv1d CUDA kernels and TE: refused with `local` (`hybrid_pattern.check_pattern`), built
from Megatron's TE spec with `transformer_engine`. The pattern's grammar, checks and the GPT <->
hybrid parameter names are pure (`models.hybrid_pattern`).
"""

from __future__ import annotations

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_hetero.models.layer_specs import get_gpt_layer_local_spec_with_cp


def local_stack_spec(normalization: str, num_experts: int | None) -> ModuleSpec:
    """The hybrid stack spec of the local implementation (module docstring)."""
    dense = get_gpt_layer_local_spec_with_cp(normalization=normalization).submodules
    attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=dense.input_layernorm,
            self_attention=dense.self_attention,
            self_attn_bda=dense.self_attn_bda,
        ),
    )
    mlp = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda
        ),
    )
    sub = HybridStackSubmodules(attention_layer=attention, mlp_layer=mlp)
    if num_experts:
        moe = get_gpt_layer_local_spec_with_cp(
            normalization=normalization, num_experts=num_experts, moe_grouped_gemm=False
        ).submodules
        sub.moe_layer = ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda
            ),
        )
    return ModuleSpec(module=LocalNormHybridStack, submodules=sub, params={"final_norm": dense.input_layernorm})


def te_stack_spec() -> ModuleSpec:
    """Megatron's own (Transformer Engine) hybrid stack spec, Mamba included."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    return hybrid_stack_spec


class LocalNormHybridStack(HybridStack):
    """Megatron's `HybridStack` with the final norm of the local spec (`final_norm`: its class) in
    place of `TENorm`; everything else is HybridStack's."""

    def __init__(self, config, submodules, *args, final_norm=None, post_layer_norm: bool = True, **kwargs) -> None:
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = build_module(
                final_norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )


def build_hybrid_model(config, spec, pgs, pre_process: bool, post_process: bool):
    """Megatron's `HybridModel` of the language module (one module, its pp stages from the pattern's
    `|` or an even split), with the options the GPT path gives `GPTModel` (rope / learned positions,
    tied or untied output, the first stage scattering its own input under sequence parallelism)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    stack = te_stack_spec() if spec.transformer_impl == "transformer_engine" else None
    if stack is None:
        stack = local_stack_spec(spec.normalization, spec.num_experts)
    return HybridModel(
        config=config,
        hybrid_stack_spec=stack,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        hybrid_layer_pattern=spec.hybrid_layer_pattern,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not spec.untie_embeddings_and_output_weights,
        position_embedding_type=spec.position_embedding_type,
        rotary_base=spec.rotary_base,
        scatter_embedding_sequence_parallel=False,
        pg_collection=pgs,
    )
