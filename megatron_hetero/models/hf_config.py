"""Hugging Face `config.json` <-> the model family's architecture fields (pure: no torch).

Reading decides, from the configuration alone and BEFORE any weight is read, whether the model
family can express the model; what it cannot is refused with a ValueError naming the option and
why (`UnsupportedModel`). Supported:

  vision   `CLIPVisionModel` (model_type `clip_vision_model`), or the vision tower of a full
           `CLIPModel` (model_type `clip`, its `vision_config`): hidden_act quick_gelu or gelu,
           3 channels, square images; -> `EncoderSpec(kind="clip")`.
  language `LlamaForCausalLM` (model_type `llama`: no attention/MLP biases) and `Qwen2ForCausalLM`
           (`qwen2`: QKV bias, no sliding window): hidden_act silu, no rope scaling;
           -> the `LlavaSpec` language fields (RMSNorm, swiglu, rope, query groups, tied or not).

Writing is the inverse (`vision_config_json`, `language_config_json`), used by
`convert checkpoint-to-hf` when the checkpoint holds no original `config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VISION_TYPES = ("clip_vision_model", "clip")
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
    """The CLIP vision configuration inside `cfg` (itself, or a CLIPModel's `vision_config`)."""
    kind = cfg.get("model_type")
    if kind == "clip":
        return {"model_type": "clip_vision_model", **_need(cfg, "vision_config", where)}
    if kind != "clip_vision_model":
        raise UnsupportedModel(
            f"{where}: model_type {kind!r} is not a vision tower this family expresses "
            f"(supported: {', '.join(VISION_TYPES)}; SigLIP's is not yet)"
        )
    return cfg


def encoder_fields(cfg: dict, where: str = "--vision") -> dict:
    """`EncoderSpec` keyword arguments of a CLIP vision configuration (tokens = patches, feature_dim
    = 3 * patch**2; `offset` left to the caller)."""
    v = vision_tower_config(cfg, where)
    act = v.get("hidden_act", "quick_gelu")
    if act not in ("quick_gelu", "gelu"):
        raise UnsupportedModel(
            f"{where}: hidden_act {act!r} is not supported (the CLIP encoder's MLP takes quick_gelu or gelu)"
        )
    if v.get("num_channels", 3) != 3:
        raise UnsupportedModel(f"{where}: num_channels {v.get('num_channels')}: Megatron's CLIPViTModel takes RGB (3)")
    image, patch = int(v.get("image_size", 224)), int(v.get("patch_size", 32))
    if image % patch:
        raise UnsupportedModel(f"{where}: image_size {image} is not a multiple of patch_size {patch}")
    hidden, heads = int(_need(v, "hidden_size", where)), int(_need(v, "num_attention_heads", where))
    if hidden % heads:
        raise UnsupportedModel(f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    return dict(
        kind="clip",
        num_layers=int(_need(v, "num_hidden_layers", where)),
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=int(_need(v, "intermediate_size", where)),
        tokens=(image // patch) ** 2,
        feature_dim=3 * patch * patch,
        patch_size=patch,
        norm_epsilon=float(v.get("layer_norm_eps", 1e-5)),
        activation=act,
    )


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
    if cfg.get("rope_scaling"):
        raise UnsupportedModel(
            f"{where}: rope_scaling {cfg['rope_scaling']!r} is not supported (plain rotary positions only)"
        )
    if kind == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise UnsupportedModel(
            f"{where}: attention_bias/mlp_bias on a Llama model is not supported (biases on "
            "q, k, v AND o_proj; Megatron's add_qkv_bias covers q, k, v only)"
        )
    if kind == "qwen2" and cfg.get("use_sliding_window"):
        raise UnsupportedModel(f"{where}: use_sliding_window is not supported (full attention only)")
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
        rotary_base=float(cfg.get("rope_theta", 10000.0)),
        num_query_groups=groups if groups != heads else None,
        kv_channels=int(head_dim) if head_dim * heads != hidden else None,
        add_bias_linear=False,
        add_qkv_bias=kind == "qwen2",
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
    )


def vision_config_json(enc) -> dict:
    """A `CLIPVisionModel` config.json of an `EncoderSpec(kind="clip")`."""
    side = round(enc.tokens**0.5) * enc.patch_size
    return {
        "architectures": ["CLIPVisionModel"],
        "model_type": "clip_vision_model",
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
    return out


def check_hf_expressible(spec) -> None:
    """ValueError unless the checkpoint's model is one `checkpoint-to-hf` can write (Llama/Qwen2-style
    language model; CLIP encoders)."""
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
