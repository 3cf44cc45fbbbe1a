"""Megatron-LM's architecture flags for the model family (`train`): a Llama/Qwen2-style language
model and a CLIP vision encoder without a Hugging Face config.json.

    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope
    --rotary-base 500000 --group-query-attention --num-query-groups 2 --kv-channels D
    --add-qkv-bias --disable-bias-linear --share-embeddings-and-output-weights
    --vision-model-type clip --patch-dim 14      (every encoder: CLIPViTModel; --encoder-tokens
                                                  patches, a square; features 3 * patch-dim**2)

Every flag defaults to None (unset): the model family's defaults stay the tiny GPT's (LayerNorm,
GELU, learned positions, biases, untied embeddings: Megatron's `--untie-embeddings-and-output-weights`
is accepted and is the default here; `--share-embeddings-and-output-weights` ties). Importing this
module does not import torch.
"""

from __future__ import annotations

import argparse


def add_arch_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(
        "model architecture (Megatron-LM's flags; default: the tiny GPT and linear-patch encoders)"
    )
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None)
    g.add_argument("--norm-epsilon", type=float, default=None)
    g.add_argument("--swiglu", action="store_const", const=True, default=None, help="gated SiLU MLP (Llama/Qwen2)")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default=None)
    g.add_argument("--rotary-base", type=float, default=None)
    g.add_argument("--group-query-attention", action="store_const", const=True, default=None)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None, help="attention head dimension (default hidden/heads)")
    g.add_argument("--add-qkv-bias", action="store_const", const=True, default=None, help="QKV bias (Qwen2)")
    g.add_argument("--disable-bias-linear", action="store_const", const=True, default=None)
    g.add_argument(
        "--share-embeddings-and-output-weights",
        action="store_const",
        const=True,
        default=None,
        help="tie the output layer to the input embeddings",
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_const",
        const=True,
        default=None,
        help="untied (the default here)",
    )
    g.add_argument(
        "--vision-model-type",
        choices=["linear", "clip"],
        default=None,
        help="clip: Megatron's CLIPViTModel for every encoder (needs --patch-dim)",
    )
    g.add_argument("--patch-dim", type=int, default=None, help="CLIP patch side (features per token: 3 * patch**2)")
    return parser
