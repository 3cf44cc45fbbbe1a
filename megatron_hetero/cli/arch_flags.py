"""Megatron-LM's architecture flags for the model family (`train`): a Llama/Qwen2-style language
model and a CLIP or SigLIP vision encoder without a Hugging Face config.json.

    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope
    --rotary-base 500000 --group-query-attention --num-query-groups 2 --kv-channels D
    --add-qkv-bias --disable-bias-linear --share-embeddings-and-output-weights
    --use-rope-scaling [--rope-scaling-factor 8]  (Llama 3.1+'s rope scaling; needs rope)
    --vision-model-type clip --patch-dim 14      (every encoder: CLIPViTModel; --encoder-tokens
                                                  patches, a square; features 3 * patch-dim**2)
    --vision-model-type siglip --patch-dim 14    (its siglip variant: conv bias, no class token,
                                                  gelu tanh, eps 1e-6, post LayerNorm, no head)
    --vision-model-type qwen2.5-vl --patch-dim 14 --position-embedding-type mrope --mrope-section 16 24 24
                                                 (Qwen2.5-VL's tower, `models.qwen_encoder`: one image a
                                                  sample, --encoder-tokens merged tokens, a square;
                                                  features 4 * 3 * 2 * patch-dim**2; M-RoPE language model)

The flags are declared once, on `config.arch.ArchFlags`. Every flag defaults to None
(unset): the model family's defaults stay the tiny GPT's (LayerNorm, GELU, learned positions,
biases, untied embeddings: Megatron's `--untie-embeddings-and-output-weights` is accepted and is the
default here; `--share-embeddings-and-output-weights` ties). Importing this module does not import
torch.
"""

from __future__ import annotations

import argparse

TITLE = "model architecture (Megatron-LM's flags; default: the tiny GPT and linear-patch encoders)"


def add_arch_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Megatron-LM's architecture flags, generated from `config.arch.ArchFlags`."""
    from megatron_hetero.layout.flags import add_flags, flags_of
    from megatron_hetero.config.arch import ArchFlags

    add_flags(parser, flags_of(ArchFlags), {"arch": TITLE})
    return parser
