"""Qwen2.5-VL vision tower weights: Hugging Face names <-> `models.qwen_vision.QwenVisionTower`'s, one
TP rank's shard at a time (pure tensor work).

Hugging Face (`Qwen2_5_VisionTransformerPretrainedModel`, optionally under a prefix such as
`model.visual.`): `patch_embed.proj.weight`; per block `norm1`, `norm2`, `attn.qkv` (rows: all q
heads, all k, all v), `attn.proj`, `mlp.gate_proj`, `mlp.up_proj`, `mlp.down_proj`; `merger.ln_q`,
`merger.mlp.0`, `merger.mlp.2`. Ours: Megatron's fused qkv (per head: q, k, v rows), the SwiGLU fc1
(gate rows then up rows, each cut per TP rank), column-parallel rows / row-parallel columns cut in
`tp` equal parts. Biases and norms follow their weights; the patch embedding and norms are whole on
every rank.
"""

from __future__ import annotations

import torch

Tensors = dict[str, torch.Tensor]


def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, dim=0)[rank].clone()


def _cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, dim=1)[rank].clone()


def _qkv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF [3 * heads * d, ...] -> Megatron's per-head [heads * 3 * d, ...]."""
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def _unqkv(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def hf_to_tower(hf: Tensors, depth: int, heads: int, *, prefix: str = "", tp_rank: int = 0, tp: int = 1) -> Tensors:
    """Our state dict (this TP rank's shard) from a Hugging Face tower state dict."""
    g = lambda k: hf[prefix + k]  # noqa: E731
    out: Tensors = {"patch_embed.weight": g("patch_embed.proj.weight").clone()}
    for i in range(depth):
        h, o = f"blocks.{i}.", f"blocks.layers.{i}."
        out[o + "input_layernorm.weight"] = g(h + "norm1.weight").clone()
        for kind in ("weight", "bias"):
            out[o + f"self_attention.linear_qkv.{kind}"] = _rows(_qkv(g(h + f"attn.qkv.{kind}"), heads), tp_rank, tp)
            gate, up = g(h + f"mlp.gate_proj.{kind}"), g(h + f"mlp.up_proj.{kind}")
            out[o + f"mlp.linear_fc1.{kind}"] = torch.cat([_rows(gate, tp_rank, tp), _rows(up, tp_rank, tp)])
        out[o + "pre_mlp_layernorm.weight"] = g(h + "norm2.weight").clone()
        out[o + "self_attention.linear_proj.weight"] = _cols(g(h + "attn.proj.weight"), tp_rank, tp)
        out[o + "self_attention.linear_proj.bias"] = g(h + "attn.proj.bias").clone()
        out[o + "mlp.linear_fc2.weight"] = _cols(g(h + "mlp.down_proj.weight"), tp_rank, tp)
        out[o + "mlp.linear_fc2.bias"] = g(h + "mlp.down_proj.bias").clone()
    out["ln_q.weight"] = g("merger.ln_q.weight").clone()
    out["merger.encoder.linear_fc1.weight"] = _rows(g("merger.mlp.0.weight"), tp_rank, tp)
    out["merger.encoder.linear_fc1.bias"] = _rows(g("merger.mlp.0.bias"), tp_rank, tp)
    out["merger.encoder.linear_fc2.weight"] = _cols(g("merger.mlp.2.weight"), tp_rank, tp)
    out["merger.encoder.linear_fc2.bias"] = g("merger.mlp.2.bias").clone()
    return out


def tower_to_hf(shards: list[Tensors], depth: int, heads: int, *, prefix: str = "") -> Tensors:
    """A Hugging Face tower state dict from every TP rank's shard, in rank order (inverse of `hf_to_tower`)."""
    first = shards[0]
    rows = lambda k: torch.cat([s[k] for s in shards], dim=0)  # noqa: E731
    cols = lambda k: torch.cat([s[k] for s in shards], dim=1)  # noqa: E731
    out: Tensors = {"patch_embed.proj.weight": first["patch_embed.weight"].clone()}
    for i in range(depth):
        h, o = f"blocks.{i}.", f"blocks.layers.{i}."
        out[h + "norm1.weight"] = first[o + "input_layernorm.weight"].clone()
        for kind in ("weight", "bias"):
            out[h + f"attn.qkv.{kind}"] = _unqkv(rows(o + f"self_attention.linear_qkv.{kind}"), heads)
            halves = [s[o + f"mlp.linear_fc1.{kind}"].chunk(2, dim=0) for s in shards]
            out[h + f"mlp.gate_proj.{kind}"] = torch.cat([a for a, _ in halves])
            out[h + f"mlp.up_proj.{kind}"] = torch.cat([b for _, b in halves])
        out[h + "norm2.weight"] = first[o + "pre_mlp_layernorm.weight"].clone()
        out[h + "attn.proj.weight"] = cols(o + "self_attention.linear_proj.weight")
        out[h + "attn.proj.bias"] = first[o + "self_attention.linear_proj.bias"].clone()
        out[h + "mlp.down_proj.weight"] = cols(o + "mlp.linear_fc2.weight")
        out[h + "mlp.down_proj.bias"] = first[o + "mlp.linear_fc2.bias"].clone()
    out["merger.ln_q.weight"] = first["ln_q.weight"].clone()
    out["merger.mlp.0.weight"] = rows("merger.encoder.linear_fc1.weight")
    out["merger.mlp.0.bias"] = rows("merger.encoder.linear_fc1.bias")
    out["merger.mlp.2.weight"] = cols("merger.encoder.linear_fc2.weight")
    out["merger.mlp.2.bias"] = first["merger.encoder.linear_fc2.bias"].clone()
    return {prefix + k: v for k, v in out.items()}
