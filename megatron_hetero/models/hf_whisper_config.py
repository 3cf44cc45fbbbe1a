"""Hugging Face Whisper config.json <-> the `EncoderSpec(kind="whisper")` of its encoder.

Read: a `WhisperModel` / `WhisperForConditionalGeneration` config (model_type `whisper`): its encoder
(num_mel_bins, d_model, encoder_layers, encoder_attention_heads, encoder_ffn_dim,
max_source_positions) -> feature_dim = 2 * num_mel_bins (two frames a token), tokens =
max_source_positions. Refused with the reason (`hf_config.UnsupportedModel`): another model_type, an
activation other than exact gelu. Write: an encoder-only `WhisperModel` config with a one-layer
decoder of the same width (a WhisperModel needs one; `--audio` keeps only the encoder).
"""

from __future__ import annotations

from megatron_hetero.models.hf_config import UnsupportedModel, _need

WHISPER_TYPES = ("whisper",)


def whisper_fields(cfg: dict, where: str = "--audio") -> dict:
    """`EncoderSpec` keyword arguments of a Whisper config.json's encoder."""
    if cfg.get("model_type") not in WHISPER_TYPES:
        raise UnsupportedModel(
            f"{where}: model_type {cfg.get('model_type')!r} is not a Whisper model (WhisperModel or "
            "WhisperForConditionalGeneration)"
        )
    act = cfg.get("activation_function", "gelu")
    if act != "gelu":
        raise UnsupportedModel(f"{where}: activation_function {act!r} is not supported (Whisper's exact gelu only)")
    hidden = int(_need(cfg, "d_model", where))
    heads = int(_need(cfg, "encoder_attention_heads", where))
    if hidden % heads:
        raise UnsupportedModel(f"{where}: d_model {hidden} is not divisible by encoder_attention_heads {heads}")
    return dict(
        kind="whisper",
        num_layers=int(_need(cfg, "encoder_layers", where)),
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=int(cfg.get("encoder_ffn_dim", 4 * hidden)),
        tokens=int(_need(cfg, "max_source_positions", where)),
        feature_dim=2 * int(_need(cfg, "num_mel_bins", where)),
        norm_epsilon=1e-5,
        activation="gelu",
    )


def whisper_config_json(enc) -> dict:
    """A `WhisperModel` config.json of an `EncoderSpec(kind="whisper")`."""
    ffn = enc.ffn_hidden_size or 4 * enc.hidden_size
    return {
        "architectures": ["WhisperModel"],
        "model_type": "whisper",
        "num_mel_bins": enc.feature_dim // 2,
        "d_model": enc.hidden_size,
        "encoder_layers": enc.num_layers,
        "encoder_attention_heads": enc.num_attention_heads,
        "encoder_ffn_dim": ffn,
        "max_source_positions": enc.tokens,
        "decoder_layers": 1,
        "decoder_attention_heads": enc.num_attention_heads,
        "decoder_ffn_dim": ffn,
        "activation_function": "gelu",
        "vocab_size": 8,
        "max_target_positions": 8,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "decoder_start_token_id": 1,
        "torch_dtype": "float32",
    }
