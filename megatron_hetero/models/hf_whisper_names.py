"""Tensor names and layouts: Hugging Face's Whisper encoder <-> `WhisperEncoderModule`, whole tensors.

Hugging Face names (under `encoder.` in a `WhisperModel`, `model.encoder.` in a
`WhisperForConditionalGeneration`; `prefix` says which): conv1, conv2, embed_positions, layers.i.
{self_attn.q/k/v/out_proj, self_attn_layer_norm, fc1, fc2, final_layer_norm}, layer_norm.

Besides renames: q_proj, k_proj, v_proj fuse into Megatron's linear_qkv (`hf_names.fuse_qkv`, groups =
heads), and Whisper's k_proj has no bias: a zero key bias goes in, and comes out dropped (the module
holds it at zero). A round trip returns bit-identical tensors.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_hetero.models.hf_names import Shapes, fuse_qkv, split_qkv

WHISPER_PREFIXES = ("encoder.", "model.encoder.")

_TOP = (
    ("conv1.weight", "conv1.weight"),
    ("conv1.bias", "conv1.bias"),
    ("conv2.weight", "conv2.weight"),
    ("conv2.bias", "conv2.bias"),
    ("embed_positions.weight", "positions.weight"),
    ("layer_norm.weight", "decoder.final_layernorm.weight"),
    ("layer_norm.bias", "decoder.final_layernorm.bias"),
)
_LAYER = (
    ("self_attn.out_proj", "self_attention.linear_proj"),
    ("self_attn_layer_norm", "input_layernorm"),
    ("final_layer_norm", "pre_mlp_layernorm"),
    ("fc1", "mlp.linear_fc1"),
    ("fc2", "mlp.linear_fc2"),
)


def expected_whisper(enc, prefix: str = "encoder.") -> Shapes:
    """The Hugging Face encoder tensors (names, shapes) of an `EncoderSpec(kind="whisper")`."""
    h, f, mel = enc.hidden_size, enc.ffn_hidden_size or 4 * enc.hidden_size, enc.feature_dim // 2
    out: Shapes = {
        prefix + "conv1.weight": (h, mel, 3),
        prefix + "conv1.bias": (h,),
        prefix + "conv2.weight": (h, h, 3),
        prefix + "conv2.bias": (h,),
        prefix + "embed_positions.weight": (enc.tokens, h),
        prefix + "layer_norm.weight": (h,),
        prefix + "layer_norm.bias": (h,),
    }
    for i in range(enc.num_layers):
        q = f"{prefix}layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[f"{q}self_attn.{proj}.weight"] = (h, h)
            if proj != "k_proj":
                out[f"{q}self_attn.{proj}.bias"] = (h,)
        for ln in ("self_attn_layer_norm", "final_layer_norm"):
            out[f"{q}{ln}.weight"], out[f"{q}{ln}.bias"] = (h,), (h,)
        out.update({q + "fc1.weight": (f, h), q + "fc1.bias": (f,), q + "fc2.weight": (h, f), q + "fc2.bias": (h,)})
    return out


def whisper_to_ours(get: Callable[[str], torch.Tensor], enc, prefix: str = "encoder.") -> dict[str, torch.Tensor]:
    """`WhisperEncoderModule` state-dict names (conv1/2, positions, decoder.*) of a Whisper encoder."""
    n = enc.num_attention_heads
    out = {ours: get(prefix + hf) for hf, ours in _TOP}
    for i in range(enc.num_layers):
        q, o = f"{prefix}layers.{i}.self_attn.", f"decoder.layers.{i}."
        out[o + "self_attention.linear_qkv.weight"] = fuse_qkv(
            get(q + "q_proj.weight"), get(q + "k_proj.weight"), get(q + "v_proj.weight"), n
        )
        qb = get(q + "q_proj.bias")
        out[o + "self_attention.linear_qkv.bias"] = fuse_qkv(qb, torch.zeros_like(qb), get(q + "v_proj.bias"), n)
        for hf, ours in _LAYER:
            for kind in ("weight", "bias"):
                out[f"{o}{ours}.{kind}"] = get(f"{prefix}layers.{i}.{hf}.{kind}")
    return out


def whisper_to_hf(ours: dict[str, torch.Tensor], enc, prefix: str = "encoder.") -> dict[str, torch.Tensor]:
    """The inverse of `whisper_to_ours` (the key bias, zero, is dropped)."""
    h, n = enc.hidden_size, enc.num_attention_heads
    out = {prefix + hf: ours[o] for hf, o in _TOP}
    for i in range(enc.num_layers):
        q, o = f"{prefix}layers.{i}.self_attn.", f"decoder.layers.{i}."
        wq, wk, wv = split_qkv(ours[o + "self_attention.linear_qkv.weight"], n, n, h // n)
        bq, _, bv = split_qkv(ours[o + "self_attention.linear_qkv.bias"], n, n, h // n)
        out.update(
            {
                q + "q_proj.weight": wq,
                q + "k_proj.weight": wk,
                q + "v_proj.weight": wv,
                q + "q_proj.bias": bq,
                q + "v_proj.bias": bv,
            }
        )
        for hf, ours_name in _LAYER:
            for kind in ("weight", "bias"):
                out[f"{prefix}layers.{i}.{hf}.{kind}"] = ours[f"{o}{ours_name}.{kind}"]
    return out
