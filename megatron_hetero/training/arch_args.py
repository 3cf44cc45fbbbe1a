"""Megatron-LM's architecture flags (`cli.arch_flags`) applied to a `LlavaSpec`; ValueError for
contradictory flags. Pure: no torch."""

from __future__ import annotations

import dataclasses
from typing import Any

# the argparse dests of `cli.arch_flags`
ARCH_DESTS = (
    "normalization",
    "norm_epsilon",
    "swiglu",
    "position_embedding_type",
    "rotary_base",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "add_qkv_bias",
    "disable_bias_linear",
    "share_embeddings_and_output_weights",
    "untie_embeddings_and_output_weights",
    "vision_model_type",
    "patch_dim",
)


def arch_flags_given(args: Any) -> bool:
    return any(getattr(args, n, None) is not None for n in ARCH_DESTS)


def apply_arch_args(args: Any, spec):
    """`spec` with the language-model and encoder architecture the flags in `args` set."""
    g = {n: getattr(args, n, None) for n in ARCH_DESTS}
    if g["share_embeddings_and_output_weights"] and g["untie_embeddings_and_output_weights"]:
        raise ValueError("--share-embeddings-and-output-weights and --untie-embeddings-and-output-weights contradict")
    if g["group_query_attention"] and g["num_query_groups"] is None:
        raise ValueError("--group-query-attention needs --num-query-groups N")
    lm = {
        k: g[k]
        for k in (
            "normalization",
            "norm_epsilon",
            "swiglu",
            "position_embedding_type",
            "rotary_base",
            "num_query_groups",
            "kv_channels",
            "add_qkv_bias",
        )
        if g[k] is not None
    }
    if g["disable_bias_linear"]:
        lm["add_bias_linear"] = False
    if g["share_embeddings_and_output_weights"]:
        lm["untie_embeddings_and_output_weights"] = False
    spec = dataclasses.replace(spec, **lm)
    if g["vision_model_type"] == "clip":
        if not g["patch_dim"] or g["patch_dim"] < 1:
            raise ValueError("--vision-model-type clip needs --patch-dim P (>= 1)")
        p = g["patch_dim"]
        if getattr(args, "encoder_feature_dim", None) not in (None, 3 * p * p):
            raise ValueError(
                f"--encoder-feature-dim {args.encoder_feature_dim}: a CLIP encoder's features are "
                f"3 * --patch-dim**2 = {3 * p * p}"
            )
        spec = dataclasses.replace(
            spec,
            encoders={
                n: dataclasses.replace(e, kind="clip", patch_size=p, feature_dim=3 * p * p)
                for n, e in spec.encoders.items()
            },
        )
    elif g["patch_dim"] is not None:
        raise ValueError("--patch-dim applies to --vision-model-type clip")
    return spec
