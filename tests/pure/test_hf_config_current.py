"""`models.hf_config` on the configurations of current VLM parts, as their config.json files state
them (field values of the published models; no weights, no torch): SigLIP so400m-patch14-384 (27 x 27
patches over 378 of its 384 pixels), Llama 3.1 8B and 3.2 1B (llama3 rope scaling), Qwen2.5 7B and
0.5B, and transformers 5's `rope_parameters` form of the same Llama config."""

from __future__ import annotations

import pytest

from megatron_hetero.models import hf_config

LLAMA31_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "tie_word_embeddings": False,
    "rope_scaling": None,
}
SIGLIP_SO400M_384 = {
    "model_type": "siglip",
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "image_size": 384,
        "patch_size": 14,
    },
    "text_config": {"model_type": "siglip_text_model", "hidden_size": 1152},
}


def test_llama31_maps_to_megatron_rope_scaling():
    f = hf_config.language_fields(LLAMA31_8B)
    assert (f["rope_scaling"], f["rope_scaling_factor"], f["rotary_base"], f["num_query_groups"]) == (
        True,
        8.0,
        5e5,
        8,
    )
    assert f["untie_embeddings_and_output_weights"] and not f["add_qkv_bias"] and f["kv_channels"] is None


def test_llama32_factor_32_and_tied_embeddings():
    cfg = {**LLAMA31_8B, "tie_word_embeddings": True, "rope_scaling": {**LLAMA31_8B["rope_scaling"], "factor": 32.0}}
    f = hf_config.language_fields(cfg)
    assert f["rope_scaling_factor"] == 32.0 and not f["untie_embeddings_and_output_weights"]


def test_transformers5_rope_parameters_are_read():
    cfg = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling")}
    cfg["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    assert hf_config.language_fields(cfg) == hf_config.language_fields(LLAMA31_8B)
    plain = {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    f = hf_config.language_fields(plain)
    assert f["rotary_base"] == 1e6 and "rope_scaling" not in f
    with pytest.raises(hf_config.UnsupportedModel, match="per-layer-type rope parameters"):
        hf_config.language_fields({**cfg, "rope_parameters": {"full_attention": {"rope_type": "default"}}})


def test_qwen25_is_qwen2_with_untied_embeddings_and_rope_base_1e6():
    f = hf_config.language_fields(QWEN25_7B)
    assert (f["add_qkv_bias"], f["rotary_base"], f["untie_embeddings_and_output_weights"], f["num_query_groups"]) == (
        True,
        1e6,
        True,
        4,
    )
    tied = hf_config.language_fields({**QWEN25_7B, "tie_word_embeddings": True})  # 0.5B-3B
    assert not tied["untie_embeddings_and_output_weights"]
    with pytest.raises(hf_config.UnsupportedModel, match="rope_type 'yarn' is not supported"):
        hf_config.language_fields(
            {**QWEN25_7B, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
        )


def test_siglip_so400m_384_reads_27_by_27_patches():
    f = hf_config.encoder_fields(SIGLIP_SO400M_384)
    assert (f["kind"], f["tokens"], f["patch_size"], f["feature_dim"], f["activation"], f["norm_epsilon"]) == (
        "siglip",
        27 * 27,
        14,
        3 * 14 * 14,
        "gelu_pytorch_tanh",
        1e-6,
    )
    assert f["post_norm"] and f["pooling_head"]
    assert not hf_config.encoder_fields({**SIGLIP_SO400M_384["vision_config"], "vision_use_head": False})[
        "pooling_head"
    ]
    with pytest.raises(hf_config.UnsupportedModel, match="not a multiple of patch_size"):  # CLIP's stays strict
        hf_config.encoder_fields({**SIGLIP_SO400M_384["vision_config"], "model_type": "clip_vision_model"})
