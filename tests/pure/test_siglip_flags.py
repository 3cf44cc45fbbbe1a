"""Megatron-LM's `--use-rope-scaling` / `--rope-scaling-factor` and `--vision-model-type siglip` on
`train`: they build the model a converted Llama 3.1 + SigLIP checkpoint records (compared with what
`models.hf_config` reads from the config.json of each), and inconsistent combinations are ValueErrors
naming the flags. Pure: no torch."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from megatron_hetero import cli
from megatron_hetero.checkpoint.records import spec_record
from megatron_hetero.models import hf_config
from megatron_hetero.config.model import LlavaSpec, spec_from_flags
from megatron_hetero.cli.train_door import arch_flags, model_flags
from megatron_hetero.config.arch import apply_arch_flags

ROPE = ["--position-embedding-type", "rope"]


def _spec(*flags: str) -> LlavaSpec:
    args = cli.build_parser().parse_args(["train", *flags])
    return apply_arch_flags(arch_flags(args), spec_from_flags(model_flags(args)), model_flags(args))


def test_rope_scaling_flags_take_megatrons_default_factor() -> None:
    plain = _spec(*ROPE)
    assert (plain.rope_scaling, plain.rope_scaling_factor) == (False, 8.0)
    assert "rope_scaling" not in spec_record(plain)  # the record of a model without it stays as it was
    on = _spec(*ROPE, "--use-rope-scaling")
    assert (on.rope_scaling, on.rope_scaling_factor) == (True, 8.0)
    assert spec_record(on)["rope_scaling"] is True
    big = _spec(*ROPE, "--use-rope-scaling", "--rope-scaling-factor", "32")
    assert (big.rope_scaling, big.rope_scaling_factor) == (True, 32.0)
    assert spec_record(big)["rope_scaling_factor"] == 32.0


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--rope-scaling-factor", "8"], "--rope-scaling-factor 8.0 needs --use-rope-scaling"),
        (ROPE + ["--rope-scaling-factor", "32"], "--rope-scaling-factor 32.0 needs --use-rope-scaling"),
        (["--use-rope-scaling"], "--use-rope-scaling scales rotary positions: it needs --position-embedding-type rope"),
        (
            ["--use-rope-scaling", "--position-embedding-type", "learned_absolute"],
            r"needs --position-embedding-type rope \(the model's is learned_absolute\)",
        ),
        (ROPE + ["--use-rope-scaling", "--rope-scaling-factor", "0.5"], "--rope-scaling-factor 0.5 must be >= 1"),
        (["--vision-model-type", "siglip"], "--vision-model-type siglip needs --patch-dim P"),
        (
            ["--vision-model-type", "siglip", "--patch-dim", "4", "--encoder-feature-dim", "12"],
            r"a SIGLIP encoder's features are 3 \* --patch-dim\*\*2 = 48",
        ),
        (["--patch-dim", "4"], "--patch-dim applies to --vision-model-type clip, siglip or qwen2.5-vl"),
    ],
)
def test_inconsistent_flags_are_refused(flags: list[str], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        _spec(*flags)


def _comparable(enc: Any) -> dict:
    """An encoder's fields with the MLP width spelled out (a flag-built one leaves it to 4 * hidden)."""
    d = dataclasses.asdict(enc)
    d["ffn_hidden_size"] = enc.ffn_hidden_size or 4 * enc.hidden_size
    return d


def test_siglip_flags_build_the_tower_a_siglip_config_describes() -> None:
    """--vision-model-type siglip gives every encoder Megatron's siglip variant as convert reads a
    SiglipVisionModel config.json (without the pooling head, which Megatron's siglip does not have):
    gelu tanh, LayerNorm epsilon 1e-6, the post LayerNorm on the features, no class token."""
    enc = _spec(
        "--vision-model-type", "siglip", "--patch-dim", "14", "--encoder-tokens", "729",
        "--encoder-hidden-size", "64", "--encoder-num-attention-heads", "4", "--encoder-num-layers", "3",
    ).encoders["vision"]  # fmt: skip
    cfg = {
        "model_type": "siglip_vision_model",
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "image_size": 384,  # 27 x 27 patches of 14 (the last 6 rows and columns unread), as so400m-patch14-384
        "patch_size": 14,
        "vision_use_head": False,
    }
    want = hf_config.encoder_fields(cfg)
    assert _comparable(enc) == _comparable(dataclasses.replace(enc, **want))
    assert (enc.kind, enc.post_norm, enc.pooling_head, enc.tokens, enc.feature_dim) == ("siglip", True, False, 729, 588)
    clip = _spec("--vision-model-type", "clip", "--patch-dim", "14", "--encoder-tokens", "256").encoders["vision"]
    assert (clip.kind, clip.activation, clip.norm_epsilon, clip.post_norm) == ("clip", "quick_gelu", 1e-5, False)


def test_rope_flags_build_the_language_model_a_llama31_config_describes() -> None:
    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    want = hf_config.language_fields(cfg)
    flags = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --vocab-size 128"
    flags += " --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope"
    flags += " --rotary-base 500000 --group-query-attention --num-query-groups 2 --disable-bias-linear"
    got = _spec(*flags.split(), "--use-rope-scaling", "--rope-scaling-factor", "32")
    assert {k: getattr(got, k) for k in want} == want
