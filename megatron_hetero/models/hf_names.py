"""Tensor names and layouts: Hugging Face (CLIP and SigLIP vision towers, Llama/Qwen2, LLaVA
projector) <-> the model family's modules (`ClipEncoderModule`, `SiglipEncoderModule`,
`LanguageModule`), whole (unsharded) tensors.

What changes besides the names (Megatron-core's layouts, which its TP sharding and its checkpoint
keys assume):
  * QKV fusion: q_proj [heads*d, h], k_proj and v_proj [groups*d, h] -> linear_qkv
    [groups * (heads/groups + 2) * d, h], per query group g: its heads/groups query heads, then
    its key head, then its value head (the same for the biases). CLIP: groups = heads.
  * gate/up fusion: gate_proj, up_proj [ffn, h] -> linear_fc1 [2*ffn, h] = [gate; up] (Megatron's
    gated linear unit: act(first half) * second half).
  * CLIP's class_embedding [h] -> class_token [1, 1, h].
  * SigLIP: no class token, no pre_layrnorm; the patch convolution's bias -> vit.conv1.bias;
    post_layernorm -> ln_post; the attention-pooling head `head.*` keeps its names under `head.`
    (torch's MultiheadAttention in both: in_proj_weight [3h, h] = [q; k; v]).
Everything else is a rename. Both directions are exact (views and concatenations: a round trip
returns bit-identical tensors).

`expected_*` give the Hugging Face names and shapes a model of the given spec must have;
`check_tensors` compares them with a file's (names and shapes only: safetensors headers), and
raises one ValueError naming every missing, unexpected or mis-shaped tensor with both shapes.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

import torch

VISION_PREFIX = "vision_model."
PROJECTOR_PREFIX = "multi_modal_projector."
Shapes = dict[str, tuple[int, ...]]


# ---------------------------------------------------------------------------------------------------
# expected Hugging Face names and shapes
# ---------------------------------------------------------------------------------------------------


def _head_dim(spec) -> int:
    return spec.kv_channels or spec.hidden_size // spec.num_attention_heads


def expected_language(spec) -> Shapes:
    h, v, f = spec.hidden_size, spec.vocab_size, spec.ffn_hidden_size or 4 * spec.hidden_size
    d, nh = _head_dim(spec), spec.num_attention_heads
    ng = spec.num_query_groups or nh
    out: Shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if spec.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = (v, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (nh * d, h),
                p + "self_attn.k_proj.weight": (ng * d, h),
                p + "self_attn.v_proj.weight": (ng * d, h),
                p + "self_attn.o_proj.weight": (h, nh * d),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if spec.add_qkv_bias:
            out.update(
                {
                    p + "self_attn.q_proj.bias": (nh * d,),
                    p + "self_attn.k_proj.bias": (ng * d,),
                    p + "self_attn.v_proj.bias": (ng * d,),
                }
            )
    return out


def _siglip_head_shapes(h: int, f: int) -> Shapes:
    """SigLIP's attention-pooling head, names under `head.` (no prefix)."""
    return {
        "probe": (1, 1, h),
        "attention.in_proj_weight": (3 * h, h),
        "attention.in_proj_bias": (3 * h,),
        "attention.out_proj.weight": (h, h),
        "attention.out_proj.bias": (h,),
        "layernorm.weight": (h,),
        "layernorm.bias": (h,),
        "mlp.fc1.weight": (f, h),
        "mlp.fc1.bias": (f,),
        "mlp.fc2.weight": (h, f),
        "mlp.fc2.bias": (h,),
    }


def expected_vision(enc) -> Shapes:
    h, f, p = enc.hidden_size, enc.ffn_hidden_size or 4 * enc.hidden_size, enc.patch_size
    P = VISION_PREFIX
    if enc.kind == "siglip":
        out: Shapes = {
            P + "embeddings.patch_embedding.weight": (h, 3, p, p),
            P + "embeddings.patch_embedding.bias": (h,),
            P + "embeddings.position_embedding.weight": (enc.tokens, h),
            P + "post_layernorm.weight": (h,),
            P + "post_layernorm.bias": (h,),
        }
        if enc.pooling_head:
            out.update({f"{P}head.{k}": v for k, v in _siglip_head_shapes(h, f).items()})
    else:
        out = {
            P + "embeddings.class_embedding": (h,),
            P + "embeddings.patch_embedding.weight": (h, 3, p, p),
            P + "embeddings.position_embedding.weight": (enc.tokens + 1, h),
            P + "pre_layrnorm.weight": (h,),
            P + "pre_layrnorm.bias": (h,),
            P + "post_layernorm.weight": (h,),
            P + "post_layernorm.bias": (h,),
        }
    for i in range(enc.num_layers):
        q = f"{P}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[f"{q}self_attn.{proj}.weight"], out[f"{q}self_attn.{proj}.bias"] = (h, h), (h,)
        for ln in ("layer_norm1", "layer_norm2"):
            out[f"{q}{ln}.weight"], out[f"{q}{ln}.bias"] = (h,), (h,)
        out.update(
            {
                q + "mlp.fc1.weight": (f, h),
                q + "mlp.fc1.bias": (f,),
                q + "mlp.fc2.weight": (h, f),
                q + "mlp.fc2.bias": (h,),
            }
        )
    return out


def expected_projector(vision_hidden: int, llm_hidden: int) -> Shapes:
    P = PROJECTOR_PREFIX
    return {
        P + "linear_1.weight": (llm_hidden, vision_hidden),
        P + "linear_1.bias": (llm_hidden,),
        P + "linear_2.weight": (llm_hidden, llm_hidden),
        P + "linear_2.bias": (llm_hidden,),
    }


def ignorable_language(name: str, spec) -> bool:
    """Tensors a Llama/Qwen2 file may hold that carry no weights of the model: rotary inverse
    frequencies (old files) and, with tied embeddings, the tied lm_head copy."""
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and not spec.untie_embeddings_and_output_weights
    )


def ignorable_vision(name: str, kept_layers: Optional[int] = None) -> bool:
    """A full CLIPModel's / SiglipModel's text tower and heads (logit_scale, logit_bias), the
    position_ids buffer of old files, and the layers after the LLaVA feature layer (index >=
    kept_layers) when the tower is cut there."""
    if not name.startswith(VISION_PREFIX) or name.endswith("embeddings.position_ids"):
        return True
    m = re.match(re.escape(VISION_PREFIX) + r"encoder\.layers\.(\d+)\.", name)
    return kept_layers is not None and m is not None and int(m.group(1)) >= kept_layers


def check_tensors(
    found: Shapes, expected: Shapes, where: str, ignorable: Optional[Callable[[str], bool]] = None
) -> None:
    """ValueError naming every missing, unexpected and mis-shaped tensor (with both shapes)."""
    ignorable = ignorable or (lambda name: False)
    missing = sorted(n for n in expected if n not in found)
    unexpected = sorted(n for n in found if n not in expected and not ignorable(n))
    shaped = sorted(n for n in expected if n in found and tuple(found[n]) != tuple(expected[n]))
    problems = [f"missing tensor {n} (expected shape {list(expected[n])})" for n in missing]
    problems += [f"unexpected tensor {n} (shape {list(found[n])})" for n in unexpected]
    problems += [f"tensor {n} has shape {list(found[n])}, the model expects {list(expected[n])}" for n in shaped]
    if problems:
        more = f" (and {len(problems) - 12} more)" if len(problems) > 12 else ""
        raise ValueError(f"{where}: " + "; ".join(problems[:12]) + more)


# ---------------------------------------------------------------------------------------------------
# fusion
# ---------------------------------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[heads*d, ...], [groups*d, ...] x2 -> Megatron's [groups*(heads/groups+2)*d, ...]."""
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    rest = qkv.shape[1:]
    per = qkv.reshape(groups, (heads // groups + 2) * head_dim, *rest)
    nq = heads // groups * head_dim
    q, k, v = per[:, :nq], per[:, nq : nq + head_dim], per[:, nq + head_dim :]
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


# ---------------------------------------------------------------------------------------------------
# Hugging Face -> ours and back (whole tensors; `get(name)` reads one Hugging Face tensor)
# ---------------------------------------------------------------------------------------------------


def language_to_ours(get: Callable[[str], torch.Tensor], spec) -> dict[str, torch.Tensor]:
    """`LanguageModule` state-dict names (`gpt.`...) of a Llama/Qwen2 model."""
    ng = spec.num_query_groups or spec.num_attention_heads
    out = {
        "gpt.embedding.word_embeddings.weight": get("model.embed_tokens.weight"),
        "gpt.decoder.final_layernorm.weight": get("model.norm.weight"),
    }
    if spec.untie_embeddings_and_output_weights:
        out["gpt.output_layer.weight"] = get("lm_head.weight")
    for i in range(spec.num_layers):
        p, o = f"model.layers.{i}.", f"gpt.decoder.layers.{i}."
        a = p + "self_attn."
        out[o + "self_attention.linear_qkv.weight"] = fuse_qkv(
            get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"), ng
        )
        if spec.add_qkv_bias:
            out[o + "self_attention.linear_qkv.bias"] = fuse_qkv(
                get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias"), ng
            )
        out[o + "self_attention.linear_proj.weight"] = get(a + "o_proj.weight")
        out[o + "mlp.linear_fc1.weight"] = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        out[o + "mlp.linear_fc2.weight"] = get(p + "mlp.down_proj.weight")
        out[o + "input_layernorm.weight"] = get(p + "input_layernorm.weight")
        out[o + "pre_mlp_layernorm.weight"] = get(p + "post_attention_layernorm.weight")
    return out


def language_to_hf(ours: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    nh, ng, d = spec.num_attention_heads, spec.num_query_groups or spec.num_attention_heads, _head_dim(spec)
    out = {
        "model.embed_tokens.weight": ours["gpt.embedding.word_embeddings.weight"],
        "model.norm.weight": ours["gpt.decoder.final_layernorm.weight"],
    }
    if spec.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = ours["gpt.output_layer.weight"]
    for i in range(spec.num_layers):
        p, o = f"model.layers.{i}.", f"gpt.decoder.layers.{i}."
        a = p + "self_attn."
        q, k, v = split_qkv(ours[o + "self_attention.linear_qkv.weight"], nh, ng, d)
        out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
        if spec.add_qkv_bias:
            q, k, v = split_qkv(ours[o + "self_attention.linear_qkv.bias"], nh, ng, d)
            out.update({a + "q_proj.bias": q, a + "k_proj.bias": k, a + "v_proj.bias": v})
        out[a + "o_proj.weight"] = ours[o + "self_attention.linear_proj.weight"]
        gate, up = ours[o + "mlp.linear_fc1.weight"].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[p + "mlp.down_proj.weight"] = ours[o + "mlp.linear_fc2.weight"]
        out[p + "input_layernorm.weight"] = ours[o + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = ours[o + "pre_mlp_layernorm.weight"]
    return out


_VISION_RENAMES = (
    ("embeddings.patch_embedding.weight", "vit.conv1.weight"),
    ("embeddings.position_embedding.weight", "vit.position_embeddings.weight"),
    ("pre_layrnorm.weight", "vit.ln_pre.weight"),
    ("pre_layrnorm.bias", "vit.ln_pre.bias"),
    ("post_layernorm.weight", "ln_post.weight"),
    ("post_layernorm.bias", "ln_post.bias"),
)
_VISION_LAYER_RENAMES = (
    ("self_attn.out_proj", "self_attention.linear_proj"),
    ("layer_norm1", "input_layernorm"),
    ("layer_norm2", "pre_mlp_layernorm"),
    ("mlp.fc1", "mlp.linear_fc1"),
    ("mlp.fc2", "mlp.linear_fc2"),
)


_SIGLIP_RENAMES = (
    ("embeddings.patch_embedding.weight", "vit.conv1.weight"),
    ("embeddings.patch_embedding.bias", "vit.conv1.bias"),
    ("embeddings.position_embedding.weight", "vit.position_embeddings.weight"),
    ("post_layernorm.weight", "ln_post.weight"),
    ("post_layernorm.bias", "ln_post.bias"),
)


def _tower_renames(enc) -> tuple[tuple[str, str], ...]:
    """(Hugging Face name without the prefix, ours) of the tower's non-layer tensors."""
    if enc.kind != "siglip":
        return _VISION_RENAMES
    f = enc.ffn_hidden_size or 4 * enc.hidden_size
    head = (
        tuple((f"head.{k}", f"head.{k}") for k in _siglip_head_shapes(enc.hidden_size, f)) if enc.pooling_head else ()
    )
    return _SIGLIP_RENAMES + head


def vision_to_ours(get: Callable[[str], torch.Tensor], enc) -> dict[str, torch.Tensor]:
    """`ClipEncoderModule` / `SiglipEncoderModule` state-dict names (`vit.`..., `ln_post.`, SigLIP's
    `head.`) of a CLIP or SigLIP vision tower."""
    P, h, n = VISION_PREFIX, enc.hidden_size, enc.num_attention_heads
    out = {ours: get(P + hf) for hf, ours in _tower_renames(enc)}
    if enc.kind != "siglip":
        out["vit.class_token"] = get(P + "embeddings.class_embedding").reshape(1, 1, h)
    for i in range(enc.num_layers):
        q, o = f"{P}encoder.layers.{i}.", f"vit.decoder.layers.{i}."
        for kind in ("weight", "bias"):
            out[f"{o}self_attention.linear_qkv.{kind}"] = fuse_qkv(
                get(f"{q}self_attn.q_proj.{kind}"),
                get(f"{q}self_attn.k_proj.{kind}"),
                get(f"{q}self_attn.v_proj.{kind}"),
                n,
            )
            for hf, ours in _VISION_LAYER_RENAMES:
                out[f"{o}{ours}.{kind}"] = get(f"{q}{hf}.{kind}")
    return out


def vision_to_hf(ours: dict[str, torch.Tensor], enc) -> dict[str, torch.Tensor]:
    P, h, n = VISION_PREFIX, enc.hidden_size, enc.num_attention_heads
    out = {P + hf: ours[o] for hf, o in _tower_renames(enc)}
    if enc.kind != "siglip":
        out[P + "embeddings.class_embedding"] = ours["vit.class_token"].reshape(h)
    for i in range(enc.num_layers):
        q, o = f"{P}encoder.layers.{i}.", f"vit.decoder.layers.{i}."
        for kind in ("weight", "bias"):
            qq, kk, vv = split_qkv(ours[f"{o}self_attention.linear_qkv.{kind}"], n, n, h // n)
            out.update(
                {
                    f"{q}self_attn.q_proj.{kind}": qq,
                    f"{q}self_attn.k_proj.{kind}": kk,
                    f"{q}self_attn.v_proj.{kind}": vv,
                }
            )
            for hf, ours_name in _VISION_LAYER_RENAMES:
                out[f"{q}{hf}.{kind}"] = ours[f"{o}{ours_name}.{kind}"]
    return out


_PROJECTOR = (("linear_1", "projector.encoder.linear_fc1"), ("linear_2", "projector.encoder.linear_fc2"))


def projector_to_ours(get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """LLaVA's `multi_modal_projector.linear_1/2` -> the encoder module's `projector.encoder.linear_fc1/2`."""
    return {f"{o}.{k}": get(f"{PROJECTOR_PREFIX}{hf}.{k}") for hf, o in _PROJECTOR for k in ("weight", "bias")}


def projector_to_hf(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{PROJECTOR_PREFIX}{hf}.{k}": ours[f"{o}.{k}"] for hf, o in _PROJECTOR for k in ("weight", "bias")}


def contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor as its own contiguous storage (safetensors refuses shared or strided views)."""
    return {k: v.detach().contiguous().clone() for k, v in tensors.items()}
