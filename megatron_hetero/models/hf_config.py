"""Hugging Face `config.json` <-> the model family's architecture fields (pure: no torch).

Reading decides, from the configuration alone and BEFORE any weight is read, whether the model
family can express the model; what it cannot is refused with a ValueError naming the option and
why (`UnsupportedModel`). Supported:

  vision   `CLIPVisionModel` (model_type `clip_vision_model`), or the vision tower of a full
           `CLIPModel` (model_type `clip`, its `vision_config`): hidden_act quick_gelu or gelu,
           3 channels, square images; -> `EncoderSpec(kind="clip")`.
           `SiglipVisionModel` (`siglip_vision_model`), or the vision tower of a full `SiglipModel`
           (`siglip`): hidden_act gelu_pytorch_tanh or gelu, 3 channels, square images, with or
           without the attention-pooling head (`vision_use_head`); -> `EncoderSpec(kind="siglip")`.
           SigLIP 2 (`siglip2*`: variable resolution) is refused.
  language `LlamaForCausalLM` (model_type `llama`: no attention/MLP biases) and `Qwen2ForCausalLM`
           (`qwen2`, Qwen2 and Qwen2.5: QKV bias, every layer full attention): hidden_act silu;
           rope scaling only Llama 3.1's `llama3` with low_freq_factor 1, high_freq_factor 4 and
           original_max_position_embeddings 8192 (what Megatron-core's RotaryEmbedding computes:
           `rope_scaling` / `rope_scaling_factor`); -> the `LlavaSpec` language fields (RMSNorm,
           swiglu, rope, query groups, tied or not).

Writing is the inverse (`vision_config_json`, `language_config_json`), used by
`convert checkpoint-to-hf` when the checkpoint holds no original `config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from megatron_hetero.models.hybrid_pattern import is_gpt_pairs

VISION_TYPES = ("clip_vision_model", "clip", "siglip_vision_model", "siglip")
SIGLIP_TYPES = ("siglip_vision_model", "siglip")
# Megatron-core 0.19's RotaryEmbedding._apply_scaling takes only the factor; these are fixed there
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LANGUAGE_TYPES = ("llama", "qwen2")


class UnsupportedModel(ValueError):
    """The model family cannot express this Hugging Face model (the message says which option)."""


def read_config(folder: str | Path) -> dict:
    """`folder/config.json` as a dict; ValueError naming the file."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json (a Hugging Face model folder holds config.json and *.safetensors)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return cfg


def _need(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg:
        raise ValueError(f"{where}: config.json has no {key!r}")
    return cfg[key]


def vision_tower_config(cfg: dict, where: str) -> dict:
    """The CLIP or SigLIP vision configuration inside `cfg` (itself, or a CLIPModel's / SiglipModel's
    `vision_config`), with its tower's model_type."""
    kind = cfg.get("model_type")
    if kind in ("clip", "siglip"):
        return {**_need(cfg, "vision_config", where), "model_type": f"{kind}_vision_model"}
    if kind not in VISION_TYPES:
        hint = " (SigLIP 2's variable-resolution towers are not supported)" if str(kind).startswith("siglip2") else ""
        raise UnsupportedModel(
            f"{where}: model_type {kind!r} is not a vision tower this family expresses "
            f"(supported: {', '.join(VISION_TYPES)}){hint}"
        )
    return cfg


def encoder_fields(cfg: dict, where: str = "--vision") -> dict:
    """`EncoderSpec` keyword arguments of a CLIP or SigLIP vision configuration (tokens = patches,
    feature_dim = 3 * patch**2; `offset` left to the caller; a SigLIP tower's `post_norm` True: the
    whole tower's last_hidden_state, which the caller changes for a cut tower)."""
    v = vision_tower_config(cfg, where)
    siglip = v["model_type"] in SIGLIP_TYPES
    if siglip:
        act, acts = v.get("hidden_act", "gelu_pytorch_tanh"), ("gelu_pytorch_tanh", "gelu")
        why = "the SigLIP encoder's MLP takes gelu_pytorch_tanh (gelu's tanh approximation) or gelu"
    else:
        act, acts = v.get("hidden_act", "quick_gelu"), ("quick_gelu", "gelu")
        why = "the CLIP encoder's MLP takes quick_gelu or gelu"
    if act not in acts:
        raise UnsupportedModel(f"{where}: hidden_act {act!r} is not supported ({why})")
    if v.get("num_channels", 3) != 3:
        raise UnsupportedModel(f"{where}: num_channels {v.get('num_channels')}: Megatron's CLIPViTModel takes RGB (3)")
    image, patch = v.get("image_size", 224), int(v.get("patch_size", 16 if siglip else 32))
    if not isinstance(image, int):
        raise UnsupportedModel(f"{where}: image_size {image!r}: Megatron's CLIPViTModel takes square images (one int)")
    if image % patch and not siglip:
        raise UnsupportedModel(f"{where}: image_size {image} is not a multiple of patch_size {patch}")
    # SigLIP's "valid" patch convolution never reads the last image_size % patch_size rows and columns
    # (so400m-patch14-384: 27 x 27 patches over 378 of the 384 pixels): the tower is the same over the
    # (image // patch) * patch square, which is what the encoder is built for
    hidden, heads = int(_need(v, "hidden_size", where)), int(_need(v, "num_attention_heads", where))
    if hidden % heads:
        raise UnsupportedModel(f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    out = dict(
        kind="siglip" if siglip else "clip",
        num_layers=int(_need(v, "num_hidden_layers", where)),
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=int(_need(v, "intermediate_size", where)),
        tokens=(image // patch) ** 2,
        feature_dim=3 * patch * patch,
        patch_size=patch,
        norm_epsilon=float(v.get("layer_norm_eps", 1e-6 if siglip else 1e-5)),
        activation=act,
    )
    if siglip:
        out.update(post_norm=True, pooling_head=bool(v.get("vision_use_head", True)))
    return out


def rope_theta(cfg: dict) -> float:
    """The rotary base: `rope_theta`, or (transformers 5's config.json) `rope_parameters.rope_theta`."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def rope_scaling_fields(cfg: dict, where: str) -> dict:
    """`rope_scaling` / `rope_scaling_factor` of a config's `rope_scaling` (transformers 5:
    `rope_parameters`): none, `default`, or Llama 3.1's `llama3` with the parameters Megatron-core
    fixes; UnsupportedModel otherwise."""
    rs = cfg["rope_parameters"] if "rope_parameters" in cfg else cfg.get("rope_scaling")
    if not rs:
        return {}
    if not isinstance(rs, dict):
        raise UnsupportedModel(f"{where}: rope_scaling {rs!r} is not a JSON object")
    kind = rs.get("rope_type", rs.get("type"))
    if kind is None and "rope_parameters" in cfg:
        raise UnsupportedModel(
            f"{where}: rope_parameters {rs!r} has no rope_type (per-layer-type rope parameters are not supported)"
        )
    if kind == "default":
        return {}
    if kind != "llama3":
        raise UnsupportedModel(
            f"{where}: rope_scaling {rs!r}: rope_type {kind!r} is not supported (Megatron-core's "
            "RotaryEmbedding computes Llama 3.1's 'llama3' frequency scaling only; linear, dynamic, yarn "
            "and longrope positions differ)"
        )
    for key, fixed in LLAMA3_FIXED.items():
        if key not in rs or float(rs[key]) != fixed:
            raise UnsupportedModel(
                f"{where}: rope_scaling {key} {rs.get(key)!r} is not supported (Megatron-core's llama3 rope "
                f"scaling fixes low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192, "
                "as in Llama 3.1-3.3; only the factor is a parameter)"
            )
    factor = float(_need(rs, "factor", f"{where} rope_scaling"))
    if factor < 1.0:
        raise UnsupportedModel(f"{where}: rope_scaling factor {factor} must be >= 1")
    return {"rope_scaling": True, "rope_scaling_factor": factor}


def language_fields(cfg: dict, where: str = "--language") -> dict:
    """`LlavaSpec` keyword arguments (the language model's) of a Llama or Qwen2 configuration."""
    kind = cfg.get("model_type")
    if kind not in LANGUAGE_TYPES:
        raise UnsupportedModel(
            f"{where}: model_type {kind!r} is not a language model this family expresses "
            f"(supported: {', '.join(LANGUAGE_TYPES)})"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(
            f"{where}: hidden_act {act!r} is not supported (the Llama/Qwen2-style MLP is SwiGLU: silu(gate) * up)"
        )
    rope = rope_scaling_fields(cfg, where)
    if kind == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise UnsupportedModel(
            f"{where}: attention_bias/mlp_bias on a Llama model is not supported (biases on "
            "q, k, v AND o_proj; Megatron's add_qkv_bias covers q, k, v only)"
        )
    if kind == "qwen2" and cfg.get("use_sliding_window"):
        raise UnsupportedModel(f"{where}: use_sliding_window is not supported (full attention only)")
    sliding = sorted({t for t in cfg.get("layer_types") or [] if t != "full_attention"})
    if sliding:
        raise UnsupportedModel(f"{where}: layer_types {sliding} are not supported (full attention only)")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModel(
            f"{where}: partial_rotary_factor {cfg['partial_rotary_factor']} is not supported (rotary over the whole head)"
        )
    hidden, heads = int(_need(cfg, "hidden_size", where)), int(_need(cfg, "num_attention_heads", where))
    groups = int(cfg.get("num_key_value_heads") or heads)
    if heads % groups:
        raise UnsupportedModel(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}"
        )
    head_dim = cfg.get("head_dim") or hidden // heads
    return dict(
        num_layers=int(_need(cfg, "num_hidden_layers", where)),
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=int(_need(cfg, "intermediate_size", where)),
        vocab_size=int(_need(cfg, "vocab_size", where)),
        normalization="RMSNorm",
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=float(rope_theta(cfg)),
        num_query_groups=groups if groups != heads else None,
        kv_channels=int(head_dim) if head_dim * heads != hidden else None,
        add_bias_linear=False,
        add_qkv_bias=kind == "qwen2",
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        **rope,
    )


def vision_config_json(enc) -> dict:
    """A `CLIPVisionModel` / `SiglipVisionModel` config.json of an `EncoderSpec(kind="clip"/"siglip")`."""
    side = round(enc.tokens**0.5) * enc.patch_size
    siglip = enc.kind == "siglip"
    extra = {"vision_use_head": enc.pooling_head} if siglip else {}
    return {
        "architectures": ["SiglipVisionModel" if siglip else "CLIPVisionModel"],
        "model_type": "siglip_vision_model" if siglip else "clip_vision_model",
        **extra,
        "hidden_size": enc.hidden_size,
        "intermediate_size": enc.ffn_hidden_size or 4 * enc.hidden_size,
        "num_hidden_layers": enc.num_layers,
        "num_attention_heads": enc.num_attention_heads,
        "num_channels": 3,
        "image_size": side,
        "patch_size": enc.patch_size,
        "hidden_act": enc.activation,
        "layer_norm_eps": enc.norm_epsilon,
        "torch_dtype": "float32",
    }


def language_config_json(spec) -> dict:
    """A Llama (no QKV bias) or Qwen2 (QKV bias) config.json of a `LlavaSpec`'s language model."""
    qwen = spec.add_qkv_bias
    heads = spec.num_attention_heads
    out = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size or 4 * spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": spec.num_query_groups or heads,
        "vocab_size": spec.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": spec.norm_epsilon,
        "rope_theta": spec.rotary_base,
        "tie_word_embeddings": not spec.untie_embeddings_and_output_weights,
        "max_position_embeddings": spec.seq_length,
        "torch_dtype": "float32",
    }
    if spec.kv_channels:
        out["head_dim"] = spec.kv_channels
    if spec.rope_scaling:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": spec.rope_scaling_factor, **LLAMA3_FIXED}
    return out


def check_hf_expressible(spec) -> None:
    """ValueError unless the checkpoint's model is one `checkpoint-to-hf` can write (Llama/Qwen2-style
    language model; CLIP encoders)."""

    if spec.hybrid_layer_pattern is not None and not is_gpt_pairs(spec.hybrid_layer_pattern):
        raise ValueError(
            f"the checkpoint's language model is a HybridModel of {spec.hybrid_layer_pattern!r}: only '*-' pairs "
            "(one Llama/Qwen2 layer each) have a Hugging Face form"
        )
    lm_ok = (
        spec.normalization == "RMSNorm"
        and spec.swiglu
        and spec.position_embedding_type == "rope"
        and not spec.add_bias_linear
        and not spec.num_experts
    )
    if not lm_ok:
        raise ValueError(
            "the checkpoint's language model is not Llama/Qwen2-style (RMSNorm, swiglu, rope, no "
            "linear biases, dense): it has no Hugging Face form"
        )
